"""Decontamination: our rule against a literal transcription of the public script (with and without its
off-by-one), difflib's matching blocks found from shared n-grams, the exact pruning bound and hash prefilter, the turns a conversation is checked by, and the datatrove filter."""
import difflib
import gzip
import json
import random

import pytest
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter

import decontam_reference as ref
from openpretrain.compliance.pipeline import FailClosed
from openpretrain.core import ConfigError
from openpretrain.corpus import load_embedded
from openpretrain.posttrain.decontam import (BenchmarkIndex, DecontaminationConfig, DecontaminationFilter,
                                             benchmark_index, conversation_match, encode, match, matched_tokens, matches,
                                             ngrams, positions)
from openpretrain.tokenization import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("bpe-bal-8k")


@pytest.fixture(scope="module")
def real_case(tok):
    "Benchmark prompts (held-out sentences) and training texts: copies, partial copies, edited copies, unrelated."
    rng = random.Random(0)
    texts = sorted(t for t in load_embedded("train").filter(lambda r: r["source"] == "fortunes")["text"] if 80 < len(t) < 600)
    bench, other = texts[:60], texts[60:260]
    train = []
    for b in bench:
        words = b.split()
        train += [b, " ".join(words[: len(words) // 2]), rng.choice(other) + " " + b,
                  " ".join(w if rng.random() > 0.15 else "xyzzy" for w in words)]
    train += other
    return bench, train


def test_the_references_ngrams_drop_the_last_one_and_ours_keep_it():
    nine, eight = list(range(9)), list(range(8))
    assert len(ref.get_ngrams(nine, 8)) == 1 and len(ngrams(nine, 8)) == 2
    assert len(ref.get_ngrams(eight, 8)) == 0 and len(ngrams(eight, 8)) == 1      # a short prompt can never match there


def decisions(bench, train, tok):
    "Ours on texts: the matched benchmark index per training text, the index, and the training tokens."
    config = DecontaminationConfig(turns="first-user")
    index = benchmark_index(dict(enumerate(bench)), tok, config)
    tokens = [encode(tok, t, config) for t in train]
    return [m.benchmark if (m := match(index, t)) else None for t in tokens], index, tokens


def test_decisions_equal_the_transcription_with_the_off_by_one_fixed(real_case, tok, monkeypatch):
    bench, train = real_case
    ours, index, tokens = decisions(bench, train, tok)
    monkeypatch.setattr(ref, "get_ngrams", lambda tokens, n: set(zip(*[tokens[i:] for i in range(n)])))   # cosmopedia's
    theirs = ref.decontaminate(tokens, index.tokens)
    assert [o is not None for o in ours] == [t is not None for t in theirs]
    assert sum(o is not None for o in ours) > len(bench)                         # copies are found, not all texts


def test_decisions_equal_the_transcription_except_where_the_last_ngram_decides(real_case, tok):
    bench, train = real_case
    ours, index, tokens = decisions(bench, train, tok)
    theirs = ref.decontaminate(tokens, index.tokens)
    assert [o is not None for o in ours] == [t is not None for t in theirs]     # real prompts are longer than 8 tokens
    short = index.tokens[0][:8]                                                  # a benchmark prompt of exactly 8 tokens
    copy = short + tokens[-1][1:20]                                              # … copied at the start of a sample
    assert match(BenchmarkIndex({"short": short}), copy) is not None
    assert ref.decontaminate([copy], [short]) == [None]                          # the script finds no n-gram in it


def difflib_tokens(train, bench, n):
    "The definition: difflib's own matching blocks of ≥ n tokens, summed."
    blocks = difflib.SequenceMatcher(None, train, bench, autojunk=False).get_matching_blocks()
    return sum(b.size for b in blocks if b.size >= n)


def test_matched_tokens_equal_difflibs_blocks_on_real_and_random_text(real_case, tok):
    bench, train = real_case
    for b, t in zip(bench * 5, train):                                      # copies, halves, edits, unrelated
        assert matched_tokens(tok.encode(t), tok.encode(b), 5) == difflib_tokens(tok.encode(t), tok.encode(b), 5)
    rng = random.Random(2)
    for _ in range(3000):                                                   # two or three symbols: ties everywhere
        k = rng.randrange(2, 4)
        a, b = [rng.randrange(k) for _ in range(rng.randrange(80))], [rng.randrange(k) for _ in range(rng.randrange(50))]
        if b and rng.random() < 0.5:
            a = a[:10] + b[rng.randrange(len(b)):] + a[10:]
        for n in (1, 2, 3, 5):
            assert matched_tokens(a, b, n) == difflib_tokens(a, b, n), (a, b, n)


def test_the_bound_and_the_hash_prefilter_never_change_a_decision():
    rng = random.Random(1)
    texts = []
    for _ in range(300):
        bench = [[rng.randrange(20) for _ in range(rng.randrange(6, 40))] for _ in range(5)]
        train = [x if rng.random() > 0.3 else rng.randrange(20) for x in (rng.choice(bench) if rng.random() < 0.5 else [])]
        train += [rng.randrange(20) for _ in range(rng.randrange(0, 30))]
        index = BenchmarkIndex(dict(enumerate(bench)), DecontaminationConfig(ngram=3))
        candidates = sorted({i for g in ngrams(train, 3) for i in index.index.get(g, ())})
        brute = {i: difflib_tokens(train, bench[i], 5) / len(bench[i]) for i in candidates}   # difflib on every candidate
        found = match(index, train)
        reached = {i: r for i, r in brute.items() if r >= 0.5}
        assert (found is None) == (not reached) and (found is None or found.ratio == max(reached.values()))
        assert index.shared([train]) == [ngrams(train, 3) & index.index.keys()]
        assert index.block_positions(train) == positions(train, 5, index.block_set)
        texts.append(train)
    assert matches(index, texts) == [match(index, t) for t in texts]     # one batch: the same as text by text


def test_the_first_user_message_hides_copies_that_every_user_and_system_turn_shows(tok):
    bench = {"b": "All human beings are born free and equal in dignity and rights, endowed with reason and conscience."}
    later = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Hi."},
             {"role": "user", "content": bench["b"]}]
    assert conversation_match(benchmark_index(bench, tok), tok, later).turn == 1           # the second checked turn
    assert conversation_match(benchmark_index(bench, tok, DecontaminationConfig(turns="first-user")), tok, later) is None
    with pytest.raises(ConfigError, match="first-user"):
        DecontaminationConfig(turns="assistant")


def test_the_filter_removes_records_and_fails_closed_on_a_document_without_turns(tmp_path, tok):
    bench = {"b": "All human beings are born free and equal in dignity and rights, endowed with reason and conscience."}
    docs = [{"id": "copy", "text": "a copy", "metadata": {"messages": [{"role": "user", "content": "Translate: " + bench["b"]}]}},
            {"id": "clean", "text": "a clean one", "metadata": {"messages": [{"role": "user", "content": "What is a fortune cookie?"}]}},
            {"id": "broken", "text": "no turns", "metadata": {"messages": "not a list"}}]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    step = DecontaminationFilter(benchmark_index(bench, tok), tok, exclusion_writer=JsonlWriter(str(tmp_path / "removed")))
    LocalPipelineExecutor([JsonlReader(str(tmp_path / "in")), FailClosed(step, JsonlWriter(str(tmp_path / "errors"))),
                           JsonlWriter(str(tmp_path / "kept"))], tasks=2, workers=2, logging_dir=str(tmp_path / "logs")).run()
    read = lambda d: {r["id"]: r["metadata"] for p in (tmp_path / d).glob("*.jsonl.gz") for r in map(json.loads, gzip.open(p, "rt"))}
    kept, removed, errors = read("kept"), read("removed"), read("errors")
    assert set(kept) == {"clean"} and set(removed) == {"copy"} and set(errors) == {"broken"}
    assert removed["copy"]["decontamination_benchmark"] == "b" and removed["copy"]["decontamination_ratio"] > 0.9
    assert kept["clean"]["decontamination_decision"] == "kept"


BENCH = {"b": "All human beings are born free and equal in dignity and rights, endowed with reason and conscience."}


@pytest.mark.parametrize("prompts", [{}, [], None])
def test_an_empty_benchmark_is_refused_not_an_index_that_flags_nothing(tok, prompts):
    with pytest.raises(ValueError, match="empty benchmark flags nothing"):
        benchmark_index(prompts, tok)
    with pytest.raises(ValueError, match="empty index flags nothing"):
        BenchmarkIndex({})


@pytest.mark.parametrize("prompt, why", [(None, "'q': expected text, got NoneType"), (42, "'q': expected text, got int"),
                                         ("a\ud800b", "'q': not valid text"), ("  \n", "'q' is empty")])
def test_a_benchmark_prompt_that_is_not_text_is_a_value_error_naming_it(tok, prompt, why):
    with pytest.raises(ValueError, match=why):
        benchmark_index({**BENCH, "q": prompt}, tok)


@pytest.mark.parametrize("messages, why", [
    ([{"role": "user", "content": 42}], "turn 0 content: expected text, got int"),
    ([{"role": "user", "content": "ok"}, {"role": "assistant", "content": None}], "turn 1 content: expected text"),
    ([{"role": "user", "content": "x\udc80"}], "turn 0 content: not valid text"),
    ([{"role": None, "content": "x"}], "turn 0 role: expected text"),
    ([{"content": "x"}], r"turn 0: expected a \{role, content\} mapping"),
    ("not a list", "expected a list of")])
def test_a_turn_that_is_not_text_is_a_value_error_naming_the_turn(tok, messages, why):
    index = benchmark_index(BENCH, tok)
    with pytest.raises(ValueError, match=why):
        conversation_match(index, tok, messages)


def test_the_filter_names_the_document_whose_turn_is_not_text(tok):
    from datatrove.data import Document
    step = DecontaminationFilter(benchmark_index(BENCH, tok), tok)
    doc = Document(text="x", id="doc-7", metadata={"messages": [{"role": "user", "content": 42}]})
    with pytest.raises(ValueError, match="document doc-7: .*turn 0 content: expected text, got int"):
        step.filter(doc)


def test_a_benchmark_prompt_shorter_than_the_ngram_copied_verbatim_is_flagged(tok):
    index = benchmark_index({**BENCH, "sum": "2+2=?"}, tok)
    assert len(index.tokens[index.ids.index("sum")]) < index.config.ngram               # 6 ids with its BoS: no 8-gram
    for copy in ("2+2=?", "  2+2=?\n"):                                                 # verbatim, re-spaced
        m = conversation_match(index, tok, [{"role": "user", "content": "Hello."}, {"role": "user", "content": copy}])
        assert (m.benchmark, m.ratio, m.turn) == ("sum", 1.0, 1)
    assert conversation_match(index, tok, [{"role": "user", "content": "What is 2+3?"}]) is None
    with pytest.raises(ValueError, match="'sum': 6 tokens, fewer than the 8-gram"):
        BenchmarkIndex({k: encode(tok, t, DecontaminationConfig()) for k, t in {**BENCH, "sum": "2+2=?"}.items()})


def test_repeated_ngrams_bound_the_anchor_pairs_per_turn_and_still_remove_the_copy(tok, monkeypatch):
    import openpretrain.posttrain.decontam as dc
    paired = []
    def anchors(at, bench_grams):                      # count before pairing: the unbounded pairing never runs here
        paired.append(n := sum(len(at.get(g, ())) for g in bench_grams))
        assert n <= 50_000, f"{n:,} anchor pairs for one (turn, prompt) pair"
        return original(at, bench_grams)
    original = dc.anchors
    monkeypatch.setattr(dc, "anchors", anchors)
    table = "| --- " * 300 + "|"
    index = benchmark_index({"table": table, **BENCH}, tok)
    turn = "| --- " * 35_000 + "|"                                                   # 210 KB of the same separator
    m = conversation_match(index, tok, [{"role": "user", "content": turn}])
    assert m.benchmark == "table" and m.bound and m.ratio >= 0.5                     # removed: more removal, never a leak
    short = conversation_match(index, tok, [{"role": "user", "content": "| --- " * 40 + "|"}])
    assert short is None                                                              # a turn too short to hold half of it
    prose = conversation_match(index, tok, [{"role": "user", "content": "Please: " + BENCH["b"]}])
    assert prose.benchmark == "b" and not prose.bound                                 # real text: paired as before
