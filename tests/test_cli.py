"""The command line over run folders (chapter 91): `export` to a transformers folder that loads offline with our ids
and logits, `eval` with lm-eval's own flags and results JSON, `serve` and `sft --from` given a run."""
import json
import os
import queue
import re
import shutil
import statistics
import subprocess
import sys
import threading

os.environ.setdefault("HF_HUB_OFFLINE", "1")            # everything below is read from local folders
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import httpx  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from chat_models import TOK, chat_checkpoint  # noqa: E402
from test_trainer import SyntheticLoader, write_preset  # noqa: E402

from openpretrain.__main__ import main as cli  # noqa: E402
from openpretrain.chat import render  # noqa: E402
from openpretrain.core import to_dict  # noqa: E402
from openpretrain.evaluation.harness import OpenPretrainLM  # noqa: E402
from openpretrain.tokenization import load_tokenizer  # noqa: E402
from openpretrain.training.checkpoint import latest_valid_checkpoint, load_model, save_weights  # noqa: E402
from openpretrain.training.trainer import train_preset  # noqa: E402

TEXT = "Mintgin ha il dretg da viver, da libertad e da segirezza da sia persuna."


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    "arch → a run folder the trainer wrote (2 steps of test_trainer's CPU-sized preset under bpe-bal-8k), made once."
    runs = {}
    def run(arch: str):
        if arch not in runs:
            folder = tmp_path_factory.mktemp(arch)
            train_preset(write_preset(folder, arch=arch), folder / "run", 2, loader_factory=SyntheticLoader)
            runs[arch] = folder / "run"
        return runs[arch]
    return run


