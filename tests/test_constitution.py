"""The constitutional pipeline (chapter 17b) against our real server on 127.0.0.1 with a tiny random model as
classifier, policy, reward model and judge (every stage runs and gives well-formed output), and its pieces against
hand-worked values: the charter's checks, the 1–9 scale, the probability-weighted score, both-order pairwise
averaging, Spearman and Kendall, the degradations, and that every prompt leaves the pipeline exactly once."""
import copy
import math
import random
import socket

import pytest
import yaml
from chat_models import chat_checkpoint
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from openpretrain.core import ConfigError, data_dir, from_dict
from openpretrain.posttrain.constitution import (
    DEFECTS, POINTWISE, QUALITY, SCALE, STYLES, CalibrationConfig, CalibrationItem, Comparison, Completion, ConstitutionConfig,
    Judge, JudgeConfig, Policy, Prompt, Sensitivity, Tracks, accounting, both_orders, calibrate, charter_instructions,
    charter_persona, charter_text, cited_clauses, classify, completions, degrade, load_charter, load_examples, order_logprobs,
    pair, pairwise_agreement, parse_sensitivity, rank_agreement, two_track, weighted_score)
from openpretrain.posttrain.preference import PairConfig
from openpretrain.engine import ChatModel
from openpretrain.posttrain.client import ChatClient, ChatError, MalformedAnswer, Reply
from openpretrain.posttrain.server import ServeConfig, app, serving

TITLES = ["Response Quality", "Knowledge and Reasoning Standards", "Respectful Communication", "Preventing Harm",
          "Resolving Value Conflicts", "Professional Competence Boundaries", "Collective Decision-Making",
          "Autonomy and Personal Boundaries", "Long-term Orientation and Sustainability", "Human Agency",
          "AI Identity and Limits"]                            # the seed's eleven articles, in the report's order
CHARTER = load_charter()
SMALL = ConstitutionConfig(pairs=PairConfig(n_refs=3), samples=1, max_tokens=12, classifier_tokens=16)


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    "Our server over a random chat model with a 4,096-id context (a judge prompt holds the whole charter), stopped after."
    served = ChatModel.load(chat_checkpoint(tmp_path_factory.mktemp("judge"), max_seq_len=4096))
    with serving(app(served, ServeConfig(max_concurrency=2, max_tokens=64))) as base_url:
        yield base_url
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", int(base_url.rsplit(":", 1)[1].split("/")[0])), timeout=1)


@pytest.fixture
def client(url):
    return ChatClient(url, max_concurrency=2)


def lp(p: float) -> float:
    return math.log(p)


class Scripted(ChatClient):
    "A judge or classifier server that needs no network: each batch is answered by the next of its `replies`."
    def __init__(self, replies):
        super().__init__("http://127.0.0.1:9/v1")
        self.replies = list(replies)

    def chat_many(self, conversations, seeds=None, errors=False, **sampling):
        out, self.replies = self.replies[:len(conversations)], self.replies[len(conversations):]
        if not errors and (failed := next((r for r in out if isinstance(r, ChatError)), None)):
            raise failed
        return out


def judged(top: list, first: str = "7") -> Reply:
    "A judge reply whose first token has the top log-probs `top`."
    return Reply(first, "stop", [{"token": first, "logprob": -0.1, "top_logprobs": top}], {})


BAD = {  # a malformed judge reply, and what its Score's error says
    "no top_logprobs": (Reply("7", "stop", [{"token": "7", "logprob": -0.1}], {}), "no top_logprobs list"),
    "logprobs not a list": (Reply("7", "stop", {"content": []}, {}), "no top_logprobs list"),
    "top_logprobs a string": (judged("7"), "no top_logprobs list"),
    "a log-prob of 1000": (judged([{"token": "7", "logprob": 1000.0}]), "log-prob 1000.0 of token '7' is not a finite"),
    "a NaN log-prob": (judged([{"token": "8", "logprob": -0.1}, {"token": "7", "logprob": math.nan}]), "log-prob nan"),
    "a huge log-prob": (judged([{"token": "7", "logprob": -(10 ** 400)}]), "log-prob -100000"),
    "a number as token": (judged([{"token": 7, "logprob": -0.1}]), "an entry without a string token: {'token': 7"),
    "an entry not a dict": (judged(["7"]), "an entry without a string token: '7'"),
    "refused by the client": (MalformedAnswer("chat server http://judge/v1: the answer's choices[0].logprobs.content[0]: "
                                              "log-prob 1000.0 of token '7' is not a finite number ≤ 0"), "http://judge/v1"),
}


