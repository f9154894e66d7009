"""The training loop: resume after SIGKILL, checkpoint integrity, NaN stops, preset errors before compute."""
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file

from openpretrain.core import ConfigError, load_preset
from openpretrain.models import registry
from openpretrain.models.registry import model_config
from openpretrain.training import trainer
from openpretrain.training.checkpoint import (CheckpointError, checkpoints, export_hf, latest_valid_checkpoint, load_model,
                                              verify_checkpoint, write_checkpoint)
from openpretrain.training.parallel import denormals_flushed, flushing_denormals
from openpretrain.training.plan import plan
from openpretrain.training.trainer import NonFiniteError, ZLoss, main, read_metrics, train_preset

TESTS = Path(__file__).parent


class SyntheticLoader:
    "Deterministic micro-batches: global micro-batch g = call·W + rank is a function of (seed, g) only."
    def __init__(self, pl, tokenizer, rank, world_size, label_mask=None):
        self.seed, self.rank, self.world, self.label_mask = pl.preset.seed, rank, world_size, label_mask
        self.rows, self.seq_len, self.vocab = pl.train.micro_batch, pl.data.seq_len, pl.model.vocab_size
        self.calls = 0

    def next_batch(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.calls * self.world + self.rank)
        self.calls += 1
        start = torch.randint(0, self.vocab, (self.rows, 1), generator=g)
        stride = torch.randint(1, 7, (self.rows, 1), generator=g)
        seq = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab    # learnable progressions
        labels = seq[:, 1:]
        mask = torch.rand(self.rows, self.seq_len, generator=g) > 0.1
        if self.label_mask is not None:
            mask &= self.label_mask(labels)
        return SimpleNamespace(input_ids=seq[:, :-1], labels=labels, loss_mask=mask,
                               doc_ids=torch.zeros(self.rows, self.seq_len, dtype=torch.long))

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, d):
        self.calls = d["calls"]


def write_preset(folder: Path, name: str = "t", arch: str = "dense", **train_overrides) -> Path:
    "A CPU-sized preset: 2-layer model, 32-token rows, batch 4 → 8 sequences at step 3."
    model = ({"arch": "dense", "vocab_size": 8192, "d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1,
              "mlp_hidden": 64, "max_seq_len": 64} if arch == "dense" else
             {"arch": "hybrid", "vocab_size": 8192, "d_model": 32, "pattern": "ME*", "n_heads": 2, "n_kv_heads": 1,
              "head_dim": 16, "mamba_heads": 4, "mamba_head_dim": 8, "mamba_groups": 1, "mamba_state": 8,
              "mamba_chunk": 16, "n_experts": 4, "top_k": 2, "expert_hidden": 16, "shared_hidden": 16})
    preset = {
        "preset": name, "seed": 0, "device": "cpu",
        "tokenizer": {"name": "bpe-bal-8k", "vocab_size": 8192},
        "model": model,
        "data": {"curriculum": "tiny", "seq_len": 32},
        "goldfish": {"k": 4, "h": 3},
        "optim": {"name": "ademamix", "lr": 3e-3, "betas": [0.9, 0.999, 0.999], "t_alpha": 20, "t_beta3": 20,
                  "clip": 1.0, "batch_size": 4, "batch_increase_at": [384], "batch_increase_to": [8],
                  "schedule": {"kind": "wsd", "unit": "steps", "warmup": 2, "total": 20, "decay": 4}},
        "train": {"micro_batch": 2, "precision": "fp32", "checkpoint_every": 2, "keep_last": 2,
                  "tensorboard": False, **train_overrides},
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(preset))
    return path


WORKER = """
import json, sys
sys.path.insert(0, {tests!r})
from test_trainer import SyntheticLoader
from openpretrain.training.trainer import train_preset
a = json.loads(sys.argv[1])
train_preset(a["preset"], a["out"], a.get("max_steps"), a.get("resume", False), loader_factory=SyntheticLoader)
"""


def worker_script(folder: Path) -> Path:
    path = folder / "worker.py"
    path.write_text(WORKER.format(tests=str(TESTS)))
    return path


def losses(metrics) -> list[float]:
    return [row["loss"] for row in read_metrics(metrics)]


