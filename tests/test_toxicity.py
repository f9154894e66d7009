"""Toxicity stage (Apertus §3.1.3): head, training protocol, thresholds, fallback, loaders, embedders."""
import codecs
import os
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from openpretrain.compliance.toxicity import (
    CachedEmbedder, ToxicityConfig, ToxicityHead, ToxicityScorer, USEEmbedder, XLMREmbedder, balance, fit_temperature,
    fit_threshold, lexicon_pattern, load_heads, load_toxic_commons, load_weak_labels, random_score, read_fortunes,
    resolve_head, split_validation, train_head, weak_scores, word_chunks)
from openpretrain.core import load_preset


def test_head_is_linear_relu_dropout_linear_with_two_outputs():
    head = ToxicityHead(768, dropout=0.2)
    kinds = [type(m) for m in head.net]
    assert kinds == [nn.Linear, nn.ReLU, nn.Dropout, nn.Linear]
    assert (head.net[0].in_features, head.net[0].out_features, head.net[3].out_features) == (768, 768, 2)
    assert head.net[2].p == 0.2
    assert sum(p.numel() for p in head.parameters()) == 768 * 768 + 768 + 768 * 2 + 2
    p = head.p_toxic(np.random.default_rng(0).normal(size=(5, 768)).astype(np.float32))
    assert p.shape == (5,) and ((0 <= p) & (p <= 1)).all()


def test_balance_keeps_every_toxic_and_subsamples_non_toxic_to_fifty_fifty():
    y = np.array([1] * 30 + [0] * 200)
    idx = balance(y, np.random.default_rng(1))
    assert len(idx) == 60 and len(set(idx)) == 60
    assert set(np.flatnonzero(y == 1)) <= set(idx)
    assert (y[idx] == 0).sum() == 30


def test_validation_split_holds_out_ten_percent_disjointly():
    idx = np.random.default_rng(0).permutation(500)
    tr, va = split_validation(idx, 0.1)
    assert len(va) == 50 and len(tr) == 450 and not set(tr) & set(va)


def _blobs(n=400, d=16, seed=0):
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < 0.25).astype(int)
    x = rng.normal(size=(n, d)).astype(np.float32) + 0.6 * y[:, None]
    return x, y


def test_training_returns_the_best_validation_checkpoint():
    x, y = _blobs()
    cfg = ToxicityConfig(epochs=6, lr=3e-2, seed=3)
    trained = train_head(x, y, cfg)
    accs = [h["val_acc"] for h in trained.history]
    assert len(accs) == 6 and trained.best_epoch == int(np.argmax(accs)) + 1
    # recompute the validation set independently: same seed → same balance and split
    _, va = split_validation(balance(y, np.random.default_rng(3)), 0.1)
    acc = ((trained.head.p_toxic(x[va]) > 0.5).astype(int) == y[va]).mean()
    assert acc == pytest.approx(max(accs))
    assert trained.n_train + trained.n_val == 2 * y.sum()


def test_head_learns_the_weak_signal_on_real_text():
    weak = load_weak_labels()
    es = pd.concat([weak[(weak.lang == "es") & (weak.toxic == t)].head(200) for t in (0, 1)])
    x = np.stack([e[0] for e in USEEmbedder().embed(es.text.tolist())])
    trained = train_head(x, es.toxic.values, ToxicityConfig())
    assert max(h["val_acc"] for h in trained.history) > 0.7  # weak labels: offensive collection vs clean fortunes


def test_threshold_removes_the_top_five_percent_of_each_language():
    rng = np.random.default_rng(0)
    langs = np.array(["pt"] * 3000 + ["pl"] * 2000)
    scores = np.concatenate([rng.beta(2, 3, 3000), rng.beta(0.2, 3, 2000)])  # different shapes, like Fig. 4
    scorer = ToxicityScorer(None, {}, ToxicityConfig())
    scorer.thresholds = {lang: fit_threshold(scores[langs == lang]) for lang in ("pt", "pl")} | {"*": fit_threshold(scores)}
    removed = scorer.remove(scores, langs)
    for lang, n in (("pt", 3000), ("pl", 2000)):
        assert abs(removed[langs == lang].sum() - 0.05 * n) <= 1
    assert scorer.thresholds["pt"] > scorer.thresholds["pl"]


def test_fallback_picks_own_then_closest_then_multilingual_then_random():
    heads = {"it": None, "multilingual": None}
    assert resolve_head("it", heads, ToxicityConfig()) == "it"
    assert resolve_head("rm", heads, ToxicityConfig(fallback="closest", closest={"rm": "it"})) == "it"
    assert resolve_head("fr", heads, ToxicityConfig(fallback="closest", closest={"fr": "es"})) == "multilingual"
    assert resolve_head("rm", heads, ToxicityConfig(fallback="multilingual")) == "multilingual"
    assert resolve_head("rm", heads, ToxicityConfig(fallback="random")) == "random"
    with pytest.raises(ValueError, match="fallback"):
        resolve_head("rm", {"it": None}, ToxicityConfig(fallback="nearest"))


