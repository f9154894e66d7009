"""Several processes train like one: DDP and FSDP2 under torchrun on CPU (gloo), two 'nodes' meeting by c10d, and
FSDP2's sharded checkpoints (resume, corruption, consolidation into one process)."""
import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from openpretrain.core import load_preset
from openpretrain.models.registry import model_config
from openpretrain.training.checkpoint import CheckpointError, load_model, verify_checkpoint
from openpretrain.training.trainer import read_metrics
from test_trainer import TESTS, losses, run, worker_script, write_preset


def trajectory(metrics) -> tuple[list[float], list[float]]:
    "Losses and pre-clip gradient norms (the norm exposes a gradient scaled by the world size; Adam would hide it)."
    rows = read_metrics(metrics)
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]


def assert_same_trajectory(metrics, reference) -> None:
    "Same losses to fp32 summation order; norms of sharded gradients are summed in another order (rel 1e-4)."
    loss, norm = trajectory(metrics)
    assert loss == pytest.approx(reference[0], rel=1e-6, abs=0)
    assert norm == pytest.approx(reference[1], rel=1e-4, abs=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*launch: str, script, args: dict) -> subprocess.Popen:
    "Start `torchrun <launch> <script> <args as JSON>`; `finish` waits for it."
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, str(script), json.dumps(args)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs, timeout: int = 240) -> list[str]:
    "Wait for every launch; each must succeed. Their outputs (stdout and stderr)."
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, out[-3000:]
        outs.append(out)
    return outs


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_two_processes_reproduce_one_process_losses(tmp_path, parallel):
    preset = write_preset(tmp_path, parallel=parallel)      # global batch 4 → 8: 2 ranks × 1–2 micro-batches of 2
    reference = trajectory(run(preset, tmp_path / "one", 5))
    args = {"preset": str(preset), "out": str(tmp_path / "two"), "max_steps": 5}
    finish([torchrun("--nproc_per_node", "2", "--master_port", str(free_port()),
                     script=worker_script(tmp_path), args=args)])
    assert_same_trajectory(tmp_path / "two" / "metrics.jsonl", reference)


@pytest.mark.slow
def test_two_nodes_with_c10d_rendezvous_reproduce_one_process(tmp_path):
    preset = write_preset(tmp_path, parallel="fsdp2")
    reference = trajectory(run(preset, tmp_path / "one", 4))
    endpoint, script = f"127.0.0.1:{free_port()}", worker_script(tmp_path)
    args = {"preset": str(preset), "out": str(tmp_path / "two"), "max_steps": 4}
    finish([torchrun("--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "1", "--rdzv_backend", "c10d",
                     "--rdzv_endpoint", endpoint, "--rdzv_id", "openpretrain-test", script=script, args=args)
            for rank in (0, 1)])
    assert_same_trajectory(tmp_path / "two" / "metrics.jsonl", reference)


RESTORE_AND_PROBE = """
import json, sys
sys.path.insert(0, {tests!r})
import torch
from accelerate import Accelerator
from safetensors.torch import save_file
from test_trainer import SyntheticLoader
from pathlib import Path
from openpretrain.models.registry import build_model
from openpretrain.training.checkpoint import checkpoints, restore_state
from openpretrain.training.optim import build_optimizer
from openpretrain.training.plan import plan
from openpretrain.training.parallel import parallelize
from openpretrain.training.trainer import train_preset
a = json.loads(sys.argv[1])
train_preset(a["preset"], a["out"], a["max_steps"], resume=True, loader_factory=SyntheticLoader)
acc = Accelerator(cpu=True)                  # the process group train() started
pl = plan(a["preset"], a["max_steps"], acc.num_processes)
model = parallelize(build_model(pl.model, device="cpu"), pl.train, acc)   # a fresh FSDP2 model
ckpt = checkpoints(Path(a["out"]) / "checkpoints")[-1]
restore_state(ckpt, model, build_optimizer(model, pl.optim), SyntheticLoader(pl, None, acc.process_index, 2))
with torch.no_grad():
    logits = model(torch.tensor(a["probe"]))
if acc.is_main_process:
    save_file({{"logits": logits}}, a["logits"])
"""
PROBE = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    "2-process FSDP2, sharded checkpoints every 2 steps: 6 steps; truncate a step-6 shard; resume to 6 and probe logits."
    tmp = tmp_path_factory.mktemp("sharded")
    preset, out = write_preset(tmp, parallel="fsdp2", checkpoint_format="sharded"), tmp / "run"
    args = {"preset": str(preset), "out": str(out), "max_steps": 6}
    finish([torchrun("--nproc_per_node", "2", "--master_port", str(free_port()), script=worker_script(tmp), args=args)])
    reference, newest = losses(out / "metrics.jsonl"), out / "checkpoints" / "step-00000006"
    layout = sorted(json.loads((newest / "manifest.json").read_text()))
    shard = newest / "dcp" / "__1_0.distcp"                       # rank 1's shard
    shard.write_bytes(shard.read_bytes()[:100])                 # truncated
    with pytest.raises(CheckpointError) as refusal:
        verify_checkpoint(newest)
    script = tmp / "probe.py"
    script.write_text(RESTORE_AND_PROBE.format(tests=str(TESTS)))
    (resumed_out,) = finish([torchrun("--nproc_per_node", "2", "--master_port", str(free_port()), script=script,
                                      args={**args, "probe": PROBE, "logits": str(tmp / "logits.safetensors")})])
    return SimpleNamespace(preset=preset, out=out, reference=reference, layout=layout, refusal=str(refusal.value),
                           resumed_out=resumed_out, logits=load_file(str(tmp / "logits.safetensors"))["logits"])


def test_fsdp2_sharded_checkpoint_has_every_rank_shard_in_its_manifest_and_no_gathered_weights(sharded_run):
    assert sharded_run.layout == ["dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "rng.safetensors",
                                  "state.json"]


def test_truncated_shard_is_refused_and_the_previous_checkpoint_used(sharded_run):
    assert "dcp/__1_0.distcp does not match its sha256" in sharded_run.refusal
    assert "refusing checkpoint" in sharded_run.resumed_out and "step-00000006" in sharded_run.resumed_out
    assert [r["step"] for r in read_metrics(sharded_run.out / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_resume_from_sharded_checkpoint_reproduces_fsdp2_losses_bit_for_bit(sharded_run):
    assert losses(sharded_run.out / "metrics.jsonl") == sharded_run.reference    # steps 5–6 rerun from step 4


def test_sharded_checkpoint_consolidates_into_one_process_with_the_fsdp2_logits(sharded_run):
    ckpt = sharded_run.out / "checkpoints" / "step-00000006"     # rewritten by the resumed run
    model = load_model(ckpt, model_config(load_preset(sharded_run.preset))).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(torch.tensor(PROBE)), sharded_run.logits, rtol=1e-6, atol=1e-6)