def run(preset, out, max_steps, resume=False, **kw):
    return train_preset(preset, out, max_steps, resume, loader_factory=SyntheticLoader, **kw)


@pytest.mark.parametrize("arch", ["dense", "hybrid"])
def test_resume_after_sigkill_reproduces_losses(tmp_path, arch):
    preset = write_preset(tmp_path, arch=arch, checkpoint_every=2, keep_last=2)
    reference = losses(run(preset, tmp_path / "reference", 10))
    kill_after = random.Random(20261130).randint(3, 8)      # a step, drawn once, that the run is killed after
    script, out = worker_script(tmp_path), tmp_path / "killed"
    args = json.dumps({"preset": str(preset), "out": str(out), "max_steps": 10})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, str(script), args], env=env, stderr=subprocess.DEVNULL)
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 120
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= kill_after):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    subprocess.run([sys.executable, str(script), json.dumps({**json.loads(args), "resume": True})], env=env,
                   check=True, stderr=subprocess.DEVNULL)
    assert losses(metrics) == reference, f"killed after step {kill_after}"


def test_corrupted_checkpoint_is_refused_and_the_previous_one_used(tmp_path, capsys):
    preset = write_preset(tmp_path, checkpoint_every=2, keep_last=3)
    reference = losses(run(preset, tmp_path / "run", 6))
    newest = tmp_path / "run" / "checkpoints" / "step-00000006" / "optimizer.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])           # truncated
    with pytest.raises(CheckpointError, match="optimizer.safetensors does not match its sha256"):
        verify_checkpoint(newest.parent)
    assert latest_valid_checkpoint(tmp_path / "run" / "checkpoints").name == "step-00000004"
    resumed = losses(run(preset, tmp_path / "run", 6, resume=True))
    assert "refusing checkpoint" in capsys.readouterr().err
    assert resumed == reference


def test_single_process_sharded_checkpoint_resumes_bit_for_bit(tmp_path):
    preset = write_preset(tmp_path, checkpoint_every=2, checkpoint_format="sharded")
    reference = losses(run(preset, tmp_path / "run", 4))
    ckpts = checkpoints(tmp_path / "run" / "checkpoints")
    assert [(p / "dcp" / ".metadata").is_file() and not (p / "model.safetensors").exists() for p in ckpts] == [True, True]
    shutil.rmtree(ckpts[-1])                                   # back to step 2
    assert losses(run(preset, tmp_path / "run", 4, resume=True)) == reference


def test_interrupted_checkpoint_write_is_never_loaded(tmp_path):
    write_checkpoint(tmp_path, 1, {"state.json": {"step": 1, "format": "full", "fingerprint": {}}})
    partial = tmp_path / "step-00000002"                     # a folder without its manifest, as a crash leaves
    partial.mkdir()
    (partial / "state.json").write_text("{}")
    assert latest_valid_checkpoint(tmp_path).name == "step-00000001"


def test_keep_last_prunes_rolling_checkpoints_but_keeps_milestones(tmp_path):
    preset = write_preset(tmp_path, checkpoint_every=1, keep_last=2, milestones=[2])
    run(preset, tmp_path / "run", 6)
    assert [p.name for p in checkpoints(tmp_path / "run" / "checkpoints")] == [
        "step-00000002", "step-00000005", "step-00000006"]


def test_metrics_have_one_row_per_optimizer_step_with_the_schedule(tmp_path):
    pl_path = write_preset(tmp_path, tensorboard=True)
    rows = read_metrics(run(pl_path, tmp_path / "run", 5))
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    pl = plan(pl_path, 5)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["lr"] for r in rows] == [pl.schedule.lr_at(s) for s in range(5)]
    assert [r["batch_size"] for r in rows] == [4, 4, 4, 8, 8]                 # doubling after 384 tokens = 3 steps
    assert [r["tokens"] for r in rows] == [128, 256, 384, 640, 896]
    for r in rows:
        assert 0 < r["goldfish_dropped"] < r["masked_share"] < 1 and r["grad_norm"] > 0 and r["mfu"] > 0


