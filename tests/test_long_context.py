"""Long-context stages: their validation, length buckets that never repeat a document, positions with and without
the document mask, RoPE θ through the transformers export, and a stage that resumes bit for bit."""
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from openpretrain.core import ConfigError, Preset, load_preset
from openpretrain.models.common import document_positions
from openpretrain.models.registry import build_model, to_hf
from openpretrain.tokenization import load_tokenizer
from openpretrain.training.checkpoint import latest_valid_checkpoint
from openpretrain.training.curriculum import load_curriculum
from openpretrain.training.data import Batch, TokenPool
from openpretrain.training.long_context import WholeRows, check_no_repeat, stage_loader, stage_plans
from openpretrain.training.plan import fingerprint, plan, token_loader
from openpretrain.training.trainer import read_metrics, train

LONG = ["bible-kjv-text", "debian-reference-en", "debian-reference-de"]   # long-form embedded sources


MAIN = {"name": "main", "tokens": 2048, "sources": [{"name": "short", "select": {"source": ["fortunes-min"]},
                                                     "max_documents": 60, "weight": 1.0}]}   # the main run: 4 steps of 8 × 64


def write_curriculum(folder: Path, stages: list[dict]) -> Path:
    "A curriculum of the main run's stage and the long-context `stages` after it."
    path = folder / "long.yaml"
    spec = json.loads(json.dumps({"name": "long", "unit": "tokens", "stages": [MAIN, *stages]}))   # no shared lists:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))                                          # no YAML aliases
    return path


def stage(name: str, seq_len: int, iterations: int, bucket: list[int], **knobs) -> dict:
    "A stage of `iterations` steps of 2 rows, its one source the long-form texts in `bucket`."
    return {"name": name, "tokens": iterations * 2 * seq_len, "iterations": iterations,
            "tokens_per_iteration": 2 * seq_len, "seq_len": seq_len, "lr": 1e-3, **knobs,
            "sources": [{"name": f"long-{bucket[0]}", "select": {"source": LONG}, "bucket": bucket, "weight": 1.0}]}


def preset_with(curriculum: Path, **model) -> Preset:
    "A small dense model at 64 tokens under the 2,048-id BPE, extended by `curriculum`."
    base = load_preset("tiny")
    raw = copy.deepcopy(base.raw)
    raw["seed"], raw["device"] = 0, "cpu"
    raw["tokenizer"].update(name="bpe-bal-2k", vocab_size=2048)
    raw["model"].update(vocab_size=2048, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, mlp_hidden=64,
                        max_seq_len=64, rope_theta=10_000.0, **model)
    raw["data"].update(curriculum=str(curriculum), seq_len=64)
    raw["optim"].update(batch_size=8, batch_increase_at=[], batch_increase_to=[],
                        schedule={"kind": "wsd", "unit": "steps", "warmup": 1, "total": 4, "decay": 1})
    raw["train"].update(micro_batch=2, precision="fp32", checkpoint_every=2, keep_last=2, milestones=[],
                        tensorboard=False)
    raw["long_context"] = {"curriculum": str(curriculum)}
    return Preset(name="tiny", path=base.path, raw=raw)


def test_a_theta_that_decreases_along_the_stages_is_refused(tmp_path):
    path = write_curriculum(tmp_path, [stage("a", 128, 2, [64, 128], rope_theta=2e4),
                                       stage("b", 256, 2, [128, 256], rope_theta=1e4)])
    with pytest.raises(ConfigError, match="θ may only grow"):
        load_curriculum(path)


def test_a_later_stage_must_be_longer(tmp_path):
    path = write_curriculum(tmp_path, [stage("a", 256, 2, [128, 256], rope_theta=2e4),
                                       stage("b", 128, 2, [64, 128], rope_theta=4e4)])
    with pytest.raises(ConfigError, match="must be longer than"):
        load_curriculum(path)


def test_a_length_above_the_models_context_without_a_larger_theta_is_refused(tmp_path):
    path = write_curriculum(tmp_path, [stage("a", 128, 2, [64, 128], rope_theta=10_000.0)])   # = the model's θ
    with pytest.raises(ConfigError, match="above the model's context 64 but RoPE θ stays at 10000"):
        stage_plans(preset_with(path))
    without = write_curriculum(tmp_path, [stage("a", 128, 2, [64, 128])])                       # no θ at all
    with pytest.raises(ConfigError, match="give the stage a larger rope_theta"):
        stage_plans(preset_with(without))
    assert stage_plans(preset_with(without), keep_theta=True)[0][1].model.rope_theta == 10_000.0   # the ablation arm