# ---- the charter ----------------------------------------------------------------------------------------------------

def test_the_shipped_charter_has_the_reports_articles_survey_and_our_own_clauses():
    assert [a.title for a in CHARTER.articles] == TITLES and [a.number for a in CHARTER.articles] == list(range(1, 12))
    assert all(3 <= len(a.clauses) <= 9 for a in CHARTER.articles)
    s = CHARTER.survey
    assert (s.respondents, s.mean_agreement, s.lowest_agreement, s.lowest_article, s.top_ranked, s.bottom_ranked) == (
        163, 97.3, 92.6, 6, 2, 7)
    assert "own words" in CHARTER.provenance and "own words" in (data_dir() / "charter" / "PROVENANCE.md").read_text()


RAW = yaml.safe_load((data_dir() / "charter" / "charter.yaml").read_text())
BROKEN = [  # (what is done to the shipped charter, what the error must say)
    (lambda r: r["articles"].pop(4), "article 5 (Professional Competence Boundaries) is numbered 6"),
    (lambda r: r["articles"][0].update(title=""), "article 1 has no title"),
    (lambda r: r["articles"][3].update(clauses={"4.1": "a", "4.2": "b"}), "has 2 clauses; an article has 3–9"),
    (lambda r: r["articles"][3].update(clauses={f"4.{i}": "x" for i in range(1, 11)}), "has 10 clauses"),
    (lambda r: r["articles"][9]["clauses"].pop("10.2"), "clauses must be numbered 10.1, 10.2, 10.3 in order, got 10.1, 10.3, 10.4"),
    (lambda r: r["articles"][0].update(clauses={1.1: "a", 1.2: "b", 1.3: "c"}), "clause number 1.1 is not quoted"),
    (lambda r: r["articles"][2]["clauses"].update({"3.4": ""}), "clause 3.4 has no text"),
    (lambda r: r["articles"][1].update(title="Response Quality"), "'Response Quality' appears twice"),
    (lambda r: r["survey"].update(top_ranked=0), "survey.top_ranked names article 0; the charter has 11"),
    (lambda r: r["survey"].update(lowest_agreement=98.0), "lowest agreement 98.0 % is above its mean 97.3 %"),
    (lambda r: r["survey"].update(mean_agreement=120.0), "120.0 is outside [0, 100]"),
    (lambda r: r["survey"].pop("respondents"), "the survey lacks respondents"),
    (lambda r: r.update(articles=[]), "no articles"),
    (lambda r: r["articles"][0].update(clause={}), "unknown key 'clause' (did you mean 'clauses'?)"),
]


@pytest.mark.parametrize("edit,message", BROKEN, ids=[m[:30] for _, m in BROKEN])
def test_a_malformed_charter_is_a_config_error_naming_the_problem(tmp_path, edit, message):
    raw = copy.deepcopy(RAW)
    edit(raw)
    (tmp_path / "charter.yaml").write_text(yaml.safe_dump(raw, allow_unicode=True))
    with pytest.raises(ConfigError) as e:
        load_charter(tmp_path / "charter.yaml")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_judge_reads_every_clause_numbered_and_its_citations_are_read_back():
    text = charter_text(CHARTER)
    for a in CHARTER.articles:
        assert f"Article {a.number}: {a.title}" in text
        assert all(f"[{n}] {t}" in text for n, t in a.clauses.items())
    assert charter_text(CHARTER) in charter_instructions(CHARTER)
    assert cited_clauses("8 [11.1] [2.5] [11.1] [2.9] [12.1] (4.2)", CHARTER) == ("11.1", "2.5")
    assert all(t in charter_persona(CHARTER) for t in TITLES)