def test_hybrid_logs_expert_load(tmp_path):
    rows = read_metrics(run(write_preset(tmp_path, arch="hybrid"), tmp_path / "run", 3))
    assert all(r["moe_max_load"] >= 1.0 for r in rows)      # max/mean load: 1 only when perfectly balanced


def poison(monkeypatch, at_call: int, where: str):
    "Make the model's `at_call`-th forward return NaN logits, or its gradients NaN."
    build = registry.build_model
    def build_poisoned(*args, **kwargs):
        model, calls = build(*args, **kwargs), {"n": 0}
        def hook(module, inputs, output):
            calls["n"] += 1
            if calls["n"] != at_call:
                return output
            if where == "loss":
                return output * float("nan")
            output.register_hook(lambda g: g * float("nan"))
            return output
        model.register_forward_hook(hook)
        return model
    monkeypatch.setattr(registry, "build_model", build_poisoned)


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_nan_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, where):
    preset = write_preset(tmp_path, checkpoint_every=2)
    poison(monkeypatch, at_call=5, where=where)             # 2 micro-batches per step: the 5th forward is step 3's
    with pytest.raises(NonFiniteError, match=rf"step 3: loss {'nan' if where == 'loss' else '[0-9.]+'}, "
                                             rf"gradient norm nan.*step-00000002"):
        run(preset, tmp_path / "run", 6)
    good = latest_valid_checkpoint(tmp_path / "run" / "checkpoints")
    assert good.name == "step-00000002"
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]


def no_compute(monkeypatch):
    monkeypatch.setattr(registry, "build_model", lambda *a, **k: pytest.fail("a model was built for a bad preset"))


def test_unknown_train_key_fails_before_compute_naming_it(tmp_path, monkeypatch):
    no_compute(monkeypatch)
    with pytest.raises(ConfigError, match="unknown key 'micro_batchs'.*did you mean 'micro_batch'"):
        run(write_preset(tmp_path, micro_batchs=2), tmp_path / "run", 2)


def test_vocab_mismatch_between_tokenizer_and_model_fails_before_compute(tmp_path, monkeypatch):
    no_compute(monkeypatch)
    path = write_preset(tmp_path)
    preset = yaml.safe_load(path.read_text())
    preset["model"]["vocab_size"] = 4096
    path.write_text(yaml.safe_dump(preset))
    with pytest.raises(ConfigError, match="vocab_size 8,192 but model.vocab_size is 4,096"):
        run(path, tmp_path / "run", 2)


def test_budget_smaller_than_one_batch_fails_before_compute(tmp_path, monkeypatch):
    no_compute(monkeypatch)
    curriculum = yaml.safe_load((Path(__file__).parents[1] / "configs" / "curricula" / "tiny.yaml").read_text())
    curriculum["name"] = "small"
    curriculum["stages"] = curriculum["stages"][:1]
    curriculum["stages"][0]["end"] = 64                       # 2 rows of 32 tokens; a batch is 4 rows
    (tmp_path / "small.yaml").write_text(yaml.safe_dump(curriculum))
    path = write_preset(tmp_path)
    preset = yaml.safe_load(path.read_text())
    preset["data"]["curriculum"] = str(tmp_path / "small.yaml")
    path.write_text(yaml.safe_dump(preset))
    with pytest.raises(ConfigError, match="curriculum 'small' has 64 tokens, fewer than one batch"):
        run(path, tmp_path / "run", 2)


def test_unknown_checkpoint_format_fails_before_compute_naming_the_choices(tmp_path, monkeypatch):
    no_compute(monkeypatch)
    with pytest.raises(ConfigError, match=r"train.checkpoint_format: 'dcp' is not auto \| full \| sharded"):
        run(write_preset(tmp_path, checkpoint_format="dcp"), tmp_path / "run", 2)


