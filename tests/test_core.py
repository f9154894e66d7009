"""Presets, typed configs and the report runner's settings and manifest."""
import hashlib
import json
from pathlib import Path
import subprocess
from dataclasses import dataclass, field

import pytest
import yaml

from openpretrain.core import ConfigError, bounded, from_dict, list_presets, load_preset, project_root
from openpretrain.report import (ReportSettings, check_report, check_settings, compare_manifests, git_state,
                                 read_settings, run_report, write_index)


@dataclass(kw_only=True)
class Inner:
    width: int = 8          # a knob
    ratio: float = 0.5      # another


@dataclass(kw_only=True)
class Outer:
    name: str = "x"
    inner: Inner = field(default_factory=Inner)
    sizes: list[int] = field(default_factory=list)
    maybe: float | None = None


def test_from_dict_builds_nested_dataclasses_and_widens_ints():
    cfg = from_dict(Outer, {"inner": {"width": 4, "ratio": 1}, "sizes": [1, 2], "maybe": 3})
    assert cfg.inner == Inner(width=4, ratio=1.0) and isinstance(cfg.inner.ratio, float)
    assert cfg.sizes == [1, 2] and cfg.maybe == 3.0


def test_misspelled_key_names_the_key_the_closest_match_and_all_valid_keys():
    with pytest.raises(ConfigError) as e:
        from_dict(Outer, {"inner": {"widht": 4}})
    msg = str(e.value)
    assert "Outer.inner" in msg and "'widht'" in msg and "did you mean 'width'" in msg and "ratio" in msg


@pytest.mark.parametrize("data", [{"inner": {"width": "4"}}, {"sizes": 3}, {"inner": 7}, {"name": True},
                                  {"inner": {"width": True}}])
def test_wrong_types_are_rejected(data):
    with pytest.raises(ConfigError):
        from_dict(Outer, data)


def test_every_shipped_preset_loads():
    names = list_presets()
    assert {"tiny", "gpu-1", "apertus-8b", "apertus-70b", "soofi-30b-a3b"} <= set(names)
    for n in names:
        assert load_preset(n).name == n


