"""Several processes train like one: DDP and FSDP2 under torchrun on CPU (gloo), and two 'nodes' meeting by c10d."""
import json
import os
import socket
import subprocess
import sys

import pytest
from test_trainer import losses, run, worker_script, write_preset


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*launch: str, script, args: dict) -> subprocess.Popen:
    "Start `torchrun <launch> <script> <args as JSON>`; `finish` waits for it."
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, str(script), json.dumps(args)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs, timeout: int = 240) -> None:
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, out[-3000:]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_two_processes_reproduce_one_process_losses(tmp_path, parallel):
    preset = write_preset(tmp_path, parallel=parallel)      # global batch 4 → 8: 2 ranks × 1–2 micro-batches of 2
    reference = losses(run(preset, tmp_path / "one", 5))
    args = {"preset": str(preset), "out": str(tmp_path / "two"), "max_steps": 5}
    finish([torchrun("--nproc_per_node", "2", "--master_port", str(free_port()),
                     script=worker_script(tmp_path), args=args)])
    assert losses(tmp_path / "two" / "metrics.jsonl") == pytest.approx(reference, rel=1e-6, abs=0)


@pytest.mark.slow
def test_two_nodes_with_c10d_rendezvous_reproduce_one_process(tmp_path):
    preset = write_preset(tmp_path, parallel="fsdp2")
    reference = losses(run(preset, tmp_path / "one", 4))
    endpoint, script = f"127.0.0.1:{free_port()}", worker_script(tmp_path)
    args = {"preset": str(preset), "out": str(tmp_path / "two"), "max_steps": 4}
    finish([torchrun("--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "1", "--rdzv_backend", "c10d",
                     "--rdzv_endpoint", endpoint, "--rdzv_id", "openpretrain-test", script=script, args=args)
            for rank in (0, 1)])
    assert losses(tmp_path / "two" / "metrics.jsonl") == pytest.approx(reference, rel=1e-6, abs=0)