# ---- sensitivity --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("reply,level", [
    ('{"reasoning": "arithmetic", "classification": "0"}', 0),
    ('{"reasoning": "values", "classification": 3}', 3),
    ('Here you go:\n```json\n{"reasoning": "framing", "classification": "2"}\n```', 2),
    ('{"reasoning": "cut off, "classification": "1"', 1),
    ("2", 2),
    ("", None), ("high", None), ('{"classification": "5"}', None), ('{"classification": "1.5"}', None),
    ('{"reasoning": "no level"}', None), ("3 or maybe 0", None),
])
def test_sensitivity_parsing_never_defaults_to_zero(reply, level):
    assert parse_sensitivity(reply) == level


def test_classify_against_our_server_counts_unparsed_and_failed_prompts(client):
    prompts = [Prompt(id="a", text="What is 17 times 23?"), Prompt(id="b", text="Is it fair that inheritance is taxed?")]
    levels = classify(client, prompts, SMALL)
    assert [s.level for s in levels] == [None, None] and all(s.reply and not s.error for s in levels)  # noise: unparsed
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gone = classify(ChatClient(f"http://127.0.0.1:{port}/v1", retries=0), prompts[:1], SMALL)
    assert gone[0].level is None and "unreachable" in gone[0].error


def test_a_classifier_reply_nested_5000_deep_or_with_a_5000_digit_level_is_counted_as_unparsed():
    deep = '{"classification": ' + "[" * 5000 + "]" * 5000 + "}"
    assert parse_sensitivity(deep) is None and parse_sensitivity('{"classification": ' + "7" * 5000 + "}") is None
    assert parse_sensitivity('{"reasoning": ' + "[" * 5000 + "]" * 5000 + ', "classification": "2"}') == 2   # its fragment
    assert parse_sensitivity('{"classification": "3", "pad": "' + "x" * 2_000_000 + '"}') == 3            # past the size bound
    levels = classify(Scripted([Reply(deep, "stop", None, {}), Reply('{"classification": "1"}', "stop", None, {})]),
                      [Prompt(id="a", text="?"), Prompt(id="b", text="?")], SMALL)
    assert [(s.level, s.reply, s.error) for s in levels] == [(None, deep, ""), (1, '{"classification": "1"}', "")]


# ---- scores ---------------------------------------------------------------------------------------------------------

def test_the_judge_scale_is_1_to_9_not_the_public_scripts_1_to_8():
    assert SCALE == tuple(range(1, 10)) and "from 1 to 9" in POINTWISE
    assert weighted_score([{"token": "9", "logprob": lp(0.9)}]) == 9.0
    assert weighted_score([{"token": " 1", "logprob": lp(0.1)}, {"token": "0", "logprob": lp(0.8)}]) == 1.0
    assert weighted_score([{"token": "10", "logprob": lp(0.5)}, {"token": "0", "logprob": lp(0.5)}]) is None


def test_the_pointwise_score_is_the_probability_weighted_mean_of_the_score_tokens():
    top = [{"token": "8", "logprob": lp(0.3)}, {"token": " 8", "logprob": lp(0.1)}, {"token": "3", "logprob": lp(0.2)},
           {"token": "Score", "logprob": lp(0.25)}, {"token": "5 ", "logprob": lp(0.05)}]
    # p(8) = 0.4, p(3) = 0.2, p(5) = 0.05: (3.2 + 0.6 + 0.25) / 0.65
    assert weighted_score(top) == pytest.approx(4.05 / 0.65)
    assert weighted_score([{"token": "Score", "logprob": 0.0}]) is None and weighted_score([]) is None