def one_line(capsys, command: str, argv: list[str]) -> str:
    "The one stderr line of a refused command (exit status 2)."
    assert cli([command, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"openpretrain {command}: "), err
    return err


def broken_run(run, tmp_path):
    "A copy of `run` whose every checkpoint is truncated."
    copy = tmp_path / "broken"
    shutil.copytree(run, copy)
    for weights in copy.glob("checkpoints/step-*/model.safetensors"):
        weights.write_bytes(weights.read_bytes()[:100])
    return copy


# --- export ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["dense", "hybrid"])
def test_an_exported_run_loads_in_transformers_with_our_ids_and_logits(trained, tmp_path, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    run, out = trained(arch), tmp_path / "hf"
    assert cli(["export", str(run), str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    hf_tok, hf = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out).eval()
    ours_tok = load_tokenizer("bpe-bal-8k")                  # the preset's: the run kept it, the export carries it
    ids = hf_tok(TEXT).input_ids
    assert ids == [ours_tok.bos_id, *ours_tok.encode(TEXT)]   # <s> first, as a document starts; no </s>
    assert hf_tok.decode(ids, skip_special_tokens=True) == TEXT
    ours = load_model(latest_valid_checkpoint(run / "checkpoints")).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(torch.tensor([ids])).logits, ours(torch.tensor([ids])), rtol=1e-4, atol=1e-5)


def test_an_exported_chat_checkpoint_renders_our_template(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    checkpoint, out = chat_checkpoint(tmp_path), tmp_path / "hf"        # its chat tokenizer.json in tmp_path
    assert cli(["export", str(checkpoint), str(out)]) == 0
    hf_tok, hf = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out).eval()
    messages = [{"role": "system", "content": "Rispunda curt."}, {"role": "user", "content": "Co vai?"},
                {"role": "assistant", "content": "Bain, grazia."}, {"role": "user", "content": TEXT}]
    ids = render(TOK, messages, add_generation_prompt=True)[0]
    assert hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False) == ids
    with torch.no_grad():
        torch.testing.assert_close(hf(torch.tensor([ids])).logits, load_model(checkpoint)(torch.tensor([ids])),
                                   rtol=1e-4, atol=1e-5)


def test_export_refuses_in_one_line_what_it_cannot_export(trained, tmp_path, capsys):
    run = trained("dense")
    assert "neither a checkpoint" in one_line(capsys, "export", [str(tmp_path), str(tmp_path / "a")])
    assert "none of its 1 checkpoints verifies" in one_line(capsys, "export", [str(broken_run(run, tmp_path)),
                                                                               str(tmp_path / "b")])
    config = load_model(latest_valid_checkpoint(run / "checkpoints")).config
    bare = save_weights(tmp_path / "bare", 1, load_model(latest_valid_checkpoint(run / "checkpoints")).state_dict(),
                        config)                                        # no tokenizer.json in any folder above it
    assert "pass --tokenizer" in one_line(capsys, "export", [str(bare), str(tmp_path / "c")])
    assert "has 2,048 ids, the model 8,192" in one_line(capsys, "export", [str(bare), str(tmp_path / "d"),
                                                                           "--tokenizer", "bpe-bal-2k"])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert "not an empty folder" in one_line(capsys, "export", [str(run), str(tmp_path / "full")])
    assert not any((tmp_path / n).exists() for n in "abcd"), "a refused export writes nothing"
    assert cli(["export", str(bare), str(tmp_path / "e"), "--tokenizer", "bpe-bal-8k"]) == 0   # named: exported
    assert to_dict(load_model(bare).config) == to_dict(config)


# --- eval ----------------------------------------------------------------------------------------------------------

def test_eval_of_a_run_passes_lm_eval_options_and_writes_its_results_json(trained, tmp_path, capsys):
    run = trained("dense")
    newest = latest_valid_checkpoint(run / "checkpoints")
    out, lm_out = tmp_path / "results.csv", tmp_path / "lm-eval"
    assert cli(["eval", "--checkpoint", str(run), "--tasks", "openpretrain_continuation", "--limit", "4",
                "--num_fewshot", "1", "--seed", "5", "--batch_size", "3", "--out", str(out),
                "--output_path", str(lm_out), "--log_samples"]) == 0
    captured = capsys.readouterr()
    assert re.search(r"loglikelihood: 100%\|.*\| 16/16", captured.err), "no progress shown while scoring"
    assert "openpretrain_continuation" in captured.out and "acc_norm" in captured.out    # lm-eval's table
    results = json.loads(out.with_suffix(".json").read_text())
    task = results["results"]["openpretrain_continuation"]
    assert results["n-samples"]["openpretrain_continuation"]["effective"] == 4
    assert results["n-shot"]["openpretrain_continuation"] == 1 and "openpretrain_continuation" in results["versions"]
    config = results["config"]
    assert (config["checkpoint"], config["preset"], config["limit"]) == (str(newest), "tiny", 4)
    assert config["random_seed"] == config["fewshot_seed"] == 5 and config["batch_size"] == 3
    # lm-eval's own files, and in them the run's newest model scored with the run's tokenizer, as our LM scores it
    (samples_file,) = lm_out.rglob("samples_openpretrain_continuation_*.jsonl")
    assert len(list(lm_out.rglob("results_*.json"))) == 1
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    lm = OpenPretrainLM(load_model(newest), load_tokenizer("bpe-bal-8k"), batch_size=3)
    from lm_eval.api.instance import Instance
    for s in samples:
        args = [tuple(a.values()) for a in s["arguments"].values()]
        mine = lm.loglikelihood([Instance("loglikelihood", {}, a, i) for i, a in enumerate(args)], disable_tqdm=True)
        # rows padded into other batches: fp32 sums over ~50 tokens move by ~1e-4 of their size (measured 1.03e-4)
        assert [float(r[0][0]) for r in s["resps"]] == pytest.approx([m[0] for m in mine], rel=1e-3)
    accs = [s["acc"] for s in samples]
    assert task["acc,none"] == pytest.approx(statistics.mean(accs))
    assert task["acc_stderr,none"] == pytest.approx(statistics.stdev(accs) / len(accs) ** 0.5)   # lm-eval's mean_stderr
    import pandas as pd
    table = pd.read_csv(out).set_index("metric").value
    assert table["acc"] == task["acc,none"] and table["acc_norm"] == task["acc_norm,none"]


def test_eval_refuses_in_one_line_what_it_cannot_evaluate(trained, tmp_path, capsys):
    run = trained("dense")
    assert "neither a checkpoint" in one_line(capsys, "eval", ["--checkpoint", str(tmp_path)])
    assert "none of its 1 checkpoints verifies" in one_line(capsys, "eval", ["--checkpoint",
                                                                             str(broken_run(run, tmp_path))])
    assert "--log_samples writes the samples under --output_path" in one_line(
        capsys, "eval", ["--checkpoint", str(run), "--log_samples"])
    assert "--limit" in one_line(capsys, "eval", ["--checkpoint", str(run), "--limit", "2.5"])
    assert "--seed" in one_line(capsys, "eval", ["--checkpoint", str(run), "--seed", "1,2"])
    assert "names the CSV" in one_line(capsys, "eval", ["--checkpoint", str(run), "--out", str(tmp_path / "r.json")])


# --- serve and sft from a run folder -------------------------------------------------------------------------------

def chat_run(tmp_path):
    "A run folder holding one chat checkpoint, its chat tokenizer.json in the folder above."
    checkpoint = chat_checkpoint(tmp_path)
    run = tmp_path / "run"
    shutil.copytree(checkpoint, run / "checkpoints" / checkpoint.name)
    return run


def test_serve_answers_from_a_run_folder(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "openpretrain", "serve", "--checkpoint", str(chat_run(tmp_path)),
                             "--port", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [*map(lines.put, proc.stderr), lines.put("")], daemon=True).start()
    try:
        announced = None
        while not announced and (line := lines.get(timeout=60)):
            announced = re.search(r"^openpretrain serve: \S+ on (http://127\.0\.0\.1:\d+/v1)", line)
        assert announced, "serve announced no address"
        reply = None
        for _ in range(100):
            try:
                reply = httpx.post(f"{announced[1]}/chat/completions", timeout=10, json={
                    "model": "openpretrain", "max_tokens": 3, "messages": [{"role": "user", "content": "Allegra"}]})
                break
            except httpx.ConnectError:
                threading.Event().wait(0.1)
        assert reply is not None and reply.status_code == 200 and reply.json()["choices"][0]["message"]["role"] == "assistant"
    finally:
        proc.terminate()
        proc.wait(10)


def test_serve_and_sft_refuse_a_run_with_no_valid_checkpoint_in_one_line(tmp_path, capsys):
    broken = broken_run(chat_run(tmp_path), tmp_path)
    assert "none of its 1 checkpoints verifies" in one_line(capsys, "serve", ["--checkpoint", str(broken), "--port", "0"])
    assert "none of its 1 checkpoints verifies" in one_line(capsys, "sft", ["--from", str(broken),
                                                                            "--out", str(tmp_path / "sft")])
    assert not (tmp_path / "sft").exists()


def test_sft_starts_from_a_runs_newest_verified_checkpoint(trained, tmp_path, monkeypatch, capsys):
    from openpretrain.posttrain import sft
    run = trained("dense")
    started = []
    monkeypatch.setattr(sft, "finetune", lambda p, start, out, conversations, tok, *rest: started.append(start) or out)
    assert cli(["sft", "--from", str(run), "--out", str(tmp_path / "sft")]) == 0
    assert started == [latest_valid_checkpoint(run / "checkpoints")]


def test_a_closed_pipe_ends_a_command_quietly():
    "`openpretrain presets | head -1`: no BrokenPipeError traceback, the status a shell tool gives (141)."
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "openpretrain", "presets"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()                                   # the reader is gone before the first line
    assert proc.wait(timeout=60) in (0, 141) and b"Traceback" not in proc.stderr.read()


def test_two_exports_into_one_folder_leave_one_whole_copy_and_one_line(trained, tmp_path):
    "Run at once, one export renames its folder into OUT; the other says in one line that OUT was filled meanwhile."
    import subprocess
    import sys
    out = tmp_path / "hf"
    procs = [subprocess.Popen([sys.executable, "-m", "openpretrain", "export", str(trained("dense")), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    done = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert sorted(rc for rc, _ in done) == [0, 2]                   # OUT filled before or while the other ran
    assert all("Traceback" not in err for _, err in done)
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert not list(tmp_path.glob(".hf.*.tmp"))                      # no temporary folder left behind
