"""Compliance pipeline (reader → quarantine → robots → toxicity → PII → writer): conservation, crash/resume, bad input."""
import contextlib
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openpretrain.compliance.pipeline import (FailClosed, build_pipeline, make_executor, make_reader,
                                              read_ledger, run_compliance)
from openpretrain.compliance.robots import write_snapshot
from openpretrain.compliance.toxicity import (ToxicityConfig, ToxicityScorer, USEEmbedder, fit_threshold, load_heads,
                                              load_weak_labels, random_score)
from openpretrain.core import FolderInUse, folder_lock, load_preset

ROBOTS = {  # host → robots.txt body (bytes), fetched 2025-01-15
    "blocked.example.org": b"User-agent: GPTBot\nDisallow: /\n",
    "open.example.org": b"User-agent: *\nAllow: /\n",
    "xn--bcher-kva.example": b"User-agent: CCBot\nDisallow: /\n",
    "[2001:db8::1]:8080": b"User-agent: *\nDisallow: /\n",
    "html.example": b"<html><body><p>User-agent: * Disallow: /</p></body></html>",
    "bin.example": bytes(range(256)) * 8,
    "big.example": b"User-agent: *\n" + b"#" * 600_000 + b"\nDisallow: /\n",  # rule beyond the 500 KiB cap
}
SNAPSHOT = pd.DataFrame([{"host": h, "http_status": 200, "body": b, "fetched_at": "2025-01-15"} for h, b in ROBOTS.items()])
TEXTS = load_weak_labels().groupby("lang").head(100).reset_index(drop=True)  # real text, 4 languages
ISO = {"en": "eng", "de": "deu", "it": "ita", "es": "spa"}
THRESHOLDS = {"en": 0.9, "de": 0.9, "it": 0.9, "es": 0.9, "*": 0.9}


def _doc(i: int, url: str | None = "https://open.example.org/p", lang: str | None = None, **extra) -> dict:
    row = TEXTS.iloc[i % len(TEXTS)]
    d = {"text": row.text, "id": f"doc-{i}", "language": lang or ISO[row.lang], "token_count": len(row.text.split())}
    if url is not None:
        d["url"] = f"{url}/{i}" if url.startswith("http") else url
    return d | extra


def _write(folder: Path, lines: list[bytes], shards: int = 2) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(shards):
        (folder / f"part-{k}.jsonl").write_bytes(b"".join(line + b"\n" for line in lines[k::shards]))


_SCORES: dict[str, float] = {}


def independent_scores(texts: list[str], langs: list[str], cfg: ToxicityConfig | None = None) -> list[float]:
    "Scores from a scorer built here (uncached embedder, committed heads), not from anything the pipeline recorded."
    cfg = cfg or load_preset("tiny").section("toxicity", ToxicityConfig)
    todo = [(t, g) for t, g in dict(zip(texts, langs)).items() if (t, g) not in _SCORES]
    if todo:
        scorer = ToxicityScorer(USEEmbedder(cfg.chunk_words, cfg.max_chunks), load_heads()[0], cfg)
        scores, _ = scorer.score([t for t, _ in todo], [g for _, g in todo], [""] * len(todo))
        _SCORES.update({k: float(v) for k, v in zip(todo, scores)})
    return [_SCORES[(t, g)] for t, g in zip(texts, langs)]


def _run(inp: Path, out: Path, tasks: int = 2, workers: int = 1):
    pipe = build_pipeline(inp, out, "tiny", robots_snapshot=SNAPSHOT, thresholds=THRESHOLDS)
    make_executor(pipe, "local", tasks=tasks, workers=workers, logging_dir=out / "logs").run()
    return read_ledger(out).frame.set_index("id")


# --- conservation over random mixes -----------------------------------------------------------------------------------

HOSTS = ["https://open.example.org", "https://blocked.example.org", "https://bücher.example", "http://[2001:db8::1]:8080",
         "https://open.example.org:8443", "mailto:a@b", None]


