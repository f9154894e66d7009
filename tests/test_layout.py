"""The repository's layout rules: sorted notebook order is dependency order, and chapters are found, not listed."""
import ast
import json
import subprocess
from pathlib import Path

import pytest

from openpretrain.core import project_root
from openpretrain.report import ARTIFACT_KINDS, discover_chapters, read_settings

NBS = project_root() / "nbs"
LIB = project_root() / "lib"


def notebook_cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def exported_module(path: Path) -> str | None:
    "The `#| default_exp` target of a notebook, as a dotted module under openpretrain."
    for cell in notebook_cells(path):
        for line in "".join(cell["source"]).splitlines():
            if line.startswith("#| default_exp "):
                return "openpretrain." + line.split()[-1]
    return None


def module_file(module: str) -> Path:
    return LIB / Path(*module.split(".")).with_suffix(".py")


def imported_modules(module: str) -> set[str]:
    "Every openpretrain module the generated file imports, absolute or relative, at any depth of the code."
    package = module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(module_file(module).read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # `from . import ledger` imports a module
    return {m for m in found if m.startswith("openpretrain.") and module_file(m).is_file()}


NOTEBOOKS = sorted(NBS.glob("*.ipynb"))
EXPORTERS = {m: nb.stem for nb in NOTEBOOKS if (m := exported_module(nb))}


def test_every_exported_module_is_generated_by_exactly_one_notebook():
    modules = [exported_module(nb) for nb in NOTEBOOKS if exported_module(nb)]
    assert len(modules) == len(set(modules))
    assert all(module_file(m).is_file() for m in modules)


@pytest.mark.parametrize("notebook", [nb.stem for nb in NOTEBOOKS if exported_module(nb)])
def test_a_notebook_imports_only_from_notebooks_that_sort_before_it(notebook):
    module = exported_module(NBS / f"{notebook}.ipynb")
    later = {m: EXPORTERS[m] for m in imported_modules(module) if m != module and EXPORTERS.get(m, "") >= notebook}
    assert not later, f"{notebook} ({module}) imports modules of notebooks that sort after it: {later}"


def test_the_import_scan_sees_relative_and_absolute_imports():
    assert "openpretrain.core" in imported_modules("openpretrain.report")      # `from .core import …`
    assert "openpretrain.compliance.ledger" in imported_modules("openpretrain.compliance.pii")  # absolute


def test_chapters_are_exactly_the_notebooks_with_a_parameters_cell_in_sorted_order():
    with_parameters = [nb.stem for nb in NOTEBOOKS
                       if any("parameters" in c.get("metadata", {}).get("tags", []) for c in notebook_cells(nb))]
    assert discover_chapters() == with_parameters == sorted(with_parameters)
    assert read_settings().chapters == with_parameters
    assert {"00_core", "03_pii", "05_tokenizers"} <= set(with_parameters)
    assert not {"90_report", "91_cli"} & set(with_parameters)  # infrastructure, not chapters


def test_a_new_notebook_with_a_parameters_cell_joins_the_report(tmp_path):
    cell = {"cell_type": "code", "metadata": {"tags": ["parameters"]}, "source": ["preset = 'tiny'"]}
    for stem, cells in (("00_a", [cell]), ("04a_lib", []), ("08_new", [cell])):
        (tmp_path / f"{stem}.ipynb").write_text(json.dumps({"cells": cells}))
    assert discover_chapters(tmp_path) == ["00_a", "08_new"]


def test_the_report_folders_the_manifest_lists_are_not_git_ignored():
    probe = [f"outputs/tiny/{kind}/00_core-x" for kind in ARTIFACT_KINDS]
    ignored = subprocess.run(["git", "check-ignore", *probe], cwd=project_root(), capture_output=True, text=True)
    assert ignored.stdout.split() == []


FAMILIES = {"openpretrain.models.dense", "openpretrain.models.hybrid", "openpretrain.models.mamba2", "openpretrain.models.moe"}
OUTSIDE_MODELS = sorted(m for m in EXPORTERS if not m.startswith("openpretrain.models."))


def family_fields_read(module: str) -> list[int]:
    "Lines where a module reads `max_seq_len` (an attribute or a key): a dense-family field the registry answers for."
    tree = ast.parse(module_file(module).read_text())
    return [n.lineno for n in ast.walk(tree) if (isinstance(n, ast.Attribute) and n.attr == "max_seq_len")
            or (isinstance(n, ast.Constant) and n.value == "max_seq_len")]


@pytest.mark.parametrize("module", OUTSIDE_MODELS)
def test_the_registry_is_the_only_door_to_a_model_family(module):
    "No module outside models/ imports a family's module or reads its context length: it asks the registry."
    assert not imported_modules(module) & FAMILIES, f"{module} imports {imported_modules(module) & FAMILIES}"
    assert not family_fields_read(module), f"{module} reads max_seq_len at lines {family_fields_read(module)}"


@pytest.mark.parametrize("module", OUTSIDE_MODELS)
def test_only_the_checkpoint_module_writes_a_checkpoint_state(module):
    "A checkpoint's state.json is written (and named) by training.checkpoint alone: the others go through its functions."
    tree = ast.parse(module_file(module).read_text())
    named = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value == "state.json"]
    assert module == "openpretrain.training.checkpoint" or not named, f"{module} names state.json at lines {named}"


def test_the_door_guards_can_fail():
    "The scans see what they guard against: a family read, a family imported, the checkpoint module naming state.json."
    assert family_fields_read("openpretrain.models.dense")
    assert imported_modules("openpretrain.models.hybrid") & FAMILIES            # the hybrid is built of Mamba-2 and MoE
    tree = ast.parse(module_file("openpretrain.training.checkpoint").read_text())
    assert any(isinstance(n, ast.Constant) and n.value == "state.json" for n in ast.walk(tree))