def test_a_stage_changes_length_theta_lr_and_batch_and_nothing_else(tmp_path):
    path = write_curriculum(tmp_path, [stage("a", 128, 3, [64, 128], rope_theta=2e4, warmup=256)])
    p = preset_with(path)
    (_, pl), main = stage_plans(p)[0], plan(p)
    assert (pl.data.seq_len, pl.model.max_seq_len, pl.model.rope_theta) == (128, 128, 2e4)
    assert pl.schedule.batch_size_at(0) == 2 and pl.steps == 3
    assert [round(pl.schedule.lr_at(s), 6) for s in range(3)] == [0.0, 1e-3, 1e-3]   # warm-up of one step, constant
    same = lambda cfg: {k: v for k, v in vars(cfg).items() if k not in ("max_seq_len", "rope_theta")}
    assert same(pl.model) == same(main.model) and pl.goldfish == main.goldfish and pl.tokenizer == main.tokenizer


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory):
    "Two stages over disjoint length buckets of the long-form texts, tokenized once for the module."
    folder = tmp_path_factory.mktemp("buckets")
    path = write_curriculum(folder, [stage("a", 128, 4, [128, 256], rope_theta=2e4),
                                     stage("b", 256, 4, [256, 512], rope_theta=4e4)])
    p = preset_with(path)
    tok = load_tokenizer("bpe-bal-2k")
    return [(st, pl, token_loader(pl, tok)) for st, pl in stage_plans(p)], tok


def test_every_document_of_a_bucket_has_its_length_and_no_document_is_in_two_stages(bucketed):
    stages, tok = bucketed
    seen = []
    for st, _, loader in stages:
        (source,) = st.sources
        docs = [tuple(d) for d in loader.pools[source.name].documents()]
        assert docs and all(source.bucket[0] <= len(d) < source.bucket[1] for d in docs)
        assert all(d[0] == tok.bos_id and d[-1] == tok.eos_id for d in docs)
        seen.append(set(docs))
    assert not seen[0] & seen[1]


def test_a_bucket_with_too_few_documents_for_its_budget_is_refused_naming_it(bucketed):
    st, _, loader = bucketed[0][0]
    check_no_repeat(loader)                                                  # 4 steps fit
    source = st.sources[0].name
    small = {source: TokenPool(source, loader.pools[source].tokens[:500], loader.pools[source].ends[:1])}
    loader.pools, full = small, loader.pools
    try:
        with pytest.raises(ConfigError, match=f"source {source} holds 500 tokens in 1 documents, fewer than the 1,024"):
            check_no_repeat(loader)
    finally:
        loader.pools = full


def test_positions_restart_at_each_document_with_the_mask_and_run_along_the_row_without(bucketed):
    _, pl, loader = bucketed[0][0]
    masked = token_loader(pl, load_tokenizer("bpe-bal-2k"))
    whole = WholeRows(token_loader(pl, load_tokenizer("bpe-bal-2k")))
    served = [(masked.next_batch(), whole.next_batch()) for _ in range(4)]     # every row of the stage's 4 steps
    a, b = (Batch(*(torch.cat([getattr(x[i], f) for x in served]) for f in ("input_ids", "labels", "loss_mask", "doc_ids")))
            for i in (0, 1))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    bod = a.input_ids == loader.bod
    assert (document_positions(a.doc_ids)[bod] == 0).all() and bod[:, 1:].any()      # restart at each later BoD
    assert torch.equal(document_positions(b.doc_ids), torch.arange(a.input_ids.shape[1]).expand_as(a.input_ids))
    model = build_model(pl.model).eval()
    with torch.no_grad():                                   # one segment = the model reading the row without doc_ids
        torch.testing.assert_close(model(b.input_ids, doc_ids=b.doc_ids), model(b.input_ids), rtol=0, atol=0)
        assert not torch.allclose(model(a.input_ids, doc_ids=a.doc_ids), model(a.input_ids))
    assert whole.state_dict() == masked.state_dict()