def test_pairwise_averages_each_completions_log_prob_over_both_orders():
    ab = order_logprobs([{"token": "A", "logprob": lp(0.7)}, {"token": "B", "logprob": lp(0.2)}])
    ba = order_logprobs([{"token": " A", "logprob": lp(0.6)}, {"token": "B", "logprob": lp(0.3)}])
    c = both_orders(ab, ba)                    # a: 0.7 shown first, 0.3 shown second; b: 0.2 second, 0.6 first
    assert c.a == pytest.approx((lp(0.7) + lp(0.3)) / 2) and c.b == pytest.approx((lp(0.2) + lp(0.6)) / 2)
    assert (c.winner, c.consistent, c.missing) == ("a", False, False)      # geometric means 0.458 > 0.346
    agree = both_orders((lp(0.9), lp(0.1)), (lp(0.2), lp(0.8)))           # both orders prefer a
    assert (agree.winner, agree.consistent) == ("a", True)
    assert both_orders((0.0, -math.inf), (0.0, -math.inf)).winner is None  # pure position bias: a tie of −∞
    assert order_logprobs([{"token": "C", "logprob": 0.0}]) is None
    assert both_orders(None, ba) == Comparison(-math.inf, -math.inf, False, True)


def test_the_judge_against_our_server_reads_the_first_tokens_top_20_at_temperature_0(client):
    judge = Judge(client, charter_instructions(CHARTER), charter=CHARTER)
    prompt, answers = "Should voting be compulsory?", ["Yes.", "No, it should not.", ""]
    scores = judge.scores(prompt, answers)
    assert len(scores) == 3 and judge(prompt, answers) == [s.value for s in scores]
    for s, y in zip(scores, answers):
        direct = client.chat([{"role": "user", "content": POINTWISE.format(instructions=judge.instructions, prompt=prompt,
                                                                           completion=y)}],
                             temperature=0.0, max_tokens=32, logprobs=True, top_logprobs=20)
        assert len(direct.logprobs[0]["top_logprobs"]) == 20 and s.reply == direct.text
        assert s.value == weighted_score(direct.logprobs[0]["top_logprobs"])
        assert s.value is None or 1 <= s.value <= 9
        assert set(s.cited) <= {n for a in CHARTER.articles for n in a.clauses}
    sent = client.requests
    c = judge.compare(prompt, answers[0], answers[1])
    assert client.requests - sent == 2 and isinstance(c, Comparison) and c.winner in ("a", "b", None)


def test_a_malformed_judge_reply_is_unscored_with_its_reason():
    good = judged([{"token": "8", "logprob": lp(0.5)}, {"token": " 6", "logprob": lp(0.5)}])
    scores = Judge(Scripted([good, *(r for r, _ in BAD.values()), good]), QUALITY).scores("q", ["y"] * (len(BAD) + 2))
    assert [s.value for s in scores] == [7.0] + [None] * len(BAD) + [7.0] and scores[0].error == scores[-1].error == ""
    for s, (_, why) in zip(scores[1:-1], BAD.values()):
        assert s.error.startswith("malformed reply: ") and why in s.error and "\n" not in s.error
    ok, bad = judged([{"token": "A", "logprob": lp(0.9)}]), BAD["a log-prob of 1000"][0]
    c = Judge(Scripted([ok, bad]), QUALITY).compare("q", "a", "b")
    assert (c.missing, c.winner) == (True, None) and "log-prob 1000.0" in c.error
    assert Judge(Scripted([ok, ok]), QUALITY).compare("q", "a", "b").error == ""


def test_a_score_token_at_probability_zero_counts_for_nothing():
    assert weighted_score([{"token": "7", "logprob": -9999.0}]) is None          # vLLM's stand-in for −inf
    assert weighted_score([{"token": "7", "logprob": -9999.0}, {"token": "3", "logprob": -1.0}]) == 3.0
    assert order_logprobs([{"token": "A", "logprob": -9999.0}, {"token": "B", "logprob": lp(0.5)}]) == (-math.inf, lp(0.5))
    assert order_logprobs([{"token": "A", "logprob": -9999.0}]) is None


# ---- the two tracks -------------------------------------------------------------------------------------------------

