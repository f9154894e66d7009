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
    DEFECTS, POINTWISE, QUALITY, SCALE, STYLES, CalibrationConfig, CalibrationItem, Comparison, ConstitutionConfig, Judge,
    JudgeConfig, Policy, Prompt, Sensitivity, Tracks, accounting, both_orders, calibrate, charter_instructions,
    charter_persona, charter_text, cited_clauses, classify, completions, degrade, load_charter, load_examples, order_logprobs,
    pairwise_agreement, parse_sensitivity, rank_agreement, two_track, weighted_score)
from openpretrain.posttrain.preference import PairConfig
from openpretrain.engine import ChatModel
from openpretrain.posttrain.client import ChatClient, ChatError, Reply
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
LEVEL = st.sampled_from([None, "error", 0, 1, 2, 3])
REWARDS = st.one_of(st.just("fail"), st.lists(st.one_of(st.none(), st.integers(0, 4).map(float)), min_size=5, max_size=5))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(LEVEL, REWARDS), max_size=12))
@example([(0, [1.0, 2.0, 3.0, 4.0, 0.0]), (3, [1.0, 1.0, 1.0, 1.0, 1.0]), (1, [None, 2.0, None, 4.0, 0.0])])  # paired, two skips
def test_every_prompt_leaves_the_pipeline_exactly_once_with_its_reason(cases):
    prompts = [Prompt(id=f"p{i}", text=f"prompt {i}") for i in range(len(cases))]
    levels = [Sensitivity(None, "", "the classifier: HTTP 500") if lv == "error" else Sensitivity(lv, "x") for lv, _ in cases]
    given_rewards = {p.text: r for p, (_, r) in zip(prompts, cases)}

    def scorer(prompt, texts):
        if given_rewards[prompt] == "fail":
            raise ChatError("chat server http://judge/v1: HTTP 503: busy (after 4 attempts)")
        assert len(texts) == 5                        # 3 references and 2 others (samples=2)
        return given_rewards[prompt]

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
            assert o.track == ("charter" if lv >= 2 else "standard") and o.unscored == rewards.count(None)
            refs = [r for r in rewards[:3] if r is not None]
            if o.status == "paired":
                assert o.q[0] == 1.0 and o.rewards[0] >= max(refs) and o.q[1] <= max(0.2, 1 / len(refs)) + 1e-6
                assert sorted(o.ref_rewards) == sorted(refs) and o.chosen != o.rejected
            elif len(refs) < 2:
                assert o.reason == "fewer than 2 reference completions scored"


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