def _line(kind: str, pos: int, i: int, host: str | None) -> bytes:
    doc = _doc(i, host, id=f"doc-{pos}")
    if kind == "no-text":
        doc["text"] = None
    if kind == "bad-utf8":
        doc["text"] = "\u00a7" + doc["text"]
        return json.dumps(doc).encode().replace(b"\\u00a7", b"\xff\xfe")
    line = json.dumps(doc).encode()
    return line[:-7] if kind == "truncated" else line


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=st.lists(st.tuples(st.sampled_from(["ok", "ok", "ok", "no-text", "truncated", "bad-utf8"]),
                               st.integers(0, 399), st.sampled_from(HOSTS)), min_size=1, max_size=40),
       tasks=st.integers(1, 3))
def test_every_document_leaves_the_pipeline_exactly_once(tmp_path_factory, spec, tasks):
    root = tmp_path_factory.mktemp("mix")
    _write(root / "in", [_line(kind, pos, i, host) for pos, (kind, i, host) in enumerate(spec)], shards=2)  # tasks=3 stripes
    ledger = _run(root / "in", root / "out", tasks=tasks)
    assert len(ledger) == len(spec)  # one row per input line; Ledger itself refuses duplicate ids
    for pos, (kind, _, host) in enumerate(spec):
        if kind == "truncated":
            continue  # its id is <file>/<line>; counted above
        row = ledger.loc[f"doc-{pos}"]
        expected = ("malformed" if kind == "no-text" else
                    "robots" if host in ("https://blocked.example.org", "https://bücher.example",
                                         "http://[2001:db8::1]:8080") else None)
        if expected is None and kind != "no-text":  # reached the toxicity step: removed iff an independent score is above
            text = TEXTS.text.iloc[spec[pos][1] % len(TEXTS)]
            lang = TEXTS.lang.iloc[spec[pos][1] % len(TEXTS)]
            text = "\ufffd\ufffd" + text if kind == "bad-utf8" else text  # the two invalid bytes, repaired
            expected = "toxicity" if independent_scores([text], [lang])[0] > THRESHOLDS[lang] else None
        assert (row.removed_by if isinstance(row.removed_by, str) else None) == expected, (kind, host)
    assert (ledger.removed_by == "malformed").sum() == sum(k in ("no-text", "truncated") for k, _, _ in spec)


# --- crash and resume ---------------------------------------------------------------------------------------------------

# What both kill-and-resume scripts share: argv = input folder, output folder, marker file, robots snapshot.
SCRIPT_HEAD = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from datatrove.pipeline.base import PipelineStep
    from openpretrain.compliance.pipeline import build_pipeline, make_executor
    inp, out, marker = map(Path, sys.argv[1:4])
""")

CRASHING_RUN = SCRIPT_HEAD + textwrap.dedent("""

    class KillOnce(PipelineStep):
        "SIGKILL the whole process in the middle of rank 2, the first time only."
        name, type = "💥 kill once", "TEST"
        def run(self, data, rank=0, world_size=1):
            for n, doc in enumerate(data):
                if rank == 2 and n == 3 and not marker.exists():
                    marker.touch()
                    os.kill(os.getpid(), signal.SIGKILL)
                yield doc

    pipe = build_pipeline(inp, out, "tiny", robots_snapshot=sys.argv[4], thresholds={"*": 0.9})
    pipe.insert(-1, KillOnce())
    make_executor(pipe, "local", tasks=4, workers=1, logging_dir=out / "logs").run()