def test_cli_reports_a_bad_preset_in_one_line_and_exits_2(tmp_path, capsys):
    assert main(["--preset", str(write_preset(tmp_path, parallel="zero3")), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "train.parallel: 'zero3' is not ddp | fsdp2" in err


def test_checkpoint_exports_to_transformers_with_equal_logits(tmp_path):
    from transformers import AutoModelForCausalLM
    preset = write_preset(tmp_path)
    run(preset, tmp_path / "run", 2)
    ckpt = latest_valid_checkpoint(tmp_path / "run" / "checkpoints")
    config = model_config(load_preset(preset))
    ours = load_model(ckpt, config).eval()
    hf = AutoModelForCausalLM.from_pretrained(export_hf(ckpt, tmp_path / "hf")).eval()
    ids = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-4, atol=1e-5)


UNTUNED = """
import contextlib, json, sys
sys.path.insert(0, {tests!r})
from test_trainer import SyntheticLoader
from openpretrain.training import trainer
trainer.keep_freed_memory = lambda: False      # glibc's default: big blocks mmap-ed on alloc, unmapped on free
trainer.flushing_denormals = contextlib.nullcontext   # the CPU's default: denormal floats computed, slowly
a = json.loads(sys.argv[1])
trainer.train_preset(a["preset"], a["out"], a["max_steps"], loader_factory=SyntheticLoader)
"""


@pytest.mark.parametrize("arch", ["dense", "hybrid"])
def test_cpu_process_settings_change_no_metric(tmp_path, arch):
    preset, script = write_preset(tmp_path, arch=arch), tmp_path / "untuned.py"
    script.write_text(UNTUNED.format(tests=str(TESTS)))
    args = json.dumps({"preset": str(preset), "out": str(tmp_path / "untuned"), "max_steps": 4})
    subprocess.run([sys.executable, str(script), args], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                   check=True, stderr=subprocess.DEVNULL)
    timings = {"tokens_per_s", "mfu"}
    rows = lambda path: [{k: v for k, v in r.items() if k not in timings} for r in read_metrics(path)]
    assert rows(run(preset, tmp_path / "tuned", 4)) == rows(tmp_path / "untuned" / "metrics.jsonl")


def test_flushing_denormals_reaches_every_worker_thread_and_ends_with_the_block():
    assert not denormals_flushed()   # IEEE subnormals, the default (hypothesis's float strategies need them)
    with flushing_denormals():
        x = torch.full((1 << 22,), 1e-39) * 0.5   # split over the intra-op threads; each must flush its products
        assert denormals_flushed() and not (x.view(torch.int32) & 0x7FFFFFFF).any()
    assert not denormals_flushed() and (torch.full((1 << 22,), 1e-39) * 0.5).view(torch.int32).all()


class ModeRecordingLoader(SyntheticLoader):
    "SyntheticLoader that notes, at every batch, whether the run's thread flushes denormals."
    seen: list[bool] = []

    def next_batch(self):
        self.seen.append(denormals_flushed())
        return super().next_batch()


def test_a_cpu_run_flushes_denormals_while_it_lasts_and_leaves_them_as_it_found_them(tmp_path):
    ModeRecordingLoader.seen = []
    train_preset(write_preset(tmp_path), tmp_path / "run", 2, loader_factory=ModeRecordingLoader)
    assert ModeRecordingLoader.seen and all(ModeRecordingLoader.seen)
    assert not denormals_flushed()


@pytest.mark.parametrize("arch", ["dense", "hybrid"])
def test_activation_checkpointing_changes_no_metric_and_no_checkpoint_name(tmp_path, arch):
    timings = {"tokens_per_s", "mfu"}
    rows = lambda path: [{k: v for k, v in r.items() if k not in timings} for r in read_metrics(path)]
    plain = run(write_preset(tmp_path, arch=arch), tmp_path / "plain", 4)
    recomputed = run(write_preset(tmp_path, "r", arch=arch, activation_checkpointing=True), tmp_path / "recomputed", 4)
    assert rows(recomputed) == rows(plain)
    names = lambda out: load_file(latest_valid_checkpoint(out / "checkpoints") / "model.safetensors").keys()
    assert names(tmp_path / "recomputed") == names(tmp_path / "plain")


def test_resume_keeps_metric_rows_through_its_step_and_drops_a_cut_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"st')
    assert trainer.kept_rows(path, 2) == ['{"step": 1}\n', '{"step": 2}\n']
    assert trainer.kept_rows(path, 9) == ['{"step": 1}\n', '{"step": 2}\n', '{"step": 3}\n']
    assert trainer.kept_rows(tmp_path / "missing.jsonl", 9) == []


def test_a_run_under_another_objective_resumes_bit_for_bit(tmp_path):
    preset = write_preset(tmp_path, checkpoint_every=2)
    reference = losses(run(preset, tmp_path / "reference", 6, objective=ZLoss(coef=1e-2)))
    assert reference != losses(run(preset, tmp_path / "cross-entropy", 6))        # the objective is what was minimised
    run(preset, tmp_path / "resumed", 4, objective=ZLoss(coef=1e-2))
    assert losses(run(preset, tmp_path / "resumed", 6, resume=True, objective=ZLoss(coef=1e-2))) == reference


@dataclass(kw_only=True)
class ToyConfig:
    "A third family, registered by the test: a bigram model (embedding → head)."
    arch: str = "toy"
    vocab_size: int = 8192
    d_model: int = 16


class ToyLM(torch.nn.Module):
    def __init__(self, config: ToyConfig):
        super().__init__()
        self.config, self.layers = config, torch.nn.ModuleList()
        self.embed = torch.nn.Embedding(config.vocab_size, config.d_model)
        self.head = torch.nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, input_ids, doc_ids=None):
        return self.head(self.embed(input_ids))                                  # (B, L, V)