def test_two_track_against_our_server_runs_every_stage(client):
    prompts = [Prompt(id=f"p{i}", text=t) for i, t in enumerate(
        ["What is 17 times 23?", "Should the state read private messages?", "Which river flows through Basel?", "Why?"])]
    levels = [Sensitivity(0, "hand"), Sensitivity(3, "hand"), Sensitivity(2, "hand"), Sensitivity(None, "noise")]
    tracks = Tracks((Policy("sft", client, on_policy=True), Policy("other", client)), reward=Judge(client, QUALITY),
                    judge=Judge(client, charter_instructions(CHARTER), charter=CHARTER),
                    personas=("A nurse in Lausanne.", charter_persona(CHARTER)))
    outcomes = two_track(prompts, levels, tracks, SMALL)
    assert [o.prompt for o in outcomes] == ["p0", "p1", "p2", "p3"]
    assert [o.track for o in outcomes] == ["standard", "charter", "charter", None]
    assert outcomes[3].status == "skipped" and outcomes[3].reason == "the classifier's reply holds no level 0–3"
    for o in outcomes:
        assert o.status in ("paired", "skipped", "failed") and (o.status == "paired") == (not o.reason)
        assert 0 <= o.unscored <= 4
    assert accounting(outcomes)["prompts"].sum() == 4


def test_the_standard_and_charter_tracks_draw_their_system_prompts(client):
    tracks = Tracks((Policy("sft", client, on_policy=True),), reward=None, judge=None, personas=("P-one.", "P-two."))
    prompt = Prompt(id="x", text="Hello?")
    standard = completions(tracks, prompt, "standard", SMALL)
    charter = completions(tracks, prompt, "charter", SMALL)
    assert len(standard) == 3 and all(x.system in STYLES.values() and x.on_policy for x in standard)
    assert all(("P-one." in x.system) != ("P-two." in x.system) for x in charter)
    assert completions(tracks, prompt, "charter", SMALL) == charter     # seeded draws: the same requests


class Canned(ChatClient):
    "A policy server that needs no network (the URL is never contacted): each reply is its request's sampler seed."
    def __init__(self):
        super().__init__("http://127.0.0.1:9/v1", max_concurrency=2)

    def chat(self, messages, **sampling) -> Reply:
        return Reply(str(sampling["seed"]), "stop", None, {})


CANNED = (Policy("sft", Canned(), on_policy=True), Policy("other", Canned()))
SEVERAL = st.one_of(st.none(), st.integers(1, 5).map(float), st.sampled_from([math.nan, math.inf, -math.inf]),
                    st.sampled_from(sorted(BAD)))   # a reward, unscored, not finite, or a malformed judge reply
LEVEL = st.sampled_from([None, "error", 0, 1, 2, 3])
REWARDS = st.one_of(st.just("fail"), st.lists(SEVERAL, min_size=5, max_size=5))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(LEVEL, REWARDS), max_size=12))
@example([(0, [2.0, 3.0, 4.0, 5.0, 1.0]), (3, [2.0, 2.0, 2.0, 2.0, 2.0]), (1, [None, 3.0, None, 5.0, 1.0])])  # paired, two skips
@example([(3, [2.0, "a log-prob of 1000", 4.0, 5.0, 1.0]), (2, [math.nan, "no top_logprobs", 3.0, 5.0, 1.0]),
          (0, ["a number as token", "a NaN log-prob", "an entry not a dict", math.inf, 1.0]), (1, [1.0, 2.0, 3.0, 4.0, 5.0])])