def test_random_fallback_drops_five_percent_reproducibly():
    ids = [f"doc-{i}" for i in range(20_000)]
    scorer = ToxicityScorer(None, {}, ToxicityConfig(fallback="random"))
    scores, used = scorer.score(["x"] * len(ids), ["rm"] * len(ids), ids)
    assert set(used) == {"random"} and scores.tolist() == [random_score(i) for i in ids]
    scorer.calibrate(["x"] * len(ids), ["rm"] * len(ids), ids)
    assert abs(scorer.remove(scores, ["rm"] * len(ids)).mean() - 0.05) < 1e-3
    assert abs(scores.mean() - 0.5) < 0.01  # uniform


def test_rare_languages_share_the_pooled_threshold():
    rng = np.random.default_rng(1)
    langs = ["de"] * 400 + ["roh"] * 20
    scorer = ToxicityScorer(None, {}, ToxicityConfig(min_language_docs=100))
    thresholds = scorer.fit_thresholds(rng.random(420), langs)
    assert set(thresholds) == {"de", "*"}


def test_uncalibrated_language_uses_the_all_languages_threshold():
    scorer = ToxicityScorer(None, {}, ToxicityConfig(), thresholds={"en": 0.9, "*": 0.5})
    assert scorer.remove(np.array([0.7, 0.7]), ["en", "xx"]).tolist() == [False, True]


def test_toxic_commons_loader_reads_its_schema_and_labels_total_above_zero(tmp_path):
    rows = pd.DataFrame({
        "text": ["The weather in the valley was mild and the harvest good this year.",
                 "Der Zug nach Zürich fährt heute wegen Bauarbeiten eine halbe Stunde später ab.",
                 "Il gatto dorme sul divano tutto il pomeriggio mentre fuori piove."],
        "race_origin": [0, 2, 0], "gender_sex": [0, 0, 0], "religion": [0, 0, 0], "ability": [0, 0, 0],
        "violence": [0, 1, 0]})
    path = tmp_path / "toxic_commons.csv"
    rows.to_csv(path, index=False)
    df = load_toxic_commons(str(path))
    assert df.score.tolist() == [0, 3, 0] and df.toxic.tolist() == [0, 1, 0]
    assert df.lang.tolist() == ["en", "de", "it"]
    assert load_toxic_commons(str(path), languages=["de"]).text.tolist() == [rows.text[1]]
    rows.drop(columns="violence").to_csv(path, index=False)
    with pytest.raises(ValueError, match="violence"):
        load_toxic_commons(str(path))


def test_spanish_offensive_fortunes_are_rot13_decoded(tmp_path):
    path = tmp_path / "off.fortunes"
    path.write_text(codecs.encode("Esto es un chiste muy ofensivo.", "rot13") + "\n%\nshort\n%\n")
    assert read_fortunes(path, rot13=True) == ["Esto es un chiste muy ofensivo."]


def test_lexicon_counts_whole_words_only():
    pat = lexicon_pattern(["ass", "bad word"])
    df = weak_scores(["A bad word and an ass.", "The class passed."], pat, offensive=False)
    assert df.lexicon.tolist() == [2, 0] and df.toxic.tolist() == [1, 0]


def test_word_chunks_cover_the_document():
    text = " ".join(f"w{i}" for i in range(300))
    chunks = word_chunks(text, 128)
    assert [len(c.split()) for c in chunks] == [128, 128, 44] and " ".join(chunks) == text


def _tiny_xlmr():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, XLMRobertaConfig, XLMRobertaModel
    words = "the cat sat on a mat der hund il gatto and dog ran far".split()
    vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", *words])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", cls_token="<s>", eos_token="</s>",
                                  sep_token="</s>", pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(0)
    cfg = XLMRobertaConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=40, pad_token_id=1, bos_token_id=0,
                           eos_token_id=2)
    return XLMRobertaModel(cfg), tok


def test_xlmr_embedder_mean_pools_every_chunk_like_a_direct_forward():
    model, tok = _tiny_xlmr()
    emb = XLMREmbedder(model=model, tokenizer=tok, chunk_tokens=16)
    long = " ".join(["the cat sat on a mat and dog ran far"] * 4)  # 40 tokens → 3 chunks of ≤ 14 + specials
    short = "il gatto"
    out = emb.embed([long, short])
    ids = tok(long, add_special_tokens=False)["input_ids"]
    assert [e.shape for e in out] == [(3, 32), (1, 32)]
    for k, start in enumerate(range(0, len(ids), 14)):
        chunk = torch.tensor([[0, *ids[start:start + 14], 2]])
        with torch.no_grad():
            ref = model(input_ids=chunk).last_hidden_state.mean(1)[0]  # no padding: plain mean
        np.testing.assert_allclose(out[0][k], ref.numpy(), atol=1e-5)
    np.testing.assert_allclose(emb.embed([short])[0], out[1], atol=1e-5)  # padding in a batch changes nothing


