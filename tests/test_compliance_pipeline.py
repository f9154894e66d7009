"""Compliance pipeline (reader → quarantine → robots → toxicity → PII → writer): conservation, crash/resume, bad input."""
import gzip
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openpretrain.compliance.pipeline import build_pipeline, make_executor, read_ledger, run_compliance
from openpretrain.compliance.robots import write_snapshot
from openpretrain.compliance.toxicity import load_weak_labels

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
        if expected is None and kind != "no-text":  # reached the toxicity step: removed iff above the cut
            expected = "toxicity" if row.toxicity_score > row.toxicity_threshold else None
        assert (row.removed_by if isinstance(row.removed_by, str) else None) == expected, (kind, host)
    assert (ledger.removed_by == "malformed").sum() == sum(k in ("no-text", "truncated") for k, _, _ in spec)


# --- crash and resume ---------------------------------------------------------------------------------------------------

CRASHING_RUN = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from datatrove.pipeline.base import PipelineStep
    from openpretrain.compliance.pipeline import build_pipeline, make_executor
    inp, out, marker = map(Path, sys.argv[1:4])

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


def _run_script(args: list[str], log: Path) -> int:
    "Run in a new session, output to a file (an orphaned helper process must not hold a pipe open); reap the group."
    with open(log, "wb") as f:
        proc = subprocess.Popen(args, env=os.environ | {"OMP_NUM_THREADS": "1"}, stdout=f, stderr=f,
                                start_new_session=True)
        rc = proc.wait(timeout=120)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever the killed executor left behind
    except ProcessLookupError:
        pass
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


def test_run_compliance_calibrates_once_and_removes_five_percent_per_language(tmp_path):
    lines = [json.dumps(_doc(i)).encode() for i in range(400)]  # 100 per language (min_language_docs: 100)
    _write(tmp_path / "in", lines, shards=2)
    ledger = run_compliance("tiny", tasks=2, workers=2, output_dir=tmp_path / "out", input_dir=tmp_path / "in",
                            fmt="jsonl", robots_snapshot=SNAPSHOT).frame
    thresholds = json.loads((tmp_path / "out" / "toxicity_thresholds.json").read_text())
    assert set(thresholds) == {"en", "de", "it", "es", "*"}
    share = ledger.groupby("language").removed_by.apply(lambda r: (r == "toxicity").mean())
    assert ((share - 0.05).abs() <= 0.01).all(), share  # 100 documents per language: 5 removed (ties aside)


def test_the_same_pipeline_builds_for_slurm_and_ray(tmp_path):
    pipe = build_pipeline(tmp_path, tmp_path / "out", "tiny", robots_snapshot=SNAPSHOT, thresholds=THRESHOLDS)
    slurm = make_executor(pipe, "slurm", tasks=8, workers=4, logging_dir=tmp_path / "logs", time="01:00:00",
                          partition="normal", venv_path=".venv/bin/activate")
    assert slurm.tasks == 8 and slurm.pipeline is pipe
    pytest.importorskip("ray")
    assert make_executor(pipe, "ray", tasks=8, workers=4, logging_dir=tmp_path / "logs").pipeline is pipe
    with pytest.raises(ValueError, match="executor"):
        make_executor(pipe, "k8s", tasks=1, workers=1, logging_dir=tmp_path)