def build(config, device="cpu", dtype=torch.float32, compile=False):
    return ToyLM(config).to(device, dtype)

def train_flops_per_token(config, seq_len):
    return 6.0 * config.d_model * config.vocab_size

def context_limit(config):
    return None

def aux_loss(model):
    return 0.0

def after_step(model):
    return {"toy_head_norm": float(model.head.weight.detach().norm())}


@pytest.fixture
def toy_family():
    registry.register("toy", __name__, "ToyConfig")
    yield
    del registry.ARCHS["toy"]


def test_a_family_registered_from_outside_trains_without_touching_the_trainer(tmp_path, toy_family):
    path = write_preset(tmp_path)
    preset = yaml.safe_load(path.read_text())
    preset["model"] = {"arch": "toy", "vocab_size": 8192, "d_model": 16}
    path.write_text(yaml.safe_dump(preset))
    (row,) = read_metrics(run(path, tmp_path / "run", 1))
    assert row["toy_head_norm"] > 0 and abs(row["loss"] - math.log(8192)) < 0.5   # its hook's metric; untrained ≈ ln V
    assert isinstance(load_model(tmp_path / "run" / "checkpoints" / "step-00000001", model_config(load_preset(path))), ToyLM)


# --- checkpoints and run folders under hostile input (issue 17, causes 1, 4, 5, 6, 7, 10) --------------------

def reseal(folder: Path) -> None:
    "Record the folder's files in its manifest anew: a damage that hashes cannot show."
    from openpretrain.core import sha256_file
    (folder / "manifest.json").write_text(json.dumps({p.relative_to(folder).as_posix(): sha256_file(p)
                                                      for p in sorted(folder.rglob("*"))
                                                      if p.is_file() and p.name != "manifest.json"}))


class Marker:
    "A pickle that, when loaded, creates a file: what a crafted dcp/.metadata would do instead."
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("sealed", [False, True])
def test_a_crafted_dcp_metadata_never_runs_code_on_eval_or_resume(tmp_path, sealed, capsys):
    import pickle
    preset = write_preset(tmp_path, checkpoint_every=2)
    run(preset, tmp_path / "run", 2)
    ckpt, marker = tmp_path / "run" / "checkpoints" / "step-00000002", tmp_path / "pwned"
    (ckpt / "dcp").mkdir()
    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(Marker(marker)))
    if sealed:                                    # even a checkpoint sealed over it, and recorded as sharded
        state = json.loads((ckpt / "state.json").read_text())
        (ckpt / "state.json").write_text(json.dumps({**state, "format": "sharded"}))
        reseal(ckpt)
    with pytest.raises(CheckpointError):
        load_model(ckpt, model_config(load_preset(preset)))
    with pytest.raises(CheckpointError, match="refusing to start over"):
        run(preset, tmp_path / "run", 4, resume=True)
    assert not marker.exists()


