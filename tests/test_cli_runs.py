"""The training commands from the shell (`train`, `sft`, `align`): they print the run folder, each checkpoint as it is
sealed and the final one; SIGINT or SIGTERM checkpoints after the current step, exits 130 or 143 with one line, and
`--resume` then continues bit for bit; `--set section.key=value` edits the preset as its YAML would, a bad one
refused in one line (exit 2). Every run is the tiny preset shrunk by `--set` to a 2-layer, width-32 model on CPU."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from openpretrain import __main__ as cli
from openpretrain.core import load_preset
from openpretrain.posttrain import preference, sft
from openpretrain.training import trainer
from openpretrain.training.checkpoint import checkpoints, verify_checkpoint
from openpretrain.training.plan import plan
from openpretrain.training.trainer import read_metrics

SMALL = [f"--set={s}" for s in ("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
                                "model.mlp_hidden=64", "train.precision=fp32", "train.tensorboard=false",
                                "train.checkpoint_every=100", "sft.batch_size=8")]
ALIGN = [f"--set={s}" for s in ("alignment.prompts=16", "alignment.pairs.n_refs=4", "alignment.max_new_tokens=48",
                                "alignment.batch_size=2", "alignment.epochs=1", "alignment.curve_points=1")]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
INTERRUPTED = re.compile(r"openpretrain (\w+): interrupted by (SIG\w+) at step (\d+): checkpoint written to (\S+); "
                         r"resume with --resume")


def command(name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "openpretrain", name, *args]


def printed(out: str) -> list[str]:
    "The lines a command printed on stdout about where its run writes."
    return [line for line in out.splitlines() if line.startswith(("run: ", "checkpoint: ", "final checkpoint: "))]


def interrupt(name: str, args: list[str], metrics: Path, after: int, signum: int) -> tuple[subprocess.CompletedProcess, int, Path]:
    "Run `openpretrain name args` until `metrics` holds `after` rows, send `signum`, and return the result, step and checkpoint."
    proc = subprocess.Popen(command(name, *args), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= after):
        assert proc.poll() is None and time.monotonic() < deadline, f"the run ended before step {after}: {proc.stderr.read()}"
        time.sleep(0.01)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=300)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert proc.returncode == 128 + signum, (proc.returncode, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    match = INTERRUPTED.fullmatch(err.strip().splitlines()[-1])
    assert match and match[1] == name and match[2] == signal.Signals(signum).name, err.strip().splitlines()[-1]
    step, path = int(match[3]), Path(match[4])
    assert verify_checkpoint(path)["step"] == step, "the checkpoint it names is sealed, of the step it names"
    assert printed(out)[-1] == f"checkpoint: {path}", "the interrupt's checkpoint is printed as written"
    return result, step, path


def curve(metrics: Path) -> list[tuple]:
    return [(r["step"], r["lr"], r["loss"], r["grad_norm"]) for r in read_metrics(metrics)]


def same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    "A one-step pretraining run of the shrunk tiny preset: the base checkpoint sft starts from."
    out = tmp_path_factory.mktemp("base")
    assert trainer.main(["--max-steps", "1", "--out", str(out), *SMALL]) == 0
    return checkpoints(out / "checkpoints")[-1]


@pytest.fixture(scope="module")
def pretrained_8(tmp_path_factory):
    "An uninterrupted eight-step pretraining run: the reference of the train signal tests."
    out = tmp_path_factory.mktemp("reference")
    assert trainer.main(["--max-steps", "8", "--out", str(out), *SMALL]) == 0
    return out


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory, pretrained):
    "sft's --out folder after 8 uninterrupted steps: the reference of the sft signal test and the start of align."
    out = tmp_path_factory.mktemp("sft")
    assert sft.main(["--from", str(pretrained), "--out", str(out), "--max-steps", "8", *SMALL]) == 0
    return out


def test_train_prints_its_run_folder_each_checkpoint_and_the_final_one(tmp_path, capsys):
    out = tmp_path / "run"
    assert trainer.main(["--max-steps", "4", "--out", str(out), *SMALL, "--set", "train.checkpoint_every=2"]) == 0
    assert printed(capsys.readouterr().out) == [f"run: {out}", f"checkpoint: {out}/checkpoints/step-00000002",
                                                f"checkpoint: {out}/checkpoints/step-00000004",
                                                f"final checkpoint: {out}/checkpoints/step-00000004"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_train_checkpoints_after_the_step_and_resume_is_bit_for_bit(tmp_path, pretrained_8, signum):
    flags = ["--max-steps", "8", *SMALL]
    out = tmp_path / "interrupted"
    _, step, _ = interrupt("train", [*flags, "--out", str(out)], out / "metrics.jsonl", 2, signum)
    assert 2 <= step < 8, f"stopped at step {step}: the test needs a step left to resume"
    assert len(read_metrics(out / "metrics.jsonl")) == step, "the step in flight finished and was logged, no other"
    r = subprocess.run(command("train", *flags, "--out", str(out), "--resume"), env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert printed(r.stdout)[-1] == f"final checkpoint: {out}/checkpoints/step-00000008"
    assert curve(out / "metrics.jsonl") == curve(pretrained_8 / "metrics.jsonl")
    assert same_weights(checkpoints(out / "checkpoints")[-1], checkpoints(pretrained_8 / "checkpoints")[-1])


def test_sft_stops_at_max_steps_and_a_sigterm_resumes_bit_for_bit(tmp_path, capsys, pretrained, finetuned):
    reference = finetuned / "run"
    assert len(read_metrics(reference / "metrics.jsonl")) == 8, "--max-steps 8: eight optimizer steps, not the epochs"
    flags = ["--from", str(pretrained), "--max-steps", "8", *SMALL]
    out = tmp_path / "sft"
    _, step, _ = interrupt("sft", [*flags, "--out", str(out)], out / "run" / "metrics.jsonl", 2, signal.SIGTERM)
    assert 2 <= step < 8, f"stopped at step {step}: the test needs a step left to resume"
    assert sft.main([*flags, "--out", str(out)]) == 2, "without --resume, a folder holding a run is refused"
    assert "pass --resume" in capsys.readouterr().err.strip().splitlines()[-1]
    r = subprocess.run(command("sft", *flags, "--out", str(out), "--resume"), env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert printed(r.stdout) == [f"run: {out / 'run'}", f"checkpoint: {out}/run/checkpoints/step-00000008",
                                 f"final checkpoint: {out}/run/checkpoints/step-00000008"]
    assert curve(out / "run" / "metrics.jsonl") == curve(reference / "metrics.jsonl")
    assert same_weights(checkpoints(out / "run" / "checkpoints")[-1], checkpoints(reference / "checkpoints")[-1])


def test_align_from_an_sft_folder_by_qrpo_and_dpo_and_a_sigint_resumes_bit_for_bit(tmp_path, finetuned, capsys):
    flags = ["--from", str(finetuned), "--max-steps", "5", *SMALL, *ALIGN]
    for method in ("qrpo", "dpo"):
        out = tmp_path / method
        assert preference.main([*flags, "--method", method, "--out", str(out)]) == 0
        lines = printed(capsys.readouterr().out)
        assert lines == [f"run: {out}", f"checkpoint: {out}/checkpoints/step-00000005",
                         f"final checkpoint: {out}/checkpoints/step-00000005"], lines
        assert verify_checkpoint(out / "checkpoints" / "step-00000005")["step"] == 5
        assert (out / "init.json").read_text().count(str(finetuned / "run" / "checkpoints" / "step-00000008")) == 1
    interrupted = tmp_path / "qrpo-interrupted"
    args = [*flags, "--method", "qrpo", "--out", str(interrupted)]
    _, step, _ = interrupt("align", args, interrupted / "metrics.jsonl", 1, signal.SIGINT)
    assert 1 <= step < 5, f"stopped at step {step}: the test needs a step left to resume"
    r = subprocess.run(command("align", *args, "--resume"), env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert curve(interrupted / "metrics.jsonl") == curve(tmp_path / "qrpo" / "metrics.jsonl")
    assert same_weights(interrupted / "checkpoints" / "step-00000005", tmp_path / "qrpo" / "checkpoints" / "step-00000005")
    assert not same_weights(tmp_path / "qrpo" / "checkpoints" / "step-00000005",
                            tmp_path / "dpo" / "checkpoints" / "step-00000005"), "--method picks the loss"


@pytest.mark.parametrize("setting, message", [
    ("train.micro_batchh=2", "--set train.micro_batchh (deriving tiny.yaml): tiny.train: unknown key 'micro_batchh' "
                             "(did you mean 'micro_batch'?)"),
    ("optim.lr=fast", "--set optim.lr (deriving tiny.yaml): tiny.optim.lr: expected float, got 'fast'"),
    ("optim.lr=1e-3", "tiny.optim.lr: expected float, got '1e-3' (YAML reads 1e-3 as text: write 0.001)"),
    ("train.keep_last=0", "--set train.keep_last (deriving tiny.yaml): "),
    ("optimizer.lr=0.1", "--set optimizer.lr: 'optimizer' is no section"),
    ("optim.lr", "--set optim.lr: expected section.key=value"),
])
def test_a_bad_set_is_one_line_naming_the_flag_and_exit_2(tmp_path, capsys, setting, message):
    assert trainer.main(["--max-steps", "1", "--out", str(tmp_path / "run"), "--set", setting]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("openpretrain train: ") and message in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_sft_and_align_refuse_a_bad_set_in_one_line(tmp_path, capsys, pretrained, finetuned):
    assert sft.main(["--from", str(pretrained), "--out", str(tmp_path / "sft"), "--set", "sft.lr=-1.0"]) == 2
    assert capsys.readouterr().err.strip() == ("openpretrain sft: --set sft.lr (deriving tiny.yaml): tiny.sft.lr: -1.0 is "
                                               "outside [0, inf]")
    assert preference.main(["--from", str(finetuned), "--out", str(tmp_path / "a"), *SMALL,
                            "--set", "alignment.qrpo.betaa=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("openpretrain align: --set alignment.qrpo.betaa (deriving tiny.yaml): "
                              "tiny.alignment.qrpo: unknown key 'betaa'"), err


def test_the_set_reaches_the_run(tmp_path):
    out = tmp_path / "run"
    assert trainer.main(["--max-steps", "2", "--out", str(out), *SMALL, "--set", "optim.lr=0.5", "--set", "seed=3"]) == 0
    state = verify_checkpoint(checkpoints(out / "checkpoints")[-1])
    assert state["fingerprint"]["seed"] == 3 and state["fingerprint"]["model"]["d_model"] == 32
    tiny = plan(load_preset("tiny")).schedule
    assert read_metrics(out / "metrics.jsonl")[0]["lr"] == pytest.approx(tiny.lr_at(0) * 0.5 / tiny.peak)


@pytest.mark.parametrize("flags, message", [
    (["--set", "optim.lr=0.01"], "--set changes the preset, so its report is not the committed outputs/"),
    (["--set", "optim.lr=0.01", "--check"], "--check reruns the committed report: it takes no --set"),
    (["--set", "optim.lr=0.01", "--pages"], "it takes no --check, --only or --set"),
    (["--set", "optimizer.lr=0.01", "--outputs", "OUT"], "--set optimizer.lr: 'optimizer' is no section"),
])
def test_report_takes_set_only_into_its_own_outputs_and_never_for_check(tmp_path, capsys, flags, message):
    flags = [str(tmp_path) if f == "OUT" else f for f in flags]
    if "--check" in flags:
        flags += ["--outputs", str(tmp_path)]
    assert cli.main(["report", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
