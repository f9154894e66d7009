"""lm-eval model (chapter 13): token boundaries as lm-eval splits them, scores equal to lm-eval's `hf` backend, stops, tasks."""
import math
from types import SimpleNamespace

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM

from openpretrain.core import load_preset
from openpretrain.corpus import load_embedded
from openpretrain.evaluation.harness import (EvaluationConfig, OpenPretrainLM, TrainedText, continuation_items,
                                             encode_pair, evaluate, heldout_tasks, hf_backend, main, udhr_documents,
                                             udhr_versions, validation_documents, validation_sentences, write_tasks)
from openpretrain.models.registry import build_model, model_config, to_hf
from openpretrain.tokenization import TokenizerConfig, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(load_preset("tiny").section("tokenizer", TokenizerConfig))


def _model(name):
    torch.manual_seed(0)
    return build_model(model_config(load_preset(name))).eval()


@pytest.mark.parametrize("context, continuation", [("Der Mensch ist frei", " und gleich"), ("Uman ", "liber"),
                                                   ("Tuts umans naschan", "  libers.")])
def test_encode_pair_splits_like_lm_eval(tok, context, continuation):
    # lm-eval's own split (TemplateLM._encode_pair) over the same tokenizer is the reference
    ref = SimpleNamespace(tok_encode=tok.encode, backend="causal", AUTO_MODEL_CLASS=None)
    assert encode_pair(tok, context, continuation, tok.bos_id) == tuple(TemplateLM._encode_pair(ref, context, continuation))


@pytest.mark.parametrize("name", ["tiny", "tiny-hybrid"])
def test_loglikelihoods_equal_lm_eval_hf_backend(tok, tmp_path, name):
    model = _model(name)
    to_hf(model).save_pretrained(tmp_path)
    ours = OpenPretrainLM(model, tok, max_length=32, batch_size=3)
    theirs = hf_backend(tmp_path, tok, max_length=32, batch_size=2)
    text = " ".join(load_embedded("validation", languages=["roh"])["text"][:1])[:600]
    reqs = [Instance("loglikelihood", {}, (text[:a], text[a:b]), i)
            for i, (a, b) in enumerate([(0, 20), (30, 45), (100, 150), (10, 11), (200, 260)])]
    for (x, gx), (y, gy) in zip(ours.loglikelihood(reqs), theirs.loglikelihood(reqs)):
        assert x == pytest.approx(y, abs=1e-4) and gx == gy
    rolling = [Instance("loglikelihood_rolling", {}, (text,), 0)]   # ~200 tokens: several 32-token windows
    assert ours.loglikelihood_rolling(rolling)[0] == pytest.approx(theirs.loglikelihood_rolling(rolling)[0], abs=1e-3)


def test_generate_until_cuts_at_the_first_stop_sequence(tok):
    lm = OpenPretrainLM(_model("tiny-hybrid"), tok, max_length=64)
    prompt = "Mintgin ha il dretg da"
    free = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": [], "max_gen_toks": 12}), 0)])[0]
    stop = free[len(free) // 2:len(free) // 2 + 2]
    assert stop and len(free) > 4
    cut = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": [stop], "max_gen_toks": 12}), 0)])[0]
    assert cut == free[:free.index(stop)]


def test_continuation_items_hold_the_true_second_half():
    items = continuation_items("deu", validation_sentences("deu"), 5, 4, seed=0)
    sentences = {" ".join(s.split()) for doc in load_embedded("validation", languages=["deu"])["text"]
                 for s in __import__("re").split(r"(?<=[.!?])\s+", doc)}
    assert len(items) == 5
    for it in items:
        assert len(set(it["choices"])) == 4 and 0 <= it["label"] < 4
        assert " ".join((it["context"] + it["choices"][it["label"]]).split()) in sentences


def test_local_tasks_run_offline_and_bits_per_byte_is_the_rolling_loss(tok, tmp_path):
    cfg = EvaluationConfig(languages=["roh", "deu"], udhr_articles=1, validation_docs=0, mc_items=2)
    task_dir = write_tasks({lang: udhr_documents(lang, 1) for lang in cfg.languages},
                           continuation_items("deu", validation_sentences("deu"), 2, 4), tmp_path)
    lm = OpenPretrainLM(_model("tiny-hybrid"), tok, max_length=64, batch_size=4)
    table = evaluate(lm, cfg.tasks, task_dir).set_index(["task", "metric"]).value
    doc = (tmp_path / "openpretrain_bpb_roh.jsonl").read_text().splitlines()[0]
    text = __import__("json").loads(doc)["text"]
    ll = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])[0]
    assert table["openpretrain_bpb_roh", "bits_per_byte"] == pytest.approx(-ll / len(text.encode()) / math.log(2))
    assert 0 <= table["openpretrain_continuation", "acc"] <= 1


def _checkpoint(root, step: int, model):
    "A weights-only checkpoint of `model`, with the run state a trainer checkpoint records (its format, its model)."
    from openpretrain.core import to_dict
    from openpretrain.training.checkpoint import write_checkpoint
    return write_checkpoint(root, step, {"model.safetensors": model.state_dict(), "state.json": {
        "step": step, "format": "full", "fingerprint": {"model": to_dict(model.config)}}})