def test_a_second_run_on_a_locked_run_folder_fails_at_once_naming_the_holder(tmp_path):
    from openpretrain.core import FolderInUse, folder_lock
    preset = write_preset(tmp_path)
    with folder_lock(tmp_path / "run", "training run"):
        with pytest.raises(FolderInUse, match=r"in use by another training run \(pid"):
            run(preset, tmp_path / "run", 2)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_fresh_run_into_a_folder_holding_a_run_is_refused_and_loses_nothing(tmp_path):
    preset = write_preset(tmp_path, checkpoint_every=2)
    first = losses(run(preset, tmp_path / "run", 3))
    with pytest.raises(ConfigError, match="already holds a run"):
        run(preset, tmp_path / "run", 6)
    assert losses(tmp_path / "run" / "metrics.jsonl") == first


def test_resume_when_no_checkpoint_verifies_is_refused_not_a_silent_restart(tmp_path):
    preset = write_preset(tmp_path, checkpoint_every=2)
    first = losses(run(preset, tmp_path / "run", 4))
    for ckpt in checkpoints(tmp_path / "run" / "checkpoints"):
        (ckpt / "model.safetensors").write_bytes(b"damaged")
    with pytest.raises(CheckpointError, match="none of the 2 checkpoints"):
        run(preset, tmp_path / "run", 4, resume=True)
    assert losses(tmp_path / "run" / "metrics.jsonl") == first


def test_prune_leaves_a_live_writers_temporary_folder_and_removes_a_dead_ones(tmp_path):
    preset = write_preset(tmp_path, checkpoint_every=1, keep_last=1)
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    live, gone = root / f".tmp-step-00000009-{os.getppid()}", root / f".tmp-step-00000009-{dead.stdout.strip()}"
    live.mkdir(), gone.mkdir()
    run(preset, tmp_path / "run", 2)
    assert live.is_dir() and not gone.exists()


def test_a_checkpoint_of_another_model_or_seed_is_refused_and_this_runs_previous_one_used(tmp_path, capsys):
    preset = write_preset(tmp_path, checkpoint_every=2)
    reference = losses(run(preset, tmp_path / "reference", 6))
    run(preset, tmp_path / "run", 4)
    wide = write_preset(tmp_path, name="wide")
    wide_raw = yaml.safe_load(wide.read_text())
    wide_raw["model"]["d_model"], wide_raw["seed"] = 64, 1
    wide.write_text(yaml.safe_dump(wide_raw))
    run(wide, tmp_path / "other", 6)
    shutil.copytree(tmp_path / "other" / "checkpoints" / "step-00000006", tmp_path / "run" / "checkpoints" / "step-00000006")
    assert losses(run(preset, tmp_path / "run", 6, resume=True)) == reference         # step 6 refused, 4 used
    assert "written by another run" in capsys.readouterr().err


@pytest.mark.parametrize("damage,problem", [
    ("half", "model is torch.float32"),
    ("int8", "model is torch.float32"),
    ("optimizer shape", "does not fit parameter"),
    ("crafted header", "unreadable safetensors header"),
])
def test_a_resealed_checkpoint_that_does_not_fit_the_model_is_refused_not_cast(tmp_path, damage, problem):
    from safetensors.torch import load_file, save_file
    preset = write_preset(tmp_path, checkpoint_every=2)
    run(preset, tmp_path / "run", 2)
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000002"
    weights, optim = load_file(str(ckpt / "model.safetensors")), load_file(str(ckpt / "optimizer.safetensors"))
    if damage in ("half", "int8"):
        save_file({k: v.half() if damage == "half" else v.to(torch.int8) for k, v in weights.items()},
                  str(ckpt / "model.safetensors"))
    elif damage == "optimizer shape":
        save_file({k: v[:1] if v.ndim else v for k, v in optim.items()}, str(ckpt / "optimizer.safetensors"))
    else:
        (ckpt / "model.safetensors").write_bytes((10**9).to_bytes(8, "little") + b'{"w": ')
    reseal(ckpt)
    with pytest.raises(CheckpointError, match=problem.replace("model is", "the model's is") if "model is" in problem else problem):
        load_model(ckpt, model_config(load_preset(preset))) if damage != "optimizer shape" else \
            verify_checkpoint(ckpt, model=trainer.registry.build_model(model_config(load_preset(preset))))