""")


def _run_script(args: list[str], log: Path, timeout: float = 120) -> int:
    "Run in a new session, output to a file (an orphaned helper process must not hold a pipe open); reap the group."
    with open(log, "wb") as f:
        proc = subprocess.Popen(args, env=os.environ | {"OMP_NUM_THREADS": "1"}, stdout=f, stderr=f,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # a hung run, or whatever the killed executor left behind
    return rc


def test_run_killed_mid_way_resumes_without_loss_or_duplicates(tmp_path):
    lines = [json.dumps(_doc(i, "https://blocked.example.org" if i % 5 == 0 else "https://open.example.org")).encode()
             for i in range(80)]
    _write(tmp_path / "in", lines, shards=4)
    snap = write_snapshot(SNAPSHOT, tmp_path / "robots.parquet")
    script = tmp_path / "run.py"
    script.write_text(CRASHING_RUN)
    args = [sys.executable, str(script), str(tmp_path / "in"), str(tmp_path / "out"), str(tmp_path / "killed"), str(snap)]
    first = _run_script(args, tmp_path / "first.log")
    assert first == -9, (tmp_path / "first.log").read_text()[-2000:]  # SIGKILL
    done = sorted(p.name for p in (tmp_path / "out" / "logs" / "completions").glob("*"))
    assert done == ["00000", "00001"]  # ranks 0 and 1 finished, 2 died, 3 never started
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "out" / "kept").glob("0000[01].jsonl.gz")}
    assert _run_script(args, tmp_path / "second.log") == 0, (tmp_path / "second.log").read_text()[-2000:]
    assert len(list((tmp_path / "out" / "logs" / "completions").glob("*"))) == 4
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())  # finished ranks were not re-run
    ledger = read_ledger(tmp_path / "out")
    ledger.check_conservation(f"doc-{i}" for i in range(80))  # each exactly once
    assert (ledger.frame.removed_by == "robots").sum() == 16


# --- malformed input ----------------------------------------------------------------------------------------------------

def test_malformed_input_has_a_documented_outcome_for_every_case(tmp_path):
    cases = {  # id → (input line, expected removed_by or None for kept, expected reason recorded)
        "bad.jsonl/0": (b'{"id": "no-json", "text": "cut off', "malformed", "malformed-json"),  # id unreadable
        "no-text": (json.dumps({"id": "no-text", "url": "https://open.example.org/x"}).encode(), "malformed", "malformed-no-text"),
        "num-text": (json.dumps({"id": "num-text", "text": 42}).encode(), "malformed", "malformed-no-text"),
        "bad-utf8": (_line("bad-utf8", 0, 1, "https://open.example.org").replace(b"doc-0", b"bad-utf8"), None, "utf-8"),
        "no-url": (json.dumps(_doc(2, url=None, id="no-url")).encode(), None, "no-host"),
        "mailto": (json.dumps(_doc(3, url="mailto:a@b.ch", id="mailto")).encode(), None, "no-host"),
        "idna": (json.dumps(_doc(4, url="https://bücher.example", id="idna")).encode(), "robots", "disallowed-url"),
        "ipv6-port": (json.dumps(_doc(5, url="http://[2001:db8::1]:8080", id="ipv6-port")).encode(), "robots", "disallowed-url"),
        "broken-ipv6": (json.dumps(_doc(6, url="http://[::1", id="broken-ipv6")).encode(), None, "bad-url"),
        "other-port": (json.dumps(_doc(7, url="https://blocked.example.org:8443", id="other-port")).encode(), None, "no-robots"),
        "html-robots": (json.dumps(_doc(8, url="http://html.example", id="html-robots")).encode(), None, "unavailable"),
        "binary-robots": (json.dumps(_doc(9, url="http://bin.example", id="binary-robots")).encode(), None, "unavailable"),
        "huge-robots": (json.dumps(_doc(10, url="http://big.example", id="huge-robots")).encode(), None, "allowed"),
        "no-language": (json.dumps({k: v for k, v in _doc(11, id="no-language").items() if k != "language"}).encode(), None, None),
    }
    no_id = json.dumps({k: v for k, v in _doc(12).items() if k != "id"}).encode()
    inp = tmp_path / "in"
    inp.mkdir()
    (inp / "bad.jsonl").write_bytes(b"\n".join([c[0] for c in cases.values()] + [b"   ", no_id]) + b"\n")
    ledger = _run(inp, tmp_path / "out", tasks=1)
    assert len(ledger) == len(cases) + 1  # the blank line is not a record; every other line is a row
    for doc_id, (_, removed_by, reason) in cases.items():
        row = ledger.loc[doc_id]
        assert (row.removed_by if isinstance(row.removed_by, str) else None) == removed_by, doc_id
        if removed_by == "malformed":
            assert row.malformed_reason == reason
        elif reason == "utf-8":
            assert row.malformed_reason == "utf-8"
        elif reason is not None:
            assert row.robots_reason == reason, doc_id
    assert ledger.loc["no-language", "toxicity_head"] == "multilingual"  # no language → fallback head, '*' cut
    assert any(i.endswith("bad.jsonl/15") for i in ledger.index)  # a record without id gets <file>/<line>
    kept = {json.loads(line)["id"]: json.loads(line) for p in (tmp_path / "out" / "kept").glob("*.jsonl.gz")
            for line in gzip.open(p, "rt")}
    assert "\ufffd" in kept["bad-utf8"]["text"]  # repaired, not dropped
    removed = [json.loads(line) for line in gzip.open(next((tmp_path / "out/removed/malformed").glob("*.gz")), "rt")]
    assert {r["text"] for r in removed if r["id"] == "bad.jsonl/0"} == {'{"id": "no-json", "text": "cut off'}


def test_parquet_rows_without_text_are_quarantined_not_skipped(tmp_path):
    rows = [_doc(0), _doc(1) | {"text": None}, _doc(2)]
    (tmp_path / "in").mkdir()
    pd.DataFrame(rows).to_parquet(tmp_path / "in" / "part.parquet")
    pipe = build_pipeline(tmp_path / "in", tmp_path / "out", "tiny", robots_snapshot=SNAPSHOT, thresholds=THRESHOLDS,
                          fmt="parquet")
    make_executor(pipe, "local", tasks=1, workers=1, logging_dir=tmp_path / "out" / "logs").run()
    ledger = read_ledger(tmp_path / "out").frame.set_index("id")
    assert ledger.loc["doc-1", "removed_by"] == "malformed" and ledger.removed_by.isna().sum() == 2


def _preset(tmp_path: Path, **toxicity) -> Path:
    "The tiny preset with some toxicity knobs changed, as a file run_compliance can load."
    import yaml
    from openpretrain.core import project_root
    cfg = yaml.safe_load((project_root() / "configs" / "tiny.yaml").read_text())
    cfg["toxicity"].update(toxicity)
    (tmp_path / "preset.yaml").write_text(yaml.safe_dump(cfg))
    return tmp_path / "preset.yaml"


def test_thresholds_fitted_on_a_sample_cut_about_five_percent_of_the_larger_input(tmp_path):
    texts = load_weak_labels().groupby("lang").head(240).reset_index(drop=True)  # 240 distinct texts per language
    rows = [{"text": t, "id": f"d{i}", "url": f"https://open.example.org/{i}", "language": ISO[g], "token_count": 5}
            for i, (t, g) in enumerate(zip(texts.text, texts.lang))]
    _write(tmp_path / "in", [json.dumps(r).encode() for r in rows], shards=2)
    preset = _preset(tmp_path, calibration_docs=80, min_language_docs=50)  # calibrate on 80 of 240 per language
    ledger = run_compliance(str(preset), tasks=2, workers=1, output_dir=tmp_path / "out", input_dir=tmp_path / "in",
                            fmt="jsonl", robots_snapshot=SNAPSHOT).frame
    thresholds = json.loads((tmp_path / "out" / "toxicity_thresholds.json").read_text())
    scores = dict(zip(texts.text, independent_scores(texts.text.tolist(), texts.lang.tolist())))
    for lang, group in texts.assign(id=[r["id"] for r in rows]).groupby("lang"):
        sample = sorted(group.itertuples(), key=lambda r: random_score(r.id))[:80]  # the documented hashed sample
        assert thresholds[lang] == pytest.approx(fit_threshold(np.array([scores[r.text] for r in sample]), 0.05))
        share = (ledger[ledger.language == ISO[lang]].removed_by == "toxicity").mean()
        assert 0.0 < share <= 0.12, (lang, share)  # a 5% cut from 80 documents, applied to 240


def test_the_same_pipeline_builds_a_slurm_array_job_that_runs_it(tmp_path, monkeypatch):
    import dill
    from datatrove.executor import slurm as slurm_module
    launched = []
    monkeypatch.setattr(slurm_module, "launch_slurm_job", lambda script, *a, **k: launched.append(script) or "42")
    pipe = build_pipeline(tmp_path, tmp_path / "out", "tiny", robots_snapshot=SNAPSHOT, thresholds=THRESHOLDS)
    executor = make_executor(pipe, "slurm", tasks=8, workers=4, logging_dir=tmp_path / "logs", time="01:00:00",
                             partition="normal", venv_path=".venv/bin/activate")
    executor.launch_job()
    script = (tmp_path / "logs" / "launch_script.slurm").read_text()
    assert launched[0] == script and "#SBATCH --array=0-7%4" in script and "#SBATCH --partition=normal" in script
    assert f"launch_pickled_pipeline {tmp_path / 'logs' / 'executor.pik'}" in script
    with open(tmp_path / "logs" / "executor.pik", "rb") as f:
        job = dill.load(f)  # what each array task unpickles and runs
    assert [type(s).__name__ for s in job.pipeline] == [type(s).__name__ for s in pipe] and job.world_size == 8
    with pytest.raises(ValueError, match="executor"):
        make_executor(pipe, "k8s", tasks=1, workers=1, logging_dir=tmp_path)


@contextlib.contextmanager
def _local_ray(ray, attempts: int = 3):
    """A private local Ray cluster that survives a loaded machine. Ray's startup waits are fixed, not configurable
    (the raylet aborts when the dashboard agent has not written its port file within ~15 s, ray.init when the raylet
    has not registered within 30 s), and on 2 shared cores the agent's Python start alone took 47 s. A start that
    fails that way is retried in a fresh temp dir, after ending the processes that start spawned (by pid: the children
    of this process that appeared during it); the cluster is shut down and its processes are gone on exit."""
    psutil = pytest.importorskip("psutil")
    me = psutil.Process()
    for attempt in range(attempts):
        before = {c.pid for c in me.children(recursive=True)}
        temp = Path(tempfile.mkdtemp(prefix="ray-"))  # short: Ray's unix socket paths must fit in 107 bytes
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=200 * 2**20,
                     _temp_dir=str(temp))
        except Exception:
            ray.shutdown()
            spawned = [c for c in me.children(recursive=True) if c.pid not in before]
            for c in spawned:
                with contextlib.suppress(psutil.NoSuchProcess):
                    c.kill()
            psutil.wait_procs(spawned, timeout=10)
            shutil.rmtree(temp, ignore_errors=True)
            if attempt == attempts - 1:
                raise
            continue
        try:
            yield
        finally:
            ray.shutdown(wait_for_processes=True)
            shutil.rmtree(temp, ignore_errors=True)
        return


@pytest.mark.slow
def test_ray_executor_runs_the_pipeline_and_conserves_documents(tmp_path):
    ray = pytest.importorskip("ray")
    lines = [json.dumps(_doc(i, "https://blocked.example.org" if i % 4 == 0 else "https://open.example.org")).encode()
             for i in range(40)]
    _write(tmp_path / "in", lines, shards=2)
    pipe = build_pipeline(tmp_path / "in", tmp_path / "out", "tiny", robots_snapshot=SNAPSHOT, thresholds=THRESHOLDS)
    with _local_ray(ray):
        make_executor(pipe, "ray", tasks=2, workers=2, logging_dir=tmp_path / "out" / "logs").run()
    ledger = read_ledger(tmp_path / "out")
    ledger.check_conservation(f"doc-{i}" for i in range(40))
    assert (ledger.frame.removed_by == "robots").sum() == 10


# --- issue 9: hardening -------------------------------------------------------------------------------------------------

KILL_A_WORKER = SCRIPT_HEAD + textwrap.dedent("""

    class KillWorkerOnce(PipelineStep):
        "SIGKILL the pool worker running rank 3, the first time only (the main process survives)."
        name, type = "💥 kill a worker", "TEST"
        def run(self, data, rank=0, world_size=1):
            for doc in data:
                if rank == 3 and not marker.exists():
                    marker.touch()
                    os.kill(os.getpid(), signal.SIGKILL)
                yield doc

    if __name__ == "__main__":  # the forkserver imports this module again
        pipe = build_pipeline(inp, out, "tiny", robots_snapshot=sys.argv[4], thresholds={"*": 0.9})
        pipe.insert(-1, KillWorkerOnce())
        make_executor(pipe, "local", tasks=8, workers=2, logging_dir=out / "logs").run()