def test_every_prompt_leaves_the_pipeline_exactly_once_with_its_reason(cases):
    prompts = [Prompt(id=f"p{i}", text=f"prompt {i}") for i in range(len(cases))]
    levels = [Sensitivity(None, "", "the classifier: HTTP 500") if lv == "error" else Sensitivity(lv, "x") for lv, _ in cases]
    given_rewards = {p.text: r for p, (_, r) in zip(prompts, cases)}

    def reply(r) -> Reply:
        "A judge reply that scores r, scores nothing (None), or is malformed (a name in BAD)."
        return BAD[r][0] if isinstance(r, str) else judged([{"token": "Score" if r is None else str(int(r)), "logprob": 0.0}])

    def scorer(prompt, texts):
        "Our judge over the case's replies, with a non-finite reward in place of its score where the case has one."
        if given_rewards[prompt] == "fail":
            raise ChatError("chat server http://judge/v1: HTTP 503: busy (after 4 attempts)")
        assert len(texts) == 5                        # 3 references and 2 others (samples=2)
        odd = [isinstance(r, float) and not math.isfinite(r) for r in given_rewards[prompt]]
        scores = Judge(Scripted(reply(None if o else r) for r, o in zip(given_rewards[prompt], odd)), QUALITY)(prompt, texts)
        return [r if o else s for r, o, s in zip(given_rewards[prompt], odd, scores)]

    c = ConstitutionConfig(pairs=PairConfig(n_refs=3), samples=2)
    outcomes = two_track(prompts, levels, Tracks(CANNED, scorer, scorer, ("persona",)), c)
    assert [o.prompt for o in outcomes] == [p.id for p in prompts]
    assert accounting(outcomes)["prompts"].sum() == len(prompts)
    for o, (lv, rewards) in zip(outcomes, cases):
        assert o.status in ("paired", "skipped", "failed") and (o.status == "paired") == (not o.reason)
        if lv == "error" or (rewards == "fail" and lv is not None):
            assert o.status == "failed"
        elif lv is None:
            assert (o.status, o.track) == ("skipped", None)
        else:
            usable = [isinstance(r, float) and math.isfinite(r) for r in rewards]
            assert o.track == ("charter" if lv >= 2 else "standard") and o.unscored == usable.count(False)
            refs = [r for r, u in zip(rewards[:3], usable) if u]
            if o.status == "paired":
                assert o.q[0] == 1.0 and o.rewards[0] >= max(refs) and o.q[1] <= max(0.2, 1 / len(refs)) + 1e-6
                assert sorted(o.ref_rewards) == sorted(refs) and o.chosen != o.rejected
                assert all(math.isfinite(r) for r in (*o.rewards, *o.q, *o.ref_rewards))
            elif len(refs) < 2:
                assert o.reason == "fewer than 2 reference completions scored"
            else:
                assert o.reason == "no completion in the rejected tier"


def test_non_finite_rewards_are_unscored_and_a_prompt_without_two_is_skipped_for_that_reason():
    xs = [Completion(n, "", n, n.startswith("r")) for n in ("r1", "r2", "r3", "o1", "o2")]
    o = pair("p", "standard", xs, [math.nan, math.nan, 3.0, 6.0, 1.0], PairConfig(), random.Random(0))
    assert (o.status, o.reason, o.unscored) == ("skipped", "fewer than 2 reference completions scored", 2)
    o = pair("p", "standard", xs, [math.nan, 5.0, 3.0, math.inf, 1.0], PairConfig(), random.Random(0))
    assert (o.status, o.ref_rewards, o.unscored, o.rejected.policy) == ("paired", (5.0, 3.0), 2, "r3")   # q ≤ 1/2: r3 (q = 1/2) above o2 (0)


def test_one_malformed_judge_reply_loses_its_item_not_the_run():
    prompts = [Prompt(id=f"p{i}", text=f"prompt {i}") for i in range(4)]
    good = [judged([{"token": t, "logprob": 0.0}]) for t in "95182"]
    judge = Judge(Scripted(good * 2 + [r for r, _ in BAD.values()][:5] + good), QUALITY)   # prompt 3's five replies are bad
    outcomes = two_track(prompts, [Sensitivity(3, "hand")] * 4, Tracks(CANNED, judge, judge, ("persona",)),
                         ConstitutionConfig(pairs=PairConfig(n_refs=3), samples=2))
    assert [(o.prompt, o.status, o.unscored) for o in outcomes] == [
        ("p0", "paired", 0), ("p1", "paired", 0), ("p2", "skipped", 5), ("p3", "paired", 0)]
    assert outcomes[2].reason == "fewer than 2 reference completions scored"
    gone = ChatError("chat server http://judge/v1: unreachable (ConnectError: refused) (after 4 attempts)")
    down = two_track(prompts[:1], [Sensitivity(3, "hand")], Tracks(CANNED, None, Judge(Scripted([gone] * 5), QUALITY), ("p",)),
                     ConstitutionConfig(pairs=PairConfig(n_refs=3), samples=2))
    assert (down[0].status, down[0].reason) == ("failed", str(gone))          # not malformed: the request failed