def test_an_overflowing_step_is_never_sealed_as_the_last_good_checkpoint(tmp_path):
    preset = write_preset(tmp_path, checkpoint_every=1)
    raw = yaml.safe_load(preset.read_text())
    raw["optim"].update(lr=1e40, clip=0.0, weight_decay=0.0)     # finite knobs whose first step overflows fp32
    preset.write_text(yaml.safe_dump(raw))
    with pytest.raises(NonFiniteError, match="weights are not finite after the optimizer step.*last verified checkpoint: none"):
        run(preset, tmp_path / "run", 3)
    assert checkpoints(tmp_path / "run" / "checkpoints") == []


def test_stray_names_in_the_checkpoint_folder_are_ignored_by_resume_and_prune(tmp_path):
    preset = write_preset(tmp_path, checkpoint_every=2, keep_last=1)
    reference = losses(run(preset, tmp_path / "reference", 6))
    run(preset, tmp_path / "run", 4)
    root = tmp_path / "run" / "checkpoints"
    (root / "step-00000006.bak").mkdir()
    (root / "notes.txt").write_text("kept by a person")
    assert losses(run(preset, tmp_path / "run", 6, resume=True)) == reference
    assert (root / "step-00000006.bak").is_dir() and (root / "notes.txt").is_file()