""")


def test_a_killed_worker_fails_the_run_and_a_rerun_resumes(tmp_path):
    _write(tmp_path / "in", [json.dumps(_doc(i)).encode() for i in range(40)], shards=8)
    snap = write_snapshot(SNAPSHOT, tmp_path / "robots.parquet")
    (tmp_path / "run.py").write_text(KILL_A_WORKER)
    args = [sys.executable, str(tmp_path / "run.py"), str(tmp_path / "in"), str(tmp_path / "out"),
            str(tmp_path / "killed"), str(snap)]
    try:
        first = _run_script(args, tmp_path / "first.log", timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("the run hung after a worker was killed")
    log = (tmp_path / "first.log").read_text()
    assert first != 0 and "died" in log and "rerun to resume" in log, log[-2000:]
    assert _run_script(args, tmp_path / "second.log") == 0, (tmp_path / "second.log").read_text()[-2000:]
    read_ledger(tmp_path / "out").check_conservation(f"doc-{i}" for i in range(40))


def _processes_in_session(sid: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: session id
            pids.append(int(stat.parent.name))
    return pids


SLOW_RUN = KILL_A_WORKER.replace("if rank == 3 and not marker.exists():", "if False:").replace(
    "yield doc", "__import__('time').sleep(0.5)\n            yield doc")


def test_killing_the_main_process_leaves_no_orphans(tmp_path):
    _write(tmp_path / "in", [json.dumps(_doc(i)).encode() for i in range(80)], shards=8)
    snap = write_snapshot(SNAPSHOT, tmp_path / "robots.parquet")
    (tmp_path / "run.py").write_text(SLOW_RUN)
    with open(tmp_path / "log", "wb") as f:
        proc = subprocess.Popen([sys.executable, str(tmp_path / "run.py"), str(tmp_path / "in"), str(tmp_path / "out"),
                                 str(tmp_path / "m"), str(snap)], stdout=f, stderr=f, start_new_session=True)
    try:
        for _ in range(600):  # until the workers are busy
            if len(list((tmp_path / "out" / "logs" / "logs").glob("task_*"))) >= 2:
                break
            time.sleep(0.1)
        assert len(_processes_in_session(proc.pid)) > 2  # main, manager, forkserver, workers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 10
        while _processes_in_session(proc.pid) and time.time() < deadline:
            time.sleep(0.2)
        assert _processes_in_session(proc.pid) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_second_run_on_a_locked_output_folder_fails_naming_the_holder(tmp_path):
    _write(tmp_path / "in", [json.dumps(_doc(i)).encode() for i in range(4)], shards=1)
    (tmp_path / "out").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        f = open({str(tmp_path / "out" / ".lock")!r}, "a+")
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(f"pid {{os.getpid()}} on testhost\\n"); f.flush()
        print("locked", flush=True)
        time.sleep(60)""")], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"locked"
        with pytest.raises(RuntimeError, match=f"in use.*pid {holder.pid} on testhost"):
            run_compliance("tiny", tasks=1, workers=1, output_dir=tmp_path / "out", input_dir=tmp_path / "in",
                           fmt="jsonl", robots_snapshot=SNAPSHOT)
        assert not (tmp_path / "out" / "kept").exists()
    finally:
        holder.kill()
        holder.wait()
    with folder_lock(tmp_path / "out", "compliance run"):  # released with its holder
        pass


