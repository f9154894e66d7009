"""Presets, typed configs and the report runner's settings, index and manifest."""
import hashlib
import json
from dataclasses import dataclass, field

import pytest

from openpretrain.core import ConfigError, from_dict, list_presets, load_preset
from openpretrain.report import ReportSettings, check_settings, read_settings, write_index


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


def test_report_settings_reject_unknown_keys_and_missing_chapters(tmp_path):
    ini = tmp_path / "s.ini"
    ini.write_text("[report]\npreset = tiny\nchapterz = 00_core\n")
    with pytest.raises(ConfigError, match="chapterz"):
        read_settings(ini)
    ini.write_text("[report]\npreset = tiny\nchapters = 00_core 42_nope\n")
    with pytest.raises(ConfigError, match="42_nope"):
        check_settings(read_settings(ini))
    with pytest.raises(ConfigError, match="unknown preset"):
        check_settings(ReportSettings(preset="huge", chapters=["00_core"]))


def test_project_settings_list_existing_chapters_in_order():
    s = check_settings(read_settings())
    assert s.chapters == sorted(s.chapters) and s.chapters[0] == "00_core"


def test_manifest_lists_every_artifact_with_its_sha256(tmp_path):
    out = tmp_path / "tiny"
    (out / "tables").mkdir(parents=True)
    (out / "tables" / "01_corpus-docs.csv").write_text("a,b\n1,2\n")
    (out / "figures").mkdir()
    (out / "figures" / "01_corpus-langs.png").write_bytes(b"\x89PNG fake")
    index = write_index(ReportSettings(preset="tiny", outputs=str(tmp_path), chapters=["01_corpus"]))
    manifest = json.loads((out / "manifest.json").read_text())
    got = {a["path"]: a["sha256"] for a in manifest["artifacts"]}
    assert got == {p: hashlib.sha256((out / p).read_bytes()).hexdigest()
                   for p in ("figures/01_corpus-langs.png", "tables/01_corpus-docs.csv")}
    page = index.read_text()
    assert "figures/01_corpus-langs.png" in page and "<table" in page and manifest["commit"] in page