def test_unknown_preset_and_unknown_section_fail_clearly(tmp_path):
    with pytest.raises(ConfigError, match="no preset 'tinyy'.*tiny"):
        load_preset("tinyy")
    bad = tmp_path / "bad.yaml"
    bad.write_text("preset: bad\nmodle: {}\n")
    with pytest.raises(ConfigError, match="unknown key 'modle'.*did you mean 'model'"):
        load_preset(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_preset(bad)
    with pytest.raises(ConfigError, match="unknown section"):
        load_preset("tiny").section("modle", Inner)


def test_report_settings_reject_unknown_keys_a_chapter_list_and_missing_chapters(tmp_path):
    ini = tmp_path / "s.ini"
    ini.write_text("[report]\npreset = tiny\nchapterz = 00_core\n")
    with pytest.raises(ConfigError, match="chapterz"):
        read_settings(ini)
    ini.write_text("[report]\npreset = tiny\nchapters = 00_core\n")
    with pytest.raises(ConfigError, match="parameters cell is a chapter"):
        read_settings(ini)
    ini.write_text("[report]\nseed = abc\n")
    with pytest.raises(ConfigError, match="s.ini"):
        read_settings(ini)
    with pytest.raises(ConfigError, match="42_nope"):
        check_settings(ReportSettings(chapters=["00_core", "42_nope"]))
    with pytest.raises(ConfigError, match="unknown preset"):
        check_settings(ReportSettings(preset="huge", chapters=["00_core"]))
    with pytest.raises(ConfigError, match="cell_timeout"):
        check_settings(ReportSettings(cell_timeout=0))


def test_project_settings_run_every_chapter_in_sorted_order():
    s = check_settings(read_settings())
    assert s.chapters == sorted(s.chapters) and s.chapters[0] == "00_core"


def test_manifest_lists_every_artifact_with_its_sha256(tmp_path):
    out = tmp_path / "tiny"
    (out / "tables").mkdir(parents=True)
    (out / "tables" / "01_corpus-docs.csv").write_text("a,b\n1,2\n")
    (out / "figures").mkdir()
    (out / "figures" / "01_corpus-langs.png").write_bytes(b"\x89PNG fake")
    written = write_index(ReportSettings(preset="tiny", outputs=str(tmp_path), chapters=["01_corpus"]))
    manifest = json.loads((out / "manifest.json").read_text())
    got = {a["path"]: a["sha256"] for a in manifest["artifacts"]}
    assert got == {p: hashlib.sha256((out / p).read_bytes()).hexdigest()
                   for p in ("figures/01_corpus-langs.png", "tables/01_corpus-docs.csv")}
    assert written == out / "manifest.json" and not (out / "index.html").exists()  # pages (90a) render the index


def test_manifest_lists_only_chapter_artifacts_and_keeps_seconds_out_of_the_tables(tmp_path):
    out = tmp_path / "tiny"
    for name in ("tables/01_corpus-docs.csv", "compliance/kept/00000.jsonl.gz", "tables/99_gone-old.csv",
                 "notebooks/01_corpus.ipynb"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("x")
    write_index(ReportSettings(outputs=str(tmp_path), chapters=["01_corpus"]), {"01_corpus": 12.34})
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(a["path"] for a in manifest["artifacts"]) == ["notebooks/01_corpus.ipynb", "tables/01_corpus-docs.csv"]
    assert manifest["runs"]["01_corpus"]["seconds"] == 12.3 and "seconds" not in json.dumps(manifest["artifacts"])
    assert (out / "timings.csv").read_text().splitlines()[1].startswith("01_corpus,12.3,")
    # a later partial run keeps the other chapter's timing as long as its artifacts are there
    (out / "tables" / "02_robots-x.csv").write_text("y")
    write_index(ReportSettings(outputs=str(tmp_path), chapters=["01_corpus", "02_robots"]), {"02_robots": 1.0})
    runs = json.loads((out / "manifest.json").read_text())["runs"]
    assert runs["01_corpus"]["seconds"] == 12.3 and runs["02_robots"]["seconds"] == 1.0


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def test_git_state_ignores_changes_under_outputs_but_names_other_changed_files(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "configs").mkdir(parents=True)
    (repo / "outputs" / "tiny").mkdir(parents=True)
    (repo / "pyproject.toml").write_text("")
    (repo / "outputs" / "tiny" / "manifest.json").write_text("{}")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    monkeypatch.setenv("OPENPRETRAIN_ROOT", str(repo))
    (repo / "outputs" / "tiny" / "manifest.json").write_text('{"rewritten": true}')
    assert git_state() == {"commit": git(repo, "rev-parse", "HEAD"), "tracked_changes": []}
    (repo / "pyproject.toml").write_text("changed")
    assert git_state()["tracked_changes"] == ["pyproject.toml"]


def test_compare_manifests_names_every_differing_missing_and_new_table_or_figure():
    def art(path, sha):
        return {"path": path, "kind": path.split("/")[0], "chapter": path.split("/")[1].split("-")[0], "sha256": sha}
    old = {"artifacts": [art("tables/00_core-a.csv", "1"), art("figures/00_core-b.png", "2"),
                         art("notebooks/00_core.ipynb", "3"), art("tables/01_corpus-c.csv", "4")]}
    new = {"artifacts": [art("tables/00_core-a.csv", "1"), art("figures/00_core-b.png", "X"),
                         art("notebooks/00_core.ipynb", "Y"), art("tables/00_core-d.csv", "5")]}
    assert compare_manifests(old, new, ["00_core"]) == [
        "differs: figures/00_core-b.png", "not in the committed manifest: tables/00_core-d.csv"]
    assert "missing from the rerun: tables/01_corpus-c.csv" in compare_manifests(old, new)


def test_report_check_passes_on_a_deterministic_chapter_and_catches_a_changed_table(tmp_path):
    s = ReportSettings(outputs=str(tmp_path), device="cpu")
    run_report(s, only=["00_core"])
    manifest = json.loads((s.out_dir / "manifest.json").read_text())
    tables = [a for a in manifest["artifacts"] if a["kind"] == "tables"]
    assert tables
    tables[0]["sha256"] = "0" * 64  # as if the committed table had come out differently
    (s.out_dir / "manifest.json").write_text(json.dumps(manifest))
    # the rerun names the tampered table and nothing else: every other table and figure came out identical
    assert check_report(s, only=["00_core"]) == [f"differs: {tables[0]['path']}"]


def test_report_refuses_an_unwritable_outputs_folder(tmp_path):
    (tmp_path / "a-file").write_text("")  # a folder cannot be made inside a file (permissions do not stop root)
    with pytest.raises(ConfigError, match="cannot write to the outputs folder"):
        run_report(ReportSettings(outputs=str(tmp_path / "a-file" / "sub")), only=["00_core"])


@pytest.mark.parametrize("text,line,problem", [
    ("preset: x\nmodel: [1, 2\n", 3, "invalid YAML"),               # unclosed bracket (reported where input ends)
    ("preset: x\nmodel:\n\tdepth: 2\n", 3, "invalid YAML"),          # a tab for indentation
    ("preset: x\ndescription: a\x00b\n", 2, "invalid YAML"),         # NUL
    ("preset: x\nbomb: &a [1]\nb: *a\n", 2, "anchors and aliases"),  # the first step of an alias bomb
    ("preset: x\nseed: abc\n", 2, r"seed: expected an int in \[0, "),
    ("preset: x\nseed: -1\n", 2, r"seed: expected an int in \[0, "),
    ("preset: x\nseed: 1180591620717411303424\n", 2, r"seed: expected an int in \[0, "),   # 2**70
    ("preset: x\ndevice: [cuda]\n", 2, "device: expected a str"),
])
def test_broken_presets_fail_with_the_file_and_line(tmp_path, text, line, problem):
    path = tmp_path / "x.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"x.yaml:{line}: .*{problem}"):
        load_preset(path)


def test_non_utf8_presets_and_deep_nesting_are_refused_quickly(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_bytes(b"preset: x\ndescription: caf\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_preset(path)
    path.write_text("model: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nested deeper than"):
        load_preset(path)


def test_a_billion_laughs_preset_is_refused_before_expansion(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"] + [
        f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="anchors and aliases"):
        load_preset(path)


@dataclass(kw_only=True)
class Bounded:
    share: float = bounded(0.05, 0, 1)   # a fraction
    count: int = bounded(8, 1)           # at least one
    free: float = 1.0


@pytest.mark.parametrize("data,problem", [({"share": 1.5}, r"share: 1.5 is outside \[0, 1\]"),
                                          ({"share": float("nan")}, "NaN"), ({"free": float("nan")}, "NaN"),
                                          ({"count": 0}, r"count: 0 is outside \[1, inf\]"),
                                          ({"count": -3}, "outside")])
def test_values_outside_a_declared_range_or_nan_are_refused(data, problem):
    with pytest.raises(ConfigError, match=problem) as e:
        from_dict(Bounded, data)
    assert e.value.field == f"Bounded.{next(iter(data))}"
    assert from_dict(Bounded, {"share": 1, "count": 1}) == Bounded(share=1.0, count=1)


def test_a_bad_section_value_names_the_preset_file_and_line(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("preset: x\ncorpus:\n  name: ok\n  inner:\n    width: wide\n")
    with pytest.raises(ConfigError, match=r"x.yaml:5: x.corpus.inner.width: expected int"):
        load_preset(path).section("corpus", Outer)


def one_line_error(capsys, argv) -> str:
    from openpretrain.__main__ import main
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("argv,problem", [
    (["compliance", "--tasks", "0"], "--tasks must be at least 1"),
    (["compliance", "--workers", "-2"], "--workers must be at least 1"),
    (["compliance", "--preset", "some/path.yaml"], "no preset 'some/path.yaml'"),
    (["report", "--preset", "some/path.yaml"], "unknown preset 'some/path.yaml'"),
    (["report", "--outputs", "/dev/null/x", "--only", "00_core"], "cannot write to the outputs folder"),
    (["train", "--preset", "some/path.yaml"], "no preset 'some/path.yaml'"),
])
def test_cli_refuses_bad_flags_with_exit_2_and_one_line(capsys, argv, problem):
    assert problem in one_line_error(capsys, argv)


def test_cli_compliance_runs_a_preset_file_under_the_preset_name(tmp_path, monkeypatch):
    import openpretrain.compliance.pipeline as pipeline
    from openpretrain.__main__ import main
    seen = {}
    monkeypatch.setattr(pipeline, "run_compliance", lambda **kw: seen.update(kw))
    monkeypatch.setenv("OPENPRETRAIN_OUTPUTS", str(tmp_path / "outputs"))   # the output folder is made (and probed) first
    path = tmp_path / "mine.yaml"
    path.write_text("preset: mine\n")
    assert main(["compliance", "--preset", str(path)]) == 0
    assert seen["output_dir"] == tmp_path / "outputs" / "mine" / "compliance" and seen["output_dir"].is_dir()
    assert seen["preset"].name == "mine" and seen["preset"].path == path     # the file, read once and passed on


@pytest.mark.parametrize("command,flag", [("train", "--max-steps"), ("eval", "--checkpoint"), ("serve", "--max-concurrency")])
def test_cli_hands_train_and_eval_flags_to_their_modules(capsys, command, flag):
    from openpretrain.__main__ import main
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0 and f"openpretrain {command}" in (out := capsys.readouterr().out) and flag in out


def test_cli_still_refuses_unknown_flags_of_its_own_commands():
    from openpretrain.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["presets", "--bogus"])
    assert e.value.code == 2


@pytest.mark.parametrize("section,knob,value", [("toxicity", "remove_share", 1.5), ("toxicity", "remove_share", ".nan"),
                                                ("toxicity", "chunk_words", 0), ("robots", "max_bytes", -1),
                                                ("robots", "top_n", -5)])
def test_compliance_knobs_out_of_range_are_refused_with_the_preset_line(tmp_path, section, knob, value):
    from openpretrain.compliance.robots import RobotsConfig
    from openpretrain.compliance.toxicity import ToxicityConfig
    path = tmp_path / "x.yaml"
    path.write_text(f"preset: x\n{section}:\n  {knob}: {value}\n")
    cls = {"robots": RobotsConfig, "toxicity": ToxicityConfig}[section]
    with pytest.raises(ConfigError, match=f"x.yaml:3: .*{knob}"):
        load_preset(path).section(section, cls)


def test_timing_artifacts_are_exempt_from_the_bit_for_bit_check():
    def manifest(sha):
        return {"artifacts": [dict(path=f"tables/11_train-{n}.csv", kind="tables", chapter="11_train", sha256=sha)
                              for n in ("timings", "run")]}
    assert compare_manifests(manifest("a"), manifest("b")) == ["differs: tables/11_train-run.csv"]


def test_chapters_run_with_the_report_root_as_their_outputs_root(tmp_path, monkeypatch):
    import os

    import papermill as pm

    from openpretrain.report import run_chapter
    seen = {}
    monkeypatch.setattr(pm, "execute_notebook", lambda *a, **k: seen.update(root=os.environ.get("OPENPRETRAIN_OUTPUTS")))
    monkeypatch.delenv("OPENPRETRAIN_OUTPUTS", raising=False)
    run_chapter("00_core", ReportSettings(outputs=str(tmp_path), device="cpu"))
    assert seen["root"] == str(tmp_path) and "OPENPRETRAIN_OUTPUTS" not in os.environ


def test_a_partial_check_reuses_the_committed_compliance_output_unless_it_reruns_04a(tmp_path):
    from openpretrain.report import reuse_upstream
    kept = tmp_path / "committed" / "compliance" / "kept"
    kept.mkdir(parents=True)
    (kept / "00000.jsonl.gz").write_bytes(b"docs")
    assert reuse_upstream(tmp_path / "committed", tmp_path / "a", ["08_data", "12_memorization"]) == ["compliance"]
    assert (tmp_path / "a" / "compliance" / "kept" / "00000.jsonl.gz").read_bytes() == b"docs"
    assert reuse_upstream(tmp_path / "committed", tmp_path / "b", ["04a_pipeline", "08_data"]) == []
    assert not (tmp_path / "b").exists()


# --- a preset is data, never a path or an infinity (issue 17, causes 2 and 6) ------------------------------

@pytest.mark.parametrize("name", ["../../x", "a/b", "/etc", "Tiny", "tiny_v2", ""])
def test_a_preset_name_that_is_not_a_plain_name_is_refused(tmp_path, name):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"preset": name}))
    with pytest.raises(ConfigError, match="must be lower-case words joined by hyphens"):
        load_preset(path)


def test_a_preset_named_like_a_path_cannot_write_a_run_outside_runs(tmp_path):
    import shutil
    from openpretrain.training.trainer import main
    name = f"escaped-{tmp_path.name}"                             # runs/../../<name> would land beside the checkout
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({**load_preset("tiny").raw, "preset": f"../../{name}"}))
    try:
        assert main(["--preset", str(path), "--max-steps", "1"]) == 2
        assert not (project_root().parent / name).exists()
    finally:
        shutil.rmtree(project_root().parent / name, ignore_errors=True)