@pytest.mark.parametrize("workers", [1, 2])
def test_the_lower_level_entry_refuses_an_output_folder_another_run_holds(tmp_path, workers):
    _write(tmp_path / "in", [json.dumps(_doc(i)).encode() for i in range(4)], shards=2)
    with folder_lock(tmp_path / "out", "compliance run"):  # a second open file: refused even in this process
        with pytest.raises(FolderInUse, match=f"out is in use by another compliance run \\(pid {os.getpid()} "):
            _run(tmp_path / "in", tmp_path / "out", tasks=2, workers=workers)
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".lock"]  # nothing written
    assert len(_run(tmp_path / "in", tmp_path / "out", tasks=2, workers=workers)) == 4  # released: the same entry runs


def test_poison_records_are_removed_as_malformed_and_the_run_goes_on(tmp_path):
    poison = {"url-int": {"url": 12345}, "url-list": {"url": ["https://a"]}, "tokens-str": {"token_count": "many"},
              "media-dict": {"media": [{"x": 1}]}}
    lines = [json.dumps(_doc(i, id=name) | extra).encode() for i, (name, extra) in enumerate(poison.items())]
    lines += [json.dumps(_doc(10 + i)).encode() for i in range(4)]
    _write(tmp_path / "in", lines, shards=2)
    ledger = _run(tmp_path / "in", tmp_path / "out", tasks=2)
    for name in poison:
        assert ledger.loc[name, "removed_by"] == "malformed", name
        assert ledger.loc[name, "malformed_reason"] == "malformed-bad-field" and ledger.loc[name, "malformed_error"]
    assert ledger.loc[[f"doc-{10 + i}" for i in range(4)], "malformed_decision"].eq("kept").all()