@pytest.mark.parametrize("out", ["file", "under-file", "/proc/openpretrain-run", "long"])
def test_a_bad_out_path_is_one_line_and_exit_2(tmp_path, capsys, out):
    (tmp_path / "f").write_text("a file")
    path = {"file": tmp_path / "f", "under-file": tmp_path / "f" / "run", "/proc/openpretrain-run": Path(out),
            "long": tmp_path / ("x" * 300)}[out]
    assert main(["--preset", str(write_preset(tmp_path)), "--out", str(path), "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("openpretrain train: --out")


def test_bf16_falls_back_to_fp32_on_a_cpu_without_bf16_arithmetic(monkeypatch, caplog):
    from openpretrain.training import parallel
    monkeypatch.setattr(parallel, "cpu_multiplies_bf16", lambda: False)
    assert parallel.training_precision("bf16", cuda=False) == "fp32"
    assert parallel.training_precision("bf16", cuda=True) == "bf16"
    assert parallel.training_precision("fp32", cuda=True) == "fp32"
    monkeypatch.setattr(parallel, "cpu_multiplies_bf16", lambda: True)
    assert parallel.training_precision("bf16", cuda=False) == "bf16"


def test_an_aten_or_onednn_pin_below_bf16_trains_fp32(monkeypatch):
    from openpretrain.training import parallel
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)     # as on this project's CPU
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert parallel.cpu_multiplies_bf16()
    for isa in ("AVX2", "avx512_core"):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
        assert not parallel.cpu_multiplies_bf16()                                 # portable numerics: fp32
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert parallel.cpu_multiplies_bf16()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")  # ATEN_CPU_CAPABILITY=avx2
    assert not parallel.cpu_multiplies_bf16()                                     # its bf16 packing needs AVX-512


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_run_records_its_precision_and_scores_mfu_against_that_precisions_peak(tmp_path, monkeypatch, precision):
    from openpretrain.training import parallel
    monkeypatch.setattr(parallel, "cpu_multiplies_bf16", lambda: True)   # what this run may use, on any CPU
    peaks = []
    monkeypatch.setattr(trainer, "measure_peak_flops", lambda device, dtype: peaks.append(dtype) or 1e9)
    metrics = read_metrics(train_preset(str(write_preset(tmp_path, precision=precision)), tmp_path / "run", 2,
                                        loader_factory=SyntheticLoader))
    assert json.loads((tmp_path / "run" / "run.json").read_text())["precision"] == precision
    assert peaks == [torch.bfloat16 if precision == "bf16" else torch.float32]
    assert all(math.isfinite(m["loss"]) and m["mfu"] > 0 for m in metrics)


def test_bf16_autocast_trains_the_same_curve_as_fp32_within_a_hundredth(tmp_path, monkeypatch):
    from openpretrain.training import parallel
    monkeypatch.setattr(parallel, "cpu_multiplies_bf16", lambda: True)   # emulated where the CPU lacks it: slow, same values
    curves = {q: [m["loss"] for m in read_metrics(train_preset(str(write_preset(tmp_path, q, precision=q)),
                                                               tmp_path / q, 6, loader_factory=SyntheticLoader))]
              for q in ("fp32", "bf16")}
    assert curves["fp32"] != curves["bf16"]                              # bf16 did run
    assert max(abs(a - b) for a, b in zip(*curves.values())) < 1e-2


def test_a_run_resumed_with_another_start_checkpoint_is_refused_in_one_line(tmp_path):
    preset = write_preset(tmp_path)
    run(preset, tmp_path / "a", 2)
    run(preset, tmp_path / "b", 4)
    start_a = latest_valid_checkpoint(tmp_path / "a" / "checkpoints")
    start_b = next(c for c in checkpoints(tmp_path / "b" / "checkpoints") if c.name.endswith("2"))
    run(preset, tmp_path / "stage", 2, init=start_a)                              # started from a, stopped at step 2
    assert json.loads((tmp_path / "stage" / "init.json").read_text())["init"] == str(start_a.resolve())
    with pytest.raises(CheckpointError, match="started from .*a/checkpoints.*, not from .*b/checkpoints"):
        run(preset, tmp_path / "stage", 4, resume=True, init=start_b)
    run(preset, tmp_path / "stage", 4, resume=True, init=start_a)                 # its own start resumes
    with pytest.raises(CheckpointError, match="started from random weights"):
        run(preset, tmp_path / "a", 4, resume=True, init=start_a)


def test_a_resealed_nan_checkpoint_is_never_the_last_verified_one_and_resume_falls_back(tmp_path, capsys):
    from safetensors.torch import save_file
    preset = write_preset(tmp_path, checkpoint_every=2, keep_last=3)
    reference = losses(run(preset, tmp_path / "run", 6))
    root = tmp_path / "run" / "checkpoints"
    newest = root / "step-00000006"
    weights = load_file(str(newest / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, str(newest / "model.safetensors"))
    reseal(newest)
    assert verify_checkpoint(newest)["step"] == 6                                  # its hashes match
    assert latest_valid_checkpoint(root).name == "step-00000004"                   # what a run names "last verified"
    assert f"weight {name} holds NaN" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match=f"weight {name} holds NaN"):
        load_model(newest, model_config(load_preset(preset)))
    assert losses(run(preset, tmp_path / "run", 6, resume=True)) == reference      # resumed from step 4


@pytest.mark.parametrize("fmt", ["full", "sharded"])
@pytest.mark.parametrize("where", ["weight", "optimizer"])
def test_load_and_restore_refuse_a_non_finite_tensor_naming_it(tmp_path, fmt, where):
    from openpretrain.core import to_dict
    from openpretrain.training.checkpoint import restore_state, save_checkpoint
    config = model_config(load_preset(write_preset(tmp_path)))
    model = registry.build_model(config, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 100, (1, 8))).float().square().mean().backward()
    optimizer.step()
    with torch.no_grad():
        bad = model.embed_tokens.weight if where == "weight" else optimizer.state[model.embed_tokens.weight]["exp_avg"]
        bad[0, 0] = float("inf")
    loader = SimpleNamespace(state_dict=lambda: {"calls": 0}, load_state_dict=lambda d: None)
    ckpt = save_checkpoint(tmp_path / "ckpts", model, optimizer, loader, 1, fmt, {"model": to_dict(config)})
    named = "weight embed_tokens.weight" if where == "weight" else "optimizer tensor embed_tokens.weight::exp_avg"
    fresh = registry.build_model(config, device="cpu")
    with pytest.raises(CheckpointError, match=f"{named} holds NaN or infinite values"):
        restore_state(ckpt, fresh, torch.optim.AdamW(fresh.parameters()), loader)
    if where == "weight":
        with pytest.raises(CheckpointError, match=f"{named} holds NaN or infinite values"):
            load_model(ckpt, config)
    else:
        load_model(ckpt, config)                                                   # its weights are finite