def test_cli_scores_a_trainer_checkpoint_like_the_model_it_holds(tok, tmp_path, capsys):
    model = _model("tiny-hybrid")
    ckpt = _checkpoint(tmp_path / "checkpoints", 1, model)
    out = tmp_path / "results.csv"
    assert main(["--checkpoint", str(ckpt), "--preset", "tiny-hybrid", "--tasks", "openpretrain_bpb_roh",
                 "--limit", "1", "--out", str(out)]) == 0
    import pandas as pd
    table = pd.read_csv(out).set_index("metric").value
    text = udhr_documents("roh", 1)[0]  # the first text of the roh task: Romansh UDHR article 1, held out
    ll = OpenPretrainLM(model, tok, max_length=256).loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])[0]
    assert table["bits_per_byte"] == pytest.approx(-ll / len(text.encode()) / math.log(2), rel=1e-5)


@pytest.fixture(scope="module")
def trained():
    return TrainedText.from_preset(load_preset("tiny"))


@pytest.fixture(scope="module")
def pool_text(trained):
    "The tiny curriculum's pools decoded to text: the independent, character-level view of what the models read."
    return "\x00".join(trained.tokenizer.tok.decode(s.tolist()) for s in trained.streams)


@pytest.fixture(scope="module")
def pool_spans(trained):
    "Every run of 16 whitespace-separated words in the decoded pools (16 words ⇒ ≥ 13 tokens shared inside a span)."
    spans = set()
    for stream in trained.streams:
        words = trained.tokenizer.tok.decode(stream.tolist()).split()
        spans.update(tuple(words[i:i + 16]) for i in range(len(words) - 15))
    return spans


def _shares_a_span(text, spans):
    words = text.split()
    return any(tuple(words[i:i + 16]) in spans for i in range(len(words) - 15))


def test_heldout_check_flags_udhr_the_curriculum_reads_and_passes_a_validation_document(trained, pool_text, pool_spans):
    read = [(code, doc) for lang in ["por", "fin"] for code in udhr_versions(lang)
            for doc in udhr_documents(lang, 30, code) if doc in pool_text]
    assert read, "the tiny udhr source holds the Portuguese and Finnish UDHR verbatim"
    assert all(trained.overlap(doc) > 0 for _, doc in read)
    doc = validation_documents("roh", 1)[0]
    assert not _shares_a_span(doc, pool_spans)
    assert trained.overlap(doc) == 0


def test_heldout_check_refuses_a_text_too_short_to_check(trained):
    with pytest.raises(ValueError, match="too short"):
        trained.overlap("a")


def test_heldout_tasks_never_emit_a_text_the_curriculum_reads(trained, pool_spans):
    cfg = EvaluationConfig(languages=["por", "fin", "spa", "roh"], validation_docs=4, mc_items=5)
    bpb, items, check = heldout_tasks(cfg, [trained])
    emitted = [t for docs in bpb.values() for t in docs] + [it["context"] + c for it in items for c in it["choices"]]
    assert emitted and not any(_shares_a_span(t, pool_spans) for t in emitted)
    assert not any(doc in bpb.get("por", []) for doc in udhr_documents("por", 30, "por_PT"))  # por_PT is in the pool
    assert "fin" not in bpb  # both Finnish versions share windows with the trained one, and fin has no validation text
    assert "roh" in bpb and len(bpb["roh"]) == 30 + 4
    flagged = check.set_index(["source", "language"])["trained on"]
    assert flagged["UDHR por_PT", "por"] == 30 and flagged["UDHR roh", "roh"] == 0


@pytest.fixture(scope="module")
def backends(tok, tmp_path_factory):
    "Ours and lm-eval's `hf` backend over the same random tiny model, both with a 16-token window."
    model = _model("tiny")
    folder = tmp_path_factory.mktemp("hf")
    to_hf(model).save_pretrained(folder)
    return OpenPretrainLM(model, tok, max_length=16, batch_size=2), hf_backend(folder, tok, max_length=16, batch_size=2)


def _ll(lm, *pairs):
    return lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)


def _assert_equal_scores(ours, theirs):
    for (x, gx), (y, gy) in zip(ours, theirs, strict=True):
        assert x == pytest.approx(y, abs=1e-4) and gx == gy


ROH = " ".join(load_embedded("validation", languages=["roh"])["text"][:1])


@pytest.mark.parametrize("context", ["  ", "\n", " \t "])
def test_a_whitespace_only_context_scores_every_continuation_token(backends, context):
    # lm-eval moves the context's trailing spaces to the continuation, which leaves an empty context: its rule for
    # one is the prefix token. (Its hf backend, without an added BoS, asserts on the empty encoding here; with a
    # BoS-adding tokenizer it conditions on that BoS, i.e. gives exactly this.)
    ours, theirs = backends
    cont = "Uman liber e egual en dignitad"
    _assert_equal_scores(_ll(ours, (context, cont)), _ll(theirs, ("", context + cont)))



