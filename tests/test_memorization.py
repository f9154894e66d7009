"""Memorisation probes: the scores against rouge-score and difflib, and exact probe-injection bookkeeping."""
import copy
import difflib

import numpy as np
import pandas as pd
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from rouge_score import rouge_scorer

from openpretrain.core import ConfigError, load_preset
from openpretrain.corpus import load_probes
from openpretrain.evaluation.memorization import (MemorizationConfig, assign_repetitions, exact_match, lccs,
                                                  lcs_length, lcs_length_dp, probe_curriculum, probe_loader,
                                                  probe_prompts, probe_row, probe_sightings, rouge_l, ttr,
                                                  write_probe_pool)
from openpretrain.tokenization import load_tokenizer
from openpretrain.training.curriculum import load_curriculum
from openpretrain.training.data import pack_rows
from openpretrain.training.plan import plan

tokens = st.lists(st.integers(0, 5), max_size=40)  # a small alphabet: many ties and repeats


class Whitespace:
    "rouge-score tokenizer that keeps our token ids as they are (its default lower-cases and drops punctuation)."
    def tokenize(self, text):
        return text.split()


SCORER = rouge_scorer.RougeScorer(["rougeL"], tokenizer=Whitespace())
TOKENIZER = load_tokenizer("bpe-bal-8k")   # the tiny preset's


def reference_rouge_l(generated, reference) -> float:
    return SCORER.score(" ".join(map(str, reference)), " ".join(map(str, generated)))["rougeL"].fmeasure


@settings(max_examples=300, deadline=None)
@given(tokens, tokens)
def test_rouge_l_equals_rouge_score_on_token_sequences(generated, reference):
    assert rouge_l(generated, reference) == pytest.approx(reference_rouge_l(generated, reference), abs=1e-12)


def test_rouge_l_equals_rouge_score_on_a_real_passage_and_a_corrupted_copy():
    tok = load_tokenizer("bpe-bal-8k")
    ref = tok.encode(load_probes().text[0])
    rng = np.random.default_rng(0)
    gen = [t if rng.random() > 0.3 else int(rng.integers(0, 8192)) for t in ref]
    assert 0.5 < rouge_l(gen, ref) < 1
    assert rouge_l(gen, ref) == pytest.approx(reference_rouge_l(gen, ref), abs=1e-12)


@settings(max_examples=300, deadline=None)
@given(tokens, tokens)
def test_bit_parallel_lcs_equals_the_dynamic_programme(a, b):
    assert lcs_length(a, b) == lcs_length_dp(a, b)


@settings(max_examples=300, deadline=None)
@given(tokens, st.lists(st.integers(0, 5), min_size=1, max_size=40))
def test_lccs_equals_difflibs_longest_match(generated, reference):
    longest = difflib.SequenceMatcher(None, generated, reference, autojunk=False).find_longest_match(
        0, len(generated), 0, len(reference)).size
    assert lccs(generated, reference) == longest / len(reference)


def test_exact_match_counts_tokens_before_the_first_error():
    assert exact_match([5, 6, 7, 8], [5, 6, 9, 8]) == 2
    assert exact_match([1, 2], [1, 2, 3]) == 2
    assert exact_match([4], [3]) == 0


def test_ttr_is_distinct_over_total():
    assert ttr([1, 1, 2, 3]) == 0.75
    assert ttr([7] * 10) == 0.1


def test_assignment_injects_per_count_probes_and_keeps_the_rest_unseen():
    ids = [f"p{i:02d}" for i in range(20)]
    a = assign_repetitions(ids, [1, 4, 16], per_count=2, seed=3)
    assert sorted(a.probe_id) == ids
    assert a.repetitions.value_counts().to_dict() == {0: 14, 1: 2, 4: 2, 16: 2}
    assert a.equals(assign_repetitions(ids, [1, 4, 16], per_count=2, seed=3))
    with pytest.raises(ConfigError, match="baseline"):
        assign_repetitions(ids[:6], [1, 4, 16], per_count=2, seed=0)


def test_a_probe_row_scores_exactly_its_passage_tokens():
    bod, eod, L = 1, 2, 16
    passage = [100 + i for i in range(9)]
    row = probe_row(passage, bod, eod, L)
    batch = pack_rows(np.concatenate([row, [bod]])[None], bod, eod)          # the next copy's BoD is the last label
    scored = batch.labels[0][batch.loss_mask[0]].tolist()
    assert scored == [*passage, eod]                                          # the passage and its end; padding never
    long = probe_row(list(range(100, 140)), bod, eod, L)
    assert long.tolist() == [bod, *range(100, 114), eod]                      # cut to fit one row