def test_a_negative_token_count_is_removed_as_malformed_not_copied_into_the_ledger(tmp_path):
    from openpretrain.corpus import count_tokens
    lines = [json.dumps(_doc(0, id="negative", token_count=-5)).encode(), json.dumps(_doc(1)).encode()]
    _write(tmp_path / "in", lines, shards=1)
    ledger = _run(tmp_path / "in", tmp_path / "out", tasks=1)
    row = ledger.loc["negative"]
    assert row.removed_by == "malformed" and row.malformed_reason == "malformed-bad-field"
    assert "token_count is -5" in row.malformed_error
    removed = [json.loads(line) for p in (tmp_path / "out/removed/malformed").glob("*.gz") for line in gzip.open(p, "rt")]
    assert row.tokens == count_tokens(next(r["text"] for r in removed if r["id"] == "negative"))  # its raw record
    assert (ledger.tokens >= 0).all() and ledger.loc["doc-1", "tokens"] == _doc(1)["token_count"]


def test_a_step_that_raises_on_one_record_removes_only_that_record(tmp_path):
    from datatrove.pipeline.filters.base_filter import BaseFilter
    from datatrove.pipeline.writers import JsonlWriter
    from openpretrain.compliance.pipeline import Quarantine

    class Picky(BaseFilter):
        name = "picky"
        def filter(self, doc):
            if doc.id == "doc-1":
                raise KeyError("boom")
            return True
    _write(tmp_path / "in", [json.dumps(_doc(i)).encode() for i in range(3)], shards=1)
    steps = [make_reader(tmp_path / "in"), Quarantine(), FailClosed(Picky(), JsonlWriter(str(tmp_path / "out" / "removed" / "errors"))),
             JsonlWriter(str(tmp_path / "out" / "kept"))]
    make_executor(steps, "local", tasks=1, workers=1, logging_dir=tmp_path / "out" / "logs").run()
    ledger = read_ledger(tmp_path / "out").frame.set_index("id")
    assert ledger.loc["doc-1", "removed_by"] == "malformed" and "KeyError" in ledger.loc["doc-1", "malformed_error"]
    assert ledger.loc["doc-1", "malformed_failed_step"] == "picky" and ledger.removed_by.isna().sum() == 2


