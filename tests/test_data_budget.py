"""Exact token budgets: a curriculum's stages counted as published iterations, and the trainer's plan checked against them."""
import copy
from pathlib import Path

import pytest
import yaml

from openpretrain.core import ConfigError, configs_dir
from openpretrain.training.curriculum import load_curriculum, run_stages, validate
from openpretrain.training.plan import plan

PER_ITERATION = 3072 * 8192                                   # Soofi §2.1: global batch 3,072 × 8,192 tokens
TABLE_2_8K = 254 + 794_474 + 198_682 + 62_590 + 11_920        # warm-up, stable, decay, constant, final annealing


def soofi_with_curriculum(tmp_path: Path, edit) -> Path:
    "The soofi preset reading an edited copy of its curriculum."
    curriculum = yaml.safe_load((configs_dir() / "curricula" / "soofi-30b-a3b.yaml").read_text())
    edit(curriculum)
    (tmp_path / "edited.yaml").write_text(yaml.safe_dump(curriculum))
    preset = yaml.safe_load((configs_dir() / "soofi-30b-a3b.yaml").read_text())
    preset["data"]["curriculum"] = str(tmp_path / "edited.yaml")
    path = tmp_path / "soofi-edited.yaml"
    path.write_text(yaml.safe_dump(preset))
    return path


def test_soofi_preset_plans_every_table_2_iteration_at_8k():
    pl = plan("soofi-30b-a3b")
    assert pl.steps == TABLE_2_8K == 1_067_920                 # §2.1: the final annealing targets 1,067,920
    assert pl.schedule.tokens_at(pl.steps) == TABLE_2_8K * PER_ITERATION
    assert load_curriculum("soofi-30b-a3b").budget(8192) == TABLE_2_8K * PER_ITERATION


def test_soofi_curriculum_without_the_discarded_annealing_fails_naming_both_totals(tmp_path):
    def drop_discarded(c):
        del c["stages"][1]["discarded_iterations"]
    with pytest.raises(ConfigError) as err:
        plan(soofi_with_curriculum(tmp_path, drop_discarded))
    needed, held = TABLE_2_8K * PER_ITERATION, 1_056_000 * PER_ITERATION   # §2.1: the constant annealing ends at 1,056,000
    assert f"need {needed:,} tokens" in str(err.value) and f"has {held:,} at seq_len 8,192" in str(err.value)


def test_a_schedule_longer_than_the_curriculum_fails_naming_both_totals(tmp_path):
    def shorter_phase_2(c):
        c["stages"][1]["iterations"] -= 1_000
        c["stages"][1]["tokens"] = c["stages"][1]["iterations"] * PER_ITERATION / 1e9
    with pytest.raises(ConfigError, match=f"need {TABLE_2_8K * PER_ITERATION:,} tokens but curriculum 'soofi-30b-a3b' has "
                                          f"{(TABLE_2_8K - 1_000) * PER_ITERATION:,}"):
        plan(soofi_with_curriculum(tmp_path, shorter_phase_2))


@pytest.mark.parametrize("preset", ["apertus-8b", "apertus-70b", "gpu-1", "tiny", "tiny-hybrid"])
def test_other_presets_still_plan_their_whole_schedule(preset):
    pl = plan(preset)
    assert pl.steps == pl.schedule.total_steps > 0


def test_long_context_phase_is_a_separate_run():
    c = load_curriculum("soofi-30b-a3b")
    assert [st.name for st in run_stages(c, 8192).stages] == ["phase-1", "phase-2"]
    assert [st.name for st in run_stages(c, 1_048_576).stages] == ["phase-3"]
    assert c.budget(1_048_576) == 2_000 * 48 * 1_048_576      # §2.2: 2,000 iterations of 48 × 1,048,576


def test_printed_budget_off_by_a_digit_from_its_iterations_fails():
    c = copy.deepcopy(load_curriculum("soofi-30b-a3b"))
    c.stages[0].iterations = 79_472
    with pytest.raises(ConfigError, match=r"stages\[0\] \(phase-1\)\.tokens = 20000 B but iterations × "
                                          r"tokens_per_iteration = 79,472 × 25,165,824"):
        validate(c)


def test_published_total_must_be_what_the_stages_count():
    c = copy.deepcopy(load_curriculum("soofi-30b-a3b"))
    c.total = 29_500                                           # Table 3's pool total, not its consumed total
    with pytest.raises(ConfigError, match=r"total = 29500 B but its stages count 26,675,773,440,000 tokens"):
        validate(c)