def test_two_track_refuses_repeated_ids_and_policies_without_one_reference():
    with pytest.raises(ValueError, match="unique prompt ids"):
        two_track([Prompt(id="a"), Prompt(id="a")], [Sensitivity(0, "")] * 2, Tracks(CANNED, None, None, ("p",)), SMALL)
    with pytest.raises(ConfigError, match="exactly one on-policy"):
        Tracks((Policy("a", Canned()), Policy("b", Canned())), None, None, ("p",))
    with pytest.raises(ConfigError, match="controversial"):
        from_dict(ConstitutionConfig, {"controversial": 4})
    with pytest.raises(ConfigError, match="top_logprobs"):
        from_dict(JudgeConfig, {"top_logprobs": 21})


# ---- calibration ----------------------------------------------------------------------------------------------------

def bigrams(text: str) -> set[tuple[str, str]]:
    words = text.split()
    return set(zip(words, words[1:]))


def test_each_degradation_adds_a_defect_and_keeps_the_earlier_ones():
    for item in load_examples().calibration:
        versions = degrade(item.answer, len(DEFECTS) + 1, f"0:{item.id}")
        assert len(versions) == 9 and all(a != b for a, b in zip(versions, versions[1:]))
        kept = [len(bigrams(item.answer) & bigrams(v)) for v in versions]      # the original's word pairs still there
        assert all(a >= b for a, b in zip(kept, kept[1:])) and kept[-1] < kept[0] / 2
        assert versions == degrade(item.answer, 9, f"0:{item.id}") != degrade(item.answer, 9, f"1:{item.id}")
    with pytest.raises(ValueError, match="levels"):
        degrade("x", 10, "s")
    state = random.getstate()
    degrade(item.answer, 9, "x")
    assert random.getstate() == state                                 # its own generator: the global one is untouched


def test_spearman_and_kendall_equal_hand_worked_ranks():
    truth = [9, 8, 7, 6]
    assert rank_agreement(truth, [4.0, 3.0, 2.0, 1.0]) == pytest.approx((1.0, 1.0))
    rho, tau = rank_agreement(truth, [3.0, 4.0, 2.0, 1.0])           # one adjacent swap: Σd² = 2, 5 concordant of 6
    assert rho == pytest.approx(1 - 6 * 2 / (4 * 15)) and tau == pytest.approx(4 / 6)
    rho, tau = rank_agreement(truth, [2.0, 2.0, 1.0, 0.0])           # a tie: mid-ranks, τ-b
    assert rho == pytest.approx(4.5 / math.sqrt(5 * 4.5)) and tau == pytest.approx(5 / math.sqrt(6 * 5))
    assert rank_agreement(truth, [1.0, None, 2.0, None]) == pytest.approx((-1.0, -1.0))   # the unscored are left out
    assert rank_agreement(truth, [3.0, 3.0, None, None]) == (None, None)


def test_pairwise_agreement_counts_decided_pairs_against_the_truth():
    good, wrong, missing = Comparison(-0.1, -3.0, True, False), Comparison(-2.0, -0.5, True, False), both_orders(None, None)
    assert pairwise_agreement({(0, 1): good, (0, 2): good, (1, 2): wrong, (0, 3): missing}) == {
        "pairs": 4, "decided": 3, "agreement": 2 / 3, "consistent": 3 / 4}


def test_calibrate_against_our_server_gives_its_table(client):
    item = CalibrationItem(id="c", prompt="Is it fair that inheritance is taxed?", answer=load_examples().calibration[1].answer)
    judge = Judge(client, charter_instructions(CHARTER), charter=CHARTER)
    table = calibrate(judge, [item], CalibrationConfig(levels=4))
    row = table.iloc[0]
    assert list(table.columns) == ["item", "levels", "scored", "spearman", "kendall", "pairs", "decided", "agreement", "consistent"]
    assert (row["item"], row["levels"], row["pairs"]) == ("c", 4, 6) and 0 <= row["scored"] <= 4 and row["decided"] <= 6
    assert row["spearman"] is None or -1 <= row["spearman"] <= 1
