"""A run's plan (chapter 10b): every preset mistake is one ConfigError naming the key, found before any compute."""
import copy
import math

import pytest
import yaml

from openpretrain.core import ConfigError, Preset, configs_dir, load_preset
from openpretrain.training.curriculum import load_curriculum
from openpretrain.training.plan import plan

TINY = load_preset("tiny")


def tiny_with(**sections) -> Preset:
    "The tiny preset with some sections' keys replaced (`optim={'lr': -1}`); optim.schedule merges one level down."
    raw = copy.deepcopy(TINY.raw)
    for section, changes in sections.items():
        for key, value in changes.items():
            if isinstance(value, dict) and isinstance(raw[section].get(key), dict):
                raw[section][key].update(value)
            else:
                raw[section][key] = value
    return Preset("tiny", TINY.path, raw)


@pytest.mark.parametrize("sections,problem", [
    ({"optim": {"clip": -1.0}}, r"optim.clip: -1.0 is outside \[0, inf\]"),                   # loss would climb
    ({"optim": {"schedule": {"warmup_start": -0.5}}}, r"warmup_start: -0.5 is outside \[0, inf\]"),  # a negative lr
    ({"optim": {"batch_size": -8}}, r"optim.batch_size: -8 is outside \[1, inf\]"),
    ({"optim": {"batch_size": 0}}, r"optim.batch_size: 0 is outside \[1, inf\]"),
    ({"optim": {"lr": -2e-3}}, r"optim.lr: -0.002 is outside \[0, inf\]"),
    ({"optim": {"eps": -1e-8}}, r"optim.eps: -1e-08 is outside \[0, inf\]"),
    ({"optim": {"weight_decay": -0.1}}, r"optim.weight_decay: -0.1 is outside \[0, inf\]"),
    ({"optim": {"betas": [0.9, 0.999]}}, r"optim.betas: ademamix takes 3 betas"),
    ({"optim": {"betas": [0.9, 1.5, 0.999]}}, r"optim.betas: ademamix takes 3 betas in \[0, 1\)"),
    ({"optim": {"name": "adamw"}}, r"optim.betas: adamw takes 2 betas"),
    ({"optim": {"name": "sgd"}}, r"optim.name: unknown optimiser 'sgd'"),
    ({"optim": {"lr": math.inf}}, r"optim.lr: inf is not a valid value"),
    ({"optim": {"t_beta3": 0}}, r"optim.t_beta3: 0 is outside \[1, inf\]"),
    ({"tokenizer": {"name": "bpe-bal-9k"}}, r"tiny.tokenizer: unknown tokenizer 'bpe-bal-9k'"),
    ({"tokenizer": {"name": "bpe-bal-2k", "vocab_size": 8192}}, r"tiny.tokenizer: tokenizer 'bpe-bal-2k' has 2,048 ids"),
    ({"data": {"seq_len": 0}}, r"data.seq_len: 0 is outside \[1, inf\]"),
])
def test_a_value_that_cannot_train_fails_in_plan_naming_its_key(sections, problem):
    with pytest.raises(ConfigError, match=problem):
        plan(tiny_with(**sections))


@pytest.mark.parametrize("max_steps", [0, -3])
def test_max_steps_below_one_is_refused_not_read_as_the_whole_budget(max_steps):
    with pytest.raises(ConfigError, match=f"max_steps must be ≥ 1, got {max_steps}"):
        plan(TINY, max_steps)


def test_a_selection_no_document_matches_fails_in_plan_before_tokenizing(tmp_path):
    curriculum = yaml.safe_load((configs_dir() / "curricula" / "tiny.yaml").read_text())
    curriculum["stages"][0]["sources"][0]["select"]["source"] = ["fortunes-xx"]      # a typo of fortunes-de
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(curriculum))
    with pytest.raises(ConfigError, match="no embedded document has source = fortunes-xx"):
        plan(tiny_with(data={"curriculum": str(tmp_path / "typo.yaml")}))


@pytest.mark.parametrize("text,problem", [
    ("name: x\nstages: &s [{name: a, tokens: 1}]\nagain: *s\n", "anchors and aliases are not allowed"),
    ("name: x\nunit: B\nunit: T\nstages: []\n", "key 'unit' appears twice"),
])
def test_curricula_are_read_as_defensively_as_presets(tmp_path, text, problem):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError, match=f"c.yaml:[0-9]+: invalid YAML: {problem}"):
        load_curriculum(tmp_path / "c.yaml")


def test_a_plan_without_a_curriculum_skips_the_budget_and_has_no_token_loader():
    from openpretrain.tokenization import load_tokenizer
    from openpretrain.training.plan import fingerprint, token_loader
    pl = plan(tiny_with(data={"curriculum": None}))          # SFT: its loader brings the rows (chapter 16)
    assert pl.curriculum is None and fingerprint(pl)["curriculum"] is None
    with pytest.raises(ConfigError, match="data.curriculum is null"):
        token_loader(pl, load_tokenizer(pl.tokenizer))