@pytest.mark.parametrize("text", ["preset: x\noptim:\n  lr: .inf\n", "preset: x\noptim:\n  clip: 1.0e+999\n"])
def test_an_infinite_knob_is_refused(tmp_path, text):
    from openpretrain.training.optim import OptimConfig
    (tmp_path / "x.yaml").write_text(text)
    with pytest.raises(ConfigError, match="inf is not a valid value"):
        load_preset(tmp_path / "x.yaml").section("optim", OptimConfig)


def test_a_key_written_twice_is_an_error_not_last_one_wins(tmp_path):
    (tmp_path / "x.yaml").write_text("preset: x\noptim:\n  lr: 1.0e-3\n  lr: 1.0\n")
    with pytest.raises(ConfigError, match=r"x.yaml:4: invalid YAML: key 'lr' appears twice"):
        load_preset(tmp_path / "x.yaml")


# --- the report runner never writes its inputs (issue 17, cause 3) ------------------------------------------

@pytest.mark.parametrize("folder", ["data", "nbs", "configs", "lib", "data/corpus/../x"])
def test_the_report_refuses_outputs_inside_the_checkouts_inputs_and_writes_nothing(tmp_path, capsys, folder):
    from openpretrain.__main__ import main
    before = {p: p.stat().st_mtime_ns for p in (project_root() / folder.split("/")[0]).rglob("*")}
    assert main(["report", "--outputs", str(project_root() / folder), "--only", "00_core"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"inside {folder.split('/')[0]}/" in err
    assert {p: p.stat().st_mtime_ns for p in (project_root() / folder.split("/")[0]).rglob("*")} == before


@pytest.mark.parametrize("text", ["preset = tiny\nseed = 0\n", "[report]\nseed = 0\nseed = 1\n"])
def test_a_settings_file_that_is_not_one_fails_in_one_line(tmp_path, text):
    (tmp_path / "settings.ini").write_text(text)
    with pytest.raises(ConfigError, match=r"settings.ini: not a settings file \((File contains no section headers|While reading)"):
        read_settings(tmp_path / "settings.ini")


# --- reproducible beyond the machine that made it (issue 19) ----------------------------------------------

def _two_runs(tmp_path, committed_text, fresh_text, tolerance=None, isa=("AVX512", "AVX2")):
    "A committed and a fresh output folder holding one paper-vs-ours table, run under the two `isa` fingerprints."
    path = "tables/11_train-paper-vs-ours.csv"
    manifests = []
    for name, text, aten in (("old", committed_text, isa[0]), ("new", fresh_text, isa[1])):
        (tmp_path / name / "tables").mkdir(parents=True)
        (tmp_path / name / path).write_text(text)
        if tolerance:
            (tmp_path / name / "tables/11_train-paper-vs-ours.tolerance.json").write_text(json.dumps(tolerance))
        manifests.append({"artifacts": [dict(path=path, kind="tables", chapter="11_train", sha256=text)],
                          "runs": {"11_train": {"numerics": {"aten": aten}}}})
    return compare_manifests(*manifests, dirs=(tmp_path / "old", tmp_path / "new"))


ROW = "quantity,paper,ours,why they differ,verdict,rule\nfinal loss,1.906,{loss},tiny,{verdict},gap {loss}\n"
TOL = {"rel": 1e-3, "abs": 0.0, "why": "fp32 training over 24 steps"}


def test_on_other_numerics_a_table_may_move_within_its_declared_tolerance_and_no_further(tmp_path):
    a = ROW.format(loss="7.70213", verdict="reproduces")
    assert _two_runs(tmp_path / "1", a, ROW.format(loss="7.70251", verdict="reproduces"), TOL) == []
    far = _two_runs(tmp_path / "2", a, ROW.format(loss="7.7102", verdict="reproduces"), TOL)
    assert far == ["differs beyond its tolerance: tables/11_train-paper-vs-ours.csv (7.70213 vs 7.7102; rel 0.001, abs 0)"]


def test_on_other_numerics_a_verdict_must_not_move_even_inside_the_tolerance(tmp_path):
    moved = _two_runs(tmp_path, ROW.format(loss="7.70213", verdict="reproduces"),
                      ROW.format(loss="7.70214", verdict="same direction, weaker"), TOL)
    assert len(moved) == 1 and "text" in moved[0]


def test_a_table_without_a_tolerance_must_match_exactly_on_other_numerics_and_any_table_on_the_same(tmp_path):
    a, b = ROW.format(loss="7.70213", verdict="reproduces"), ROW.format(loss="7.70214", verdict="reproduces")
    assert "declares no tolerance" in _two_runs(tmp_path / "1", a, b)[0]
    assert _two_runs(tmp_path / "2", a, b, TOL, isa=("AVX2", "AVX2")) == [
        "differs: tables/11_train-paper-vs-ours.csv"]  # equal fingerprints: bit for bit, tolerance or not


def test_portable_numerics_pin_every_chapters_kernels_and_the_fingerprint_records_it(tmp_path, monkeypatch):
    import os

    import papermill as pm

    from openpretrain.report import PORTABLE_ENV, machine_numerics, run_chapter
    seen = {}
    monkeypatch.setattr(pm, "execute_notebook", lambda *a, **k: seen.update(os.environ))
    run_chapter("00_core", ReportSettings(outputs=str(tmp_path), device="cpu", numerics="portable"))
    assert all(seen[k] == v for k, v in PORTABLE_ENV.items())
    portable = machine_numerics(ReportSettings(numerics="portable"))
    assert portable["aten"] == "AVX2" and portable["env"]["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def test_a_pinned_isa_compiles_into_its_own_inductor_cache_even_when_the_parent_keyed_one(tmp_path):
    import os
    import subprocess
    import sys
    code = "from openpretrain.core import compile_cache; print(compile_cache())"
    def folder(**env):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
        return Path(out.stdout.strip())
    native = folder(TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    pinned = folder(TORCHINDUCTOR_CACHE_DIR=str(native), ATEN_CPU_CAPABILITY="avx2")  # inherited a keyed folder
    assert native.parent == pinned.parent == tmp_path and native != pinned


def test_the_report_prints_a_progress_line_with_an_eta_from_the_last_timings(tmp_path, capsys, monkeypatch):
    import openpretrain.report as report
    s = ReportSettings(outputs=str(tmp_path), device="cpu")
    s.out_dir.mkdir(parents=True)
    (s.out_dir / "timings.csv").write_text("chapter,seconds,commit\n00_core,120.0,abc\n01_corpus,60.0,abc\n")
    monkeypatch.setattr(report, "run_chapter", lambda chapter, s: 1.0)
    monkeypatch.setattr(report, "write_index", lambda *a, **k: None)
    run_report(s, only=["00_core", "01_corpus"])
    err = capsys.readouterr().err
    assert "report [1/2] 00_core (last run 120 s; about 3 min left" in err and "[2/2] 01_corpus" in err


def test_a_column_may_carry_its_own_tolerance_and_a_truncated_table_fails(tmp_path):
    a = ROW.format(loss="7.70213", verdict="reproduces")
    loose_ours = dict(TOL, columns={"ours": [0, 0.1]})                     # ours may move 0.1; the rule keeps 1e-3
    assert _two_runs(tmp_path / "1", a, ROW.format(loss="7.75", verdict="reproduces"), loose_ours) == [
        "differs beyond its tolerance: tables/11_train-paper-vs-ours.csv, column 'rule' (7.70213 vs 7.75; rel 0.001, abs 0)"]
    assert _two_runs(tmp_path / "2", a, a.replace("gap 7.70213", "gap 7.7022"), loose_ours) == []
    assert _two_runs(tmp_path / "3", a, a.splitlines()[0] + "\n", loose_ours) == [
        "differs beyond its tolerance: tables/11_train-paper-vs-ours.csv (another header or number of rows)"]


@pytest.mark.parametrize("text", ['{"rel": 1e-3', '{"rel": -1, "abs": 0}', '[1, 2]', '{"rel": "x", "abs": 0}', "",
                                  '{"rel": 0, "abs": 1, "columns": {"loss": [1]}}', '{"rel": 0, "abs": 1, "columns": [1, 2]}',
                                  '{"rel": 0, "abs": 1, "columns": {"loss": [-1, 0]}}'])
def test_a_damaged_tolerance_file_fails_the_check_in_one_line_naming_it(tmp_path, text):
    a, b = ROW.format(loss="7.70213", verdict="reproduces"), ROW.format(loss="7.70214", verdict="reproduces")
    _two_runs(tmp_path, a, a)  # lay out the folders, then damage the committed side's tolerance
    (tmp_path / "old/tables/11_train-paper-vs-ours.tolerance.json").write_text(text)
    (tmp_path / "new/tables/11_train-paper-vs-ours.csv").write_text(b)
    committed = {"artifacts": [dict(path="tables/11_train-paper-vs-ours.csv", kind="tables", chapter="11_train",
                                    sha256="a")], "runs": {"11_train": {"numerics": {"aten": "AVX512"}}}}
    fresh = dict(committed, artifacts=[dict(committed["artifacts"][0], sha256="b")],
                 runs={"11_train": {"numerics": {"aten": "AVX2"}}})
    with pytest.raises(ConfigError, match="11_train-paper-vs-ours.tolerance.json: not a tolerance"):
        compare_manifests(committed, fresh, dirs=(tmp_path / "old", tmp_path / "new"))


def test_a_latin1_settings_file_is_one_config_error_and_exit_2(tmp_path, capsys):
    from openpretrain.__main__ import main
    ini = tmp_path / "settings.ini"
    ini.write_bytes("[report]\n# préréglage\npreset = tiny\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"settings.ini: not UTF-8 \(byte 13\)"):
        read_settings(ini)
    assert main(["report", "--settings", str(ini), "--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("openpretrain report: ") and "not UTF-8" in err


@pytest.mark.parametrize("where", ["a regular file", "under a regular file", "under /proc"])
def test_a_compliance_output_dir_that_cannot_be_written_is_one_line_and_exit_2(tmp_path, capsys, where):
    from openpretrain.__main__ import main
    (tmp_path / "file").write_text("not a folder")
    out = {"a regular file": tmp_path / "file", "under a regular file": tmp_path / "file" / "compliance",
           "under /proc": Path("/proc/openpretrain-compliance")}[where]
    assert main(["compliance", "--preset", "tiny", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"openpretrain compliance: --output-dir {out}: ")
    assert (tmp_path / "file").read_text() == "not a folder"


def test_presets_under_a_root_that_is_no_checkout_is_one_line_naming_it_and_exit_2(tmp_path, capsys, monkeypatch):
    from openpretrain.__main__ import main
    for root in (tmp_path / "nonexistent", tmp_path):                  # no folder; a folder without configs/
        monkeypatch.setenv("OPENPRETRAIN_ROOT", str(root))
        assert main(["presets"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and f"{root} is not an openpretrain checkout" in err
