"""Goldfish masks: the reference hash-table key bit for bit, and the properties of the rolling and canonical keys."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openpretrain.corpus import load_embedded
from openpretrain.tokenization import load_tokenizer
from openpretrain.training.goldfish import (CHARS_PER_TOKEN, STRATEGIES, GoldfishConfig, canonical_vocab, goldfish_mask,
                                            label_mask, window_hash)
from openpretrain.core import ConfigError


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("bpe-bal-8k")


@pytest.fixture(scope="module")
def vocab(tok):
    return canonical_vocab(tok)


@pytest.fixture(scope="module")
def real_rows(tok):
    "Rows of 512 real token ids from the embedded corpus (English, German, Italian, Spanish text)."
    texts = load_embedded().to_pandas().sort_values("id").text.head(400)
    ids = [i for t in texts for i in [tok.bos_id, *tok.encode(t), tok.eos_id]]
    n = len(ids) // 512 * 512
    return torch.tensor(ids[:n]).view(-1, 512)


def reference_loop(labels: torch.Tensor, k: int, h: int) -> torch.Tensor:
    "Transcription of the public reference: table from a CPU generator, wrapping int64 product, Python-style mod."
    g = torch.Generator(device="cpu")
    g.manual_seed(2971215073)
    table = torch.rand(1_000_003, generator=g)
    keep = torch.ones(labels.shape, dtype=torch.bool)
    for b in range(labels.shape[0]):
        row = labels[b].tolist()
        for i in range(h - 1, len(row)):
            prod = 1
            for x in row[i - h + 1:i + 1]:
                prod *= x
            prod = (prod + 2**63) % 2**64 - 2**63  # int64 two's-complement wrap
            if table[prod % 1_000_003].item() < 1 / k:
                keep[b, i] = False
    return keep


@pytest.mark.parametrize("k,h", [(50, 50), (3, 4), (7, 13)])
def test_hash_table_equals_reference_transcription_on_real_tokens(real_rows, k, h):
    labels = real_rows[:3]
    assert torch.equal(goldfish_mask(labels, k, h, "hash-table"), reference_loop(labels, k, h))


def test_hash_table_equals_reference_on_ids_whose_products_wrap_to_zero():
    labels = torch.randint(0, 8, (2, 200)) * 2  # even ids: products collect factors of two and wrap
    assert torch.equal(goldfish_mask(labels, 2, 40, "hash-table"), reference_loop(labels, 2, 40))


@pytest.mark.parametrize("strategy", ["hash-table", "rolling"])
def test_first_h_minus_1_labels_are_never_dropped(real_rows, strategy):
    keep = goldfish_mask(real_rows, 2, 10, strategy)
    assert keep[:, :9].all() and not keep[:, 9:].all()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_drop_rate_is_about_one_in_k_on_real_tokens(real_rows, vocab, strategy):
    keep = goldfish_mask(real_rows, 50, 50, strategy, vocab=vocab)
    droppable = keep.numel() - real_rows.shape[0] * 49
    assert 0.015 < (~keep).sum().item() / droppable < 0.025


def test_rows_shorter_than_h_are_kept():
    assert goldfish_mask(torch.ones(2, 10, dtype=torch.long) * 3, 2, 50).all()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**20), min_size=2, max_size=60), st.integers(1, 20))
def test_rolling_hash_equals_horner_over_python_ints(values, w):
    x = torch.tensor([values]) + 1
    got = window_hash(x, w)[0].tolist()
    for i in range(len(values)):
        acc = 0
        for v in values[max(0, i - w + 1):i + 1]:
            acc = (acc * (1_000_000_007 % (2**31 - 1)) + v + 1) % (2**31 - 1)
        assert got[i] == acc


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 8191), min_size=6, max_size=6, unique=True))
def test_rolling_key_is_order_sensitive_unlike_the_product(window):
    fwd, rev = torch.tensor([window]), torch.tensor([window[::-1]])
    assert window_hash(fwd + 1, 6)[0, -1] != window_hash(rev + 1, 6)[0, -1]
    assert torch.equal(fwd.prod(-1), rev.prod(-1))


def test_rolling_keys_do_not_collapse_where_the_reference_product_wraps_to_zero():
    labels = torch.randint(1, 100, (4, 300)) * 64  # each id carries 6 factors of two: h = 50 windows wrap to 0
    ref = labels.unfold(1, 50, 1).prod(-1)
    roll = window_hash(labels + 1, 50)[:, 49:]
    assert (ref == 0).all()
    assert (roll != 0).all() and roll.unique().numel() == roll.numel()


def _variant_decisions(tok, vocab, text, strategy, k=5, h=8):
    "Map normalised byte offset where each token ends → its drop decision (tokens with a full window only)."
    ids = [tok.bos_id, *tok.encode(text)]
    keep = goldfish_mask(torch.tensor([ids]), k, h, strategy, vocab=vocab)[0]
    lens = vocab.lens[torch.tensor(ids)]
    ends = lens.cumsum(0)
    return {int(e): bool(kp) for e, kp, n in zip(ends, keep, lens) if n > 0 and e >= CHARS_PER_TOKEN * h}


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from("the LORD shepherd want green pastures waters soul paths righteousness name "
                                "valley shadow death fear evil rod staff comfort table presence enemies".split()),
                min_size=40, max_size=120),
       st.randoms(use_true_random=False))
def test_canonical_decisions_agree_across_formattings(tok, vocab, words, rnd):
    plain = " ".join(words)
    styled = "".join((w.upper() if rnd.random() < 0.2 else w) + rnd.choice([" ", "\n", ",  ", ";\n", " - "])
                     for w in words)
    a = _variant_decisions(tok, vocab, plain, "canonical")
    b = _variant_decisions(tok, vocab, styled, "canonical")
    shared = a.keys() & b.keys()
    assert len(shared) > 10
    assert all(a[p] == b[p] for p in shared)


def test_reference_decisions_differ_across_formattings(tok, vocab):
    words = ("the LORD is my shepherd I shall not want he maketh me to lie down in green pastures he leadeth me "
             "beside the still waters he restoreth my soul ").split() * 6
    a = _variant_decisions(tok, vocab, " ".join(words), "hash-table", k=3)
    b = _variant_decisions(tok, vocab, "\n".join(words), "hash-table", k=3)
    shared = a.keys() & b.keys()
    assert sum(a[p] != b[p] for p in shared) > len(shared) // 10


def test_canonical_needs_a_vocabulary():
    with pytest.raises(ValueError, match="canonical_vocab"):
        goldfish_mask(torch.ones(1, 60, dtype=torch.long), strategy="canonical")


def test_config_rejects_unknown_strategy_and_hook_is_none_when_off():
    with pytest.raises(ConfigError, match="strategy"):
        GoldfishConfig(strategy="md5")
    assert label_mask(GoldfishConfig(enabled=False)) is None


def test_preset_loader_applies_the_goldfish_mask_front_loaded(tok):
    from openpretrain.training.plan import plan, token_loader
    pl = plan("tiny")
    b = token_loader(pl, tok, label_mask=label_mask(pl.goldfish, tok)).next_batch()
    structural = b.input_ids != tok.eos_id                  # chapter 08's EoD rule
    expected = structural & reference_loop(b.labels, 50, 50)  # tiny: k = h = 50, hash-table
    assert torch.equal(b.loss_mask, expected) and not expected.all()