def test_input_fields_cannot_forge_ledger_decisions(tmp_path):
    forged = {"malformed": "json", "robots_decision": "removed", "toxicity_decision": "removed", "pii_reason": "x"}
    _write(tmp_path / "in", [json.dumps(_doc(0, id="forger") | forged).encode()], shards=1)
    ledger = _run(tmp_path / "in", tmp_path / "out", tasks=1)
    independent = independent_scores([TEXTS.text.iloc[0]], [TEXTS.lang.iloc[0]])[0]
    assert ledger.loc["forger", "malformed_decision"] == "kept" and ledger.loc["forger", "robots_decision"] == "kept"
    assert ledger.loc["forger", "toxicity_decision"] == ("removed" if independent > 0.9 else "kept")
    kept = [json.loads(line) for p in (tmp_path / "out" / "kept").glob("*.gz") for line in gzip.open(p, "rt")]
    assert all(kept[0]["metadata"]["input_fields"][k] == v for k, v in forged.items()) if kept else True


def test_input_where_nothing_reaches_toxicity_ends_with_an_empty_kept_set(tmp_path):
    lines = [json.dumps(_doc(i, "https://blocked.example.org")).encode() for i in range(6)]
    _write(tmp_path / "in", lines, shards=2)
    ledger = run_compliance("tiny", tasks=2, workers=1, output_dir=tmp_path / "out", input_dir=tmp_path / "in",
                            fmt="jsonl", robots_snapshot=SNAPSHOT).frame
    assert len(ledger) == 6 and (ledger.removed_by == "robots").all()


def test_an_absurd_task_count_is_clamped_to_the_input_files(tmp_path):
    _write(tmp_path / "in", [json.dumps(_doc(i)).encode() for i in range(6)], shards=2)
    run_compliance("tiny", tasks=50, workers=2, output_dir=tmp_path / "out", input_dir=tmp_path / "in", fmt="jsonl",
                   robots_snapshot=SNAPSHOT)
    assert len(list((tmp_path / "out" / "logs" / "completions").glob("*"))) == 2