def test_prompts_start_with_bod_only_at_offset_zero():
    passages = [list(range(10, 30)), list(range(50, 70))]
    p0, s0 = probe_prompts(passages, 0, 4, 3, bod=1)
    p5, s5 = probe_prompts(passages, 5, 4, 3, bod=1)
    assert p0.tolist() == [[1, 10, 11, 12, 13], [1, 50, 51, 52, 53]] and s0 == [[14, 15, 16], [54, 55, 56]]
    assert p5.tolist() == [[15, 16, 17, 18], [55, 56, 57, 58]] and s5 == [[19, 20, 21], [59, 60, 61]]


def test_config_rejects_impossible_settings():
    with pytest.raises(ConfigError):
        MemorizationConfig(repetitions=[0, 2])
    with pytest.raises(ConfigError):
        MemorizationConfig(top_p=0.0)
    with pytest.raises(ConfigError):
        MemorizationConfig(prefix_lengths=[0])


def test_tiny_probes_fit_a_training_row():
    p = load_preset("tiny")
    cfg = p.section("memorization", MemorizationConfig)
    assert cfg.probe_tokens <= p.raw["data"]["seq_len"] - 2


def probe_setup(tmp_path, copies_per_probe: dict[int, int], rows: int, extra_probe_rows: int = 0):
    "Copies of a few real probes as a pool, a curriculum reading them, and a preset training on it."
    tok = load_tokenizer("bpe-bal-8k")
    L = 64
    probes = load_probes()
    copies = [probe_row(tok.encode(probes.text[i]), tok.bos_id, tok.eos_id, L)
              for i, n in copies_per_probe.items() for _ in range(n)]
    write_probe_pool(tmp_path, copies, tok)
    stage = load_curriculum("tiny").stages[0]
    cur = probe_curriculum(stage, len(copies) + extra_probe_rows, rows, L, "probe-test")
    (tmp_path / "cur.yaml").write_text(yaml.safe_dump(cur))
    raw = copy.deepcopy(load_preset("tiny").raw)
    raw["data"].update(curriculum=str(tmp_path / "cur.yaml"), seq_len=L)
    raw["model"].update(max_seq_len=L)
    raw["optim"].update(batch_size=8, batch_increase_at=[], batch_increase_to=[])
    raw["optim"]["schedule"] = dict(kind="wsd", unit="steps", warmup=1, total=rows // 8, decay=1)
    raw["train"].update(micro_batch=4)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
    keys = {probe_row(tok.encode(probes.text[i]), tok.bos_id, tok.eos_id, L).tobytes(): f"p{i}"
            for i in copies_per_probe}
    return plan(str(tmp_path / "p.yaml"), world_size=2), keys


def test_every_copy_is_served_exactly_as_often_as_injected_across_ranks(tmp_path):
    want = {0: 1, 3: 4, 7: 9}
    pl, keys = probe_setup(tmp_path, want, rows=96)
    seen = pd.concat([probe_sightings(probe_loader(pl, TOKENIZER, r, 2, None, probe_dir=tmp_path), keys) for r in range(2)])
    assert seen.name.value_counts().to_dict() == {f"p{i}": n for i, n in want.items()}


def test_a_curriculum_reading_the_copies_not_exactly_once_is_refused(tmp_path):
    pl, _ = probe_setup(tmp_path, {0: 2, 1: 3}, rows=64, extra_probe_rows=1)
    with pytest.raises(ConfigError, match="exactly once"):
        probe_loader(pl, TOKENIZER, 0, 1, None, probe_dir=tmp_path)


@pytest.mark.parametrize("key", ["prefix_lengths", "offsets", "repetitions"])
def test_config_names_the_key_of_an_empty_list(key):
    with pytest.raises(ConfigError, match=f"memorization.{key}"):
        MemorizationConfig(**{key: []})


def test_prompts_longer_than_a_passage_are_refused_naming_the_keys():
    passages = [list(range(10, 30)), list(range(50, 60))]           # 20 and 10 tokens
    with pytest.raises(ConfigError, match="passage 1 has 10 tokens.*offset 5 .* prefix 4 .* suffix_length 3 .* 12"):
        probe_prompts(passages, 5, 4, 3, bod=1)


@pytest.mark.parametrize("seq_len", [0, 1, 2])
def test_a_probe_row_needs_room_for_bod_a_passage_token_and_eod(seq_len):
    with pytest.raises(ConfigError, match=f"data.seq_len {seq_len}"):
        probe_row([100, 101, 102], 1, 2, seq_len)