def test_heads_round_trip_through_safetensors(tmp_path):
    torch.manual_seed(0)
    heads = {"it": ToxicityHead(8), "multilingual": ToxicityHead(8)}
    scorer = ToxicityScorer(None, heads, ToxicityConfig(), thresholds={"it": 0.7, "*": 0.6})
    loaded, thresholds = load_heads(scorer.save(tmp_path / "heads.safetensors"))
    x = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
    assert thresholds == {"it": 0.7, "*": 0.6} and set(loaded) == {"it", "multilingual"}
    np.testing.assert_allclose(loaded["it"].p_toxic(x), heads["it"].p_toxic(x), atol=2e-3)  # stored in fp16


def test_committed_heads_cover_the_configured_languages_and_the_multilingual_fallback():
    heads, _ = load_heads()
    assert {"en", "it", "es", "multilingual"} <= set(heads)
    assert all(h.net[0].in_features == USEEmbedder.dim for h in heads.values())


def _auc(y: np.ndarray, s: np.ndarray) -> float:
    "P(score of a random toxic example > score of a random clean one), ties counting half."
    pos, neg = s[y == 1][:, None], s[y == 0][None, :]
    return float((pos > neg).mean() + 0.5 * (pos == neg).mean())


@pytest.mark.parametrize("lang", ["en", "it", "es"])
def test_committed_heads_rank_held_out_toxic_texts_above_clean_ones(lang):
    cfg = load_preset("tiny").section("toxicity", ToxicityConfig)
    table = load_weak_labels()
    table = table[table.lang == lang].reset_index(drop=True)
    _, va = split_validation(balance(table.toxic.values, np.random.default_rng(cfg.seed)), cfg.val_share)  # held out
    va = va[:80]
    x = np.stack([e[0] for e in USEEmbedder(cfg.chunk_words, cfg.max_chunks).embed(table.text.values[va].tolist())])
    y, s = table.toxic.values[va], load_heads()[0][lang].p_toxic(x)
    assert 0 < y.sum() < len(y) and _auc(y, s) > 0.7, _auc(y, s)
    assert np.median(s[y == 1]) > np.median(s[y == 0])


def test_training_twice_with_different_thread_counts_gives_identical_bytes():
    x, y = _blobs(n=3000, d=128, seed=5)
    cfg = ToxicityConfig(epochs=3, seed=2)
    before, states = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            head = train_head(x, y, cfg).head
            states.append(b"".join(v.numpy().tobytes() for v in head.state_dict().values()))
    finally:
        torch.set_num_threads(before)
    assert states[0] == states[1] == states[2]


def test_a_documents_vectors_do_not_depend_on_its_batch():
    texts = load_weak_labels().text.head(30).tolist()
    use = USEEmbedder(max_chunks=4)
    alone = [use.embed([t])[0] for t in texts[:4]]
    assert all(np.array_equal(a, b) for a, b in zip(alone, use.embed(texts[::-1])[::-1][:4]))


def test_forked_workers_embed_exactly_what_one_process_does():
    texts = load_weak_labels().text.head(130).tolist()   # ≥ 64 texts per worker: the forked path
    got, serial = USEEmbedder(max_chunks=4, workers=2).embed(texts), USEEmbedder(max_chunks=4).embed(texts)
    assert len(got) == len(texts) and all(np.array_equal(a, b) for a, b in zip(got, serial))


def test_a_worker_that_dies_stops_the_embedding_with_an_error_not_a_hang(monkeypatch):
    monkeypatch.setattr(USEEmbedder, "encode", lambda self, texts: os._exit(1))   # the forks inherit it: killed mid-slice
    with pytest.raises(BrokenProcessPool):
        USEEmbedder(workers=2).embed(["a text"] * 130)


def test_cached_embedder_serves_the_same_vectors_without_the_encoder(tmp_path):
    texts = load_weak_labels().text.head(5).tolist()
    cached = CachedEmbedder(USEEmbedder(), tmp_path)
    first = cached.embed(texts)
    cached.inner = None  # any cache miss would now fail
    assert all(np.array_equal(a, b) for a, b in zip(first, cached.embed(texts[::-1])[::-1]))
    assert len(list(tmp_path.rglob("*.npy"))) == 5 and not list(tmp_path.rglob("*.tmp"))


def test_temperature_recovers_an_inflated_logit_scale():
    m = np.random.default_rng(0).normal(size=20_000)
    y = (np.random.default_rng(1).random(20_000) < 1 / (1 + np.exp(-m))).astype(int)  # calibrated at T = 1
    assert fit_temperature(3 * m, y) == pytest.approx(3, rel=0.08)
    head = ToxicityHead(4)
    head.temperature.fill_(2.0)
    x = np.random.default_rng(2).normal(size=(6, 4)).astype(np.float32)
    np.testing.assert_allclose(head.p_toxic(x), 1 / (1 + np.exp(-head.margin(x) / 2)))


def test_a_scorer_without_the_pooled_cut_refuses_to_decide():
    scorer = ToxicityScorer(None, {}, ToxicityConfig(), thresholds={"it": 0.5})
    with pytest.raises(ValueError, match="'\\*'"):
        scorer.remove(np.array([0.9]), ["it"])
