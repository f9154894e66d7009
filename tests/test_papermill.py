"""A chapter run by hand — papermill with a preset by name — warns of nothing and never writes the committed report;
the runner's run of a chapter stores it as a reader should meet it: no tqdm warning, no machine path, joined streams."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from openpretrain.core import REPORT_RUN, SCRATCH_OUTPUTS, project_root
from openpretrain.report import ReportSettings, run_chapter

CHAPTER = "01a_ledger"  # the cheapest chapter that writes tables (3 s), and one that imports tqdm.auto
COMMITTED = project_root() / "outputs" / "tiny"
MACHINE_PATH = re.compile(r"(?<![\w.~/:-])/(?:tmp|work|home|root|usr|opt|Users)/")


def snapshot(folder: Path) -> dict:
    "Every file under `folder` with its size and modification time: a rewrite, even of the same bytes, shows."
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("how", ["-p", "-f"])
def test_a_chapter_run_by_papermill_warns_of_nothing_and_leaves_the_committed_report_alone(tmp_path, how):
    args = ["-p", "preset", "tiny"] if how == "-p" else ["-f", "configs/papermill/tiny.yaml"]   # the preset's papermill file
    env = {k: v for k, v in os.environ.items() if k not in ("OPENPRETRAIN_OUTPUTS", REPORT_RUN)}  # not the runner
    before, start = snapshot(COMMITTED), time.time_ns()
    done = subprocess.run([sys.executable, "-m", "papermill", f"nbs/{CHAPTER}.ipynb", str(tmp_path / "out.ipynb"),
                           *args, "--cwd", "nbs", "--no-progress-bar"], cwd=project_root(), env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if "warn" in line.lower()
                and "[IPKernelApp] WARNING | Kernel is running over TCP" not in line]  # ipykernel on its transport
    assert warnings == [] and "unknown parameter" not in done.stderr.lower()
    assert snapshot(COMMITTED) == before
    written = sorted((project_root() / SCRATCH_OUTPUTS / "tiny" / "tables").glob(f"{CHAPTER}-*.csv"))
    assert written and all(p.stat().st_mtime_ns >= start for p in written)  # its tables went to the scratch root


def test_every_preset_has_its_papermill_file_naming_it():
    import yaml
    presets = {p.stem for p in (project_root() / "configs").glob("*.yaml")}
    files = {p.stem: yaml.safe_load(p.read_text()) for p in (project_root() / "configs" / "papermill").glob("*.yaml")}
    assert set(files) == presets and all(v == {"preset": k} for k, v in files.items())


def test_the_runner_stores_a_chapter_without_the_iprogress_warning_or_a_machine_path(tmp_path):
    before = snapshot(COMMITTED)
    run_chapter(CHAPTER, ReportSettings(outputs=str(tmp_path), device="cpu"))
    nb = json.loads((tmp_path / "tiny" / "notebooks" / f"{CHAPTER}.ipynb").read_text(encoding="utf-8"))
    outputs = [c.get("outputs", []) for c in nb["cells"]]
    text = "".join("".join(o["text"]) for outs in outputs for o in outs if o["output_type"] == "stream")
    assert text and "IProgress" not in text and "\r" not in text and not MACHINE_PATH.search(text)
    assert not [(a["name"], b["name"]) for outs in outputs for a, b in zip(outs, outs[1:])
                if a["output_type"] == b["output_type"] == "stream" and a["name"] == b["name"]]  # joined
    assert sorted((tmp_path / "tiny" / "tables").glob(f"{CHAPTER}-*.csv")) and snapshot(COMMITTED) == before