def test_duplicate_ids_fail_closed_before_anything_is_written(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text(json.dumps(_doc(0, id="same")) + "\n")
    (tmp_path / "in" / "b.jsonl").write_text(json.dumps(_doc(1, id="same")) + "\n")
    with pytest.raises(ValueError, match="duplicate document id 'same'.*a.jsonl.*b.jsonl"):
        run_compliance("tiny", tasks=2, workers=1, output_dir=tmp_path / "out", input_dir=tmp_path / "in",
                       fmt="jsonl", robots_snapshot=SNAPSHOT)
    assert not (tmp_path / "out" / "kept").exists()


def test_reading_a_missing_run_is_an_error_not_an_empty_ledger(tmp_path):
    with pytest.raises(FileNotFoundError, match="no compliance run"):
        read_ledger(tmp_path / "nowhere")


def test_a_truncated_gz_input_fails_naming_the_file(tmp_path):
    (tmp_path / "in").mkdir()
    whole = gzip.compress(b"".join(json.dumps(_doc(i)).encode() + b"\n" for i in range(50)))
    (tmp_path / "in" / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(Exception, match="cut.jsonl.gz"):
        list(make_reader(tmp_path / "in")())


def _damaged(kind: str, folder: Path) -> Path:
    "An input file of `kind` in `folder`: truncated or corrupt, gzipped JSONL or Parquet."
    docs = [_doc(i) for i in range(60)]
    if kind.endswith("gz"):
        data = bytearray(gzip.compress(b"".join(json.dumps(d).encode() + b"\n" for d in docs)))
        path = folder / f"{kind}.jsonl.gz"
    else:
        path = folder / f"{kind}.parquet"
        pd.DataFrame(docs).to_parquet(path, row_group_size=20)
        data = bytearray(path.read_bytes())
    if kind.startswith("truncated"):
        del data[len(data) // 2:]
    else:
        data[100:400] = bytes(b ^ 0xFF for b in data[100:400])  # inside the first deflate block / row group
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("kind", ["truncated-gz", "corrupt-gz", "truncated-parquet", "corrupt-parquet"])
def test_a_damaged_input_file_fails_naming_it_before_anything_is_written(tmp_path, kind):
    (tmp_path / "in").mkdir()
    path = _damaged(kind, tmp_path / "in")
    with pytest.raises(OSError, match=f"{re.escape(str(path))}: unreadable"):
        run_compliance("tiny", tasks=1, workers=1, output_dir=tmp_path / "out", input_dir=tmp_path / "in",
                       fmt="parquet" if kind.endswith("parquet") else "jsonl", robots_snapshot=SNAPSHOT)
    assert not (tmp_path / "out").exists()


def test_a_truncated_kept_file_fails_the_ledger_naming_it_and_rerunning_its_task_recovers(tmp_path):
    _write(tmp_path / "in", [json.dumps(_doc(i)).encode() for i in range(8)], shards=2)
    _run(tmp_path / "in", tmp_path / "out", tasks=2)
    kept = tmp_path / "out" / "kept" / "00000.jsonl.gz"
    kept.write_bytes(kept.read_bytes()[: kept.stat().st_size // 2])
    with pytest.raises(OSError, match=f"{re.escape(str(kept))}: unreadable"):
        read_ledger(tmp_path / "out")
    kept.unlink()
    (tmp_path / "out" / "logs" / "completions" / "00000").unlink()
    _run(tmp_path / "in", tmp_path / "out", tasks=2)  # only task 0 runs again
    read_ledger(tmp_path / "out").check_conservation(f"doc-{i}" for i in range(8))


def test_a_byte_order_mark_does_not_make_the_first_record_malformed(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps(_doc(0)).encode() + b"\n")
    (doc,) = make_reader(tmp_path / "in")()
    assert doc.id == "doc-0" and "malformed" not in doc.metadata


def test_parquet_tasks_read_only_their_own_row_groups(tmp_path):
    (tmp_path / "in").mkdir()
    pd.DataFrame([_doc(i) for i in range(40)]).to_parquet(tmp_path / "in" / "one.parquet", row_group_size=10)
    reader = make_reader(tmp_path / "in", "parquet")
    per_rank = [[d.id for d in reader.run(rank=r, world_size=4)] for r in range(4)]
    assert per_rank == [[f"doc-{i}" for i in range(10 * r, 10 * r + 10)] for r in range(4)]  # group r, in order