def test_a_continuation_longer_than_max_length_is_refused_like_lm_eval(tok, backends):
    ours, theirs = backends
    ctx, rest = ROH[:60], ROH[60:400]
    fits = next(b for b in range(len(rest)) if len(encode_pair(tok, ctx, rest[:b], tok.bos_id)[1]) == 16)
    # 16 continuation tokens: both score all of them, the context cut to its last token
    _assert_equal_scores(_ll(ours, (ctx, rest[:fits])), _ll(theirs, (ctx, rest[:fits])))
    longer = (ctx, rest[:fits + 40])   # cut to its last 16 tokens, its first words would not count
    with pytest.raises(ValueError, match="continuation of .* tokens exceeds max_length 16"):
        _ll(ours, longer)
    with pytest.raises(AssertionError):  # lm-eval's hf backend refuses it too (`len(continuation_enc) <= max_length`)
        _ll(theirs, longer)



@pytest.mark.parametrize("kind, args", [("loglikelihood", ("Uman \ud800", " liber")),
                                        ("loglikelihood", ("Uman", " lib\udfffer")),
                                        ("loglikelihood_rolling", ("\ud83d Uman liber",)),
                                        ("generate_until", ("Uman \ud800", {"until": ["."], "max_gen_toks": 2}))])
def test_a_lone_surrogate_is_refused_naming_the_task_and_document(backends, kind, args):
    ours, _ = backends
    request = Instance(kind, {}, args, 0, metadata=("openpretrain_continuation", 7, 1))
    with pytest.raises(ValueError, match=r"openpretrain_continuation.*document 7.*lone surrogate U\+D[89A-F][0-9A-F]{2}"):
        getattr(ours, kind)([request])


class _Bounded(torch.nn.Module):
    "A model whose forward runs out of memory above 3 rows (as CUDA reports it)."
    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, ids, **kw):
        if ids.shape[0] > 3:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.model(ids, **kw)


@pytest.mark.parametrize("batch_size", ["auto", "auto:4", 3, "3"])
def test_batch_sizes_parse_like_lm_eval_and_auto_finds_one_that_fits(tok, backends, batch_size):
    ours, theirs = backends
    pairs = [(ROH[:a], ROH[a:a + 30]) for a in (5, 20, 40, 60, 80)]
    lm = OpenPretrainLM(_Bounded(ours.model), tok, max_length=16, batch_size=batch_size, max_batch_size=8)
    _assert_equal_scores(_ll(lm, *pairs), _ll(theirs, *pairs))


@pytest.mark.parametrize("batch_size", ["auto4", "auto:", "auto:0", "auto:x", "0", "-2", "eight", "2.5"])
def test_a_batch_size_lm_eval_would_not_parse_is_refused_in_its_terms(tok, backends, batch_size):
    with pytest.raises(ValueError, match="positive integer, 'auto' or 'auto:N'"):
        OpenPretrainLM(backends[0].model, tok, batch_size=batch_size)



def _cli_error(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("openpretrain eval: "), err
    return err


def test_cli_says_in_one_line_what_a_bad_checkpoint_path_is(tmp_path, capsys):
    run = tmp_path / "run"
    good = _checkpoint(run / "checkpoints", 1, _model("tiny-hybrid"))
    broken = _checkpoint(run / "checkpoints", 2, _model("tiny-hybrid"))
    (broken / "model.safetensors").write_bytes(b"truncated")   # the newest: refused, so step 1 is named
    (run / "metrics.jsonl").write_text("")
    args = ("--preset", "tiny-hybrid", "--tasks", "openpretrain_bpb_roh", "--limit", "1")
    assert "no such checkpoint folder" in _cli_error(capsys, "--checkpoint", str(tmp_path / "missing"), *args)
    assert "a file, not a checkpoint folder" in _cli_error(capsys, "--checkpoint", str(good / "model.safetensors"), *args)
    (empty := tmp_path / "empty").mkdir()
    assert "neither a checkpoint" in _cli_error(capsys, "--checkpoint", str(empty), *args)
    assert "does not match its sha256" in _cli_error(capsys, "--checkpoint", str(broken), *args)
    assert "has 2,048 ids, the model 8,192" in _cli_error(capsys, "--checkpoint", str(good), "--tokenizer", "bpe-bal-2k")
    assert "no preset 'nope'" in _cli_error(capsys, "--checkpoint", str(good), "--preset", "nope")
    assert "--limit" in _cli_error(capsys, "--checkpoint", str(good), "--limit", "0")
    assert "--limit" in _cli_error(capsys, "--checkpoint", str(good), "--limit", "one")
    assert "--checkpoint" in _cli_error(capsys, "--preset", "tiny")
    assert "--out" in _cli_error(capsys, "--checkpoint", str(good), *args, "--out", str(tmp_path / "no" / "r.csv"))
    assert "device must be" in _cli_error(capsys, "--checkpoint", str(good), *args, "--device", "tpu")
    assert "no lm-eval task" in _cli_error(capsys, "--checkpoint", str(good), *args[:2], "--tasks", "openpretrain_bpb_xyz")