def test_theta_survives_the_transformers_export_with_equal_logits_at_long_positions(tmp_path):
    from transformers import AutoModelForCausalLM
    p = preset_with(write_curriculum(tmp_path, [stage("a", 512, 2, [256, 512], rope_theta=4e6)]))
    config = stage_plans(p)[0][1].model
    torch.manual_seed(0)
    ours = build_model(config).eval()
    to_hf(ours).save_pretrained(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.rope_parameters["rope_theta"] == 4e6 and hf.config.max_position_embeddings == 512
    ids = torch.randint(0, 2048, (1, 512), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits[:, 400:], ours(ids)[:, 400:], rtol=1e-4, atol=1e-5)
        base = build_model(plan(p).model).eval()                  # the same weights at the pretraining θ differ there
        base.load_state_dict(ours.state_dict())
        assert not torch.allclose(base(ids)[:, 400:], ours(ids)[:, 400:], atol=1e-3)


WORKER = """
import json, sys
sys.path.insert(0, {tests!r})
from test_long_context import resumable
resumable(json.loads(sys.argv[1]))
"""


def resumable(a: dict) -> None:
    "Train the stage of `a['curriculum']` from `a['init']` into `a['out']`, stopping after `a['steps']` steps."
    (_, pl), = stage_plans(preset_with(Path(a["curriculum"])))
    train(plan(pl.preset, max_steps=a["steps"]), a["out"], resume=True, loader_factory=stage_loader, init=a["init"])


def test_a_long_context_stage_resumes_in_the_middle_bit_for_bit(tmp_path):
    path = write_curriculum(tmp_path, [stage("a", 128, 6, [128, 256], rope_theta=2e4)])
    p = preset_with(path)
    train(plan(p, max_steps=2), tmp_path / "base")
    init = str(latest_valid_checkpoint(tmp_path / "base" / "checkpoints", fingerprint(plan(p, max_steps=2))))
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(Path(__file__).parent)))
    go = lambda out, steps, start=init: subprocess.run([sys.executable, str(script), json.dumps(
        {"curriculum": str(path), "init": start, "out": str(tmp_path / out), "steps": steps})], check=True)
    go("whole", 6)
    go("cut", 3)                                      # a run stopped after step 3 of 6 …
    go("cut", 6)                                      # … and resumed from its own checkpoint, not from `init`
    whole, cut = read_metrics(tmp_path / "whole" / "metrics.jsonl"), read_metrics(tmp_path / "cut" / "metrics.jsonl")
    assert [r["loss"] for r in cut] == [r["loss"] for r in whole] and len(whole) == 6
    go("random", 1, None)                             # the same stage from random weights starts elsewhere
    assert read_metrics(tmp_path / "random" / "metrics.jsonl")[0]["loss"] != whole[0]["loss"]


def test_apertus_8b_stages_run_as_the_public_launch_scripts_do():
    "Llama-3 RoPE scaling in every stage, the preset's 100,000-step AdEMAMix warm-ups kept, only FineWeb-Long bucketed."
    stages = stage_plans(load_preset("apertus-8b"))
    assert [pl.data.seq_len for _, pl in stages] == [8192, 16384, 32768, 65536]
    assert [pl.model.rope_theta for _, pl in stages] == [1e6, 2e6, 4e6, 12e6]
    for st, pl in stages:
        assert pl.model.rope_scaling == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}
        assert (pl.optim.t_alpha, pl.optim.t_beta3) == (100_000, 100_000)
        assert {s.dataset for s in st.sources if s.bucket is not None} == {"FineWeb-Long"}


def test_the_ademamix_warmup_rule_is_checked_and_stage_is_the_stage_length(tmp_path):
    p = load_preset("tiny")
    assert [pl.optim.t_alpha for _, pl in stage_plans(p)] == [12, 96, 96]     # tiny: each stage's own steps
    bad = p.derive("test", long_context={"ademamix_warmup": "never"})
    with pytest.raises(ConfigError, match="ademamix_warmup must be 'stage' or 'preset'"):
        stage_plans(bad)
    kept = p.derive("test", long_context={"ademamix_warmup": "preset"})
    assert [pl.optim.t_alpha for _, pl in stage_plans(kept)] == [192, 192, 192]
