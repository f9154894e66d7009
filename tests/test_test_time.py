"""Test-time compute (chapter 18): the grader, the step labels and the generator, against hand-worked
expectations."""
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openpretrain.core import ConfigError
from openpretrain.evaluation.test_time import (LANGUAGES, Problem, WordProblemConfig, answer_line, extract_answer,
                                               is_correct, parse_step, problems, step_holds, step_labels)


# --- the grader ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [
    ("3 + 4 = 7\nAnswer: 7", 7), ("answer:7", 7), ("  ANSWER :  +7.  ", 7), ("Answer: 12,345", 12345),
    ("Answer: 12.345", 12345), ("Answer: 1 234 567", 1234567), ("Answer: 1\u202f234", 1234), ("Answer: 1'234", 1234),
    ("Answer: -8", -8), ("Answer: −8", -8), ("Answer: 7\nAnswer: 9", 7), ("prose first\n\nAnswer: 0042", 42),
])
def test_grader_reads_the_first_answer_line_in_every_written_form(text, value):
    assert extract_answer(text) == value
    assert is_correct(text, value) and not is_correct(text, value + 1)


@pytest.mark.parametrize("text", [
    "Answer: 7 apples", "Answer: 7.5", "Answer: 1,23", "Answer: 1,234.5", "Answer: 1.234,5", "Answer: 1,234'567",
    "Answer: 12,34,567", "Answer: +-7", "Answer:", "Answer: seven", "7", "The answer is 7", "", None, 7, b"Answer: 7",
])
def test_grader_marks_malformed_answers_wrong(text):
    assert extract_answer(text) is None
    assert not is_correct(text, 7)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_grader_never_raises_on_arbitrary_text(text):
    assert extract_answer(text) is None or isinstance(extract_answer(text), int)


@settings(max_examples=200, deadline=None)
@given(st.integers(-10**12, 10**12))
def test_grader_reads_back_every_integer_with_or_without_separators(n):
    assert extract_answer(answer_line(n)) == n
    assert extract_answer(f"Answer: {n:,}") == n
    assert extract_answer(f"Answer: {n:_}.") == n


# --- the step checker ---------------------------------------------------------------------------------------------

def test_step_parser_and_arithmetic_by_hand():
    assert parse_step("12 + 5 = 17") == (12, "+", 5, 17)
    assert parse_step(" 3 × 4 = 12. ") == (3, "*", 4, 12)
    assert parse_step("5 - -3 = 8") == (5, "-", -3, 8) and step_holds((5, "-", -3, 8))
    assert parse_step("x + 1 = 2") is None and parse_step("12 + 5 = 17 apples") is None
    assert step_holds((12, "/", 4, 3)) and not step_holds((13, "/", 4, 3)) and not step_holds((0, "/", 0, 5))
    assert not step_holds((12, "*", 5, 61))


HAND = Problem(id="hand", language="eng", level=2, prompt="…", steps=("12 + 5 = 17", "17 - 3 = 14", "14 * 2 = 28"),
               answer=28)


def test_step_labels_mark_the_first_arithmetic_error_and_what_follows():
    wrong_sub = "12 + 5 = 17\n17 - 3 = 15\n15 * 2 = 30\nAnswer: 30"
    assert step_labels(wrong_sub) == [True, False, True, True]          # equations only: later steps hold
    assert step_labels(wrong_sub, HAND) == [True, False, False, False]  # against the problem: off track after it


def test_step_labels_against_the_problem_accept_commuted_operands_and_reject_wrong_operations():
    assert step_labels("5 + 12 = 17\n17 - 3 = 14\n2 * 14 = 28\nAnswer: 28", HAND) == [True] * 4
    assert step_labels("12 + 5 = 17\n17 + 3 = 20\nAnswer: 20", HAND) == [True, False, False]
    assert step_labels("12 + 5 = 17\n17 - 3 = 14\n14 * 2 = 28\n28 + 1 = 29\nAnswer: 29", HAND) == [True] * 3 + [False] * 2


def test_step_labels_stop_at_the_answer_line_and_check_it_states_the_last_result():
    assert step_labels("4 + 4 = 8\nAnswer: 9") == [True, False]
    assert step_labels("4 + 4 = 8\n\nAnswer: 8.\n1 + 1 = 3") == [True, True]
    assert step_labels("Answer: 8") == [False] and step_labels("Answer: 28", HAND) == [True]
    assert step_labels("so it is 8\nAnswer: 8") == [False, False]


# --- the generator ------------------------------------------------------------------------------------------------

def test_generator_is_seeded_and_a_prefix_of_a_longer_stream():
    assert problems(20, seed=3) == problems(20, seed=3)
    assert problems(20, seed=3) == problems(200, seed=3)[:20]
    assert problems(20, seed=3) != problems(20, seed=4)


def test_generator_spreads_levels_and_languages_evenly_with_harder_levels_longer_and_larger():
    cfg = WordProblemConfig()
    items = problems(500, seed=0, cfg=cfg)
    assert np.bincount([p.level for p in items])[1:].tolist() == [100] * 5
    assert sorted({p.language for p in items}) == sorted(LANGUAGES) and len(LANGUAGES) >= 5
    assert {(p.level, p.language) for p in items} == {(lv, lang) for lv in range(1, 6) for lang in LANGUAGES}
    assert all(len(p.steps) == cfg.steps[p.level - 1] for p in items)
    medians = [np.median([p.answer for p in items if p.level == lv]) for lv in range(1, 6)]
    assert medians == sorted(medians) and medians[0] < medians[-1] / 20


def test_every_generated_reference_solution_is_graded_right_step_by_step():
    for p in problems(250, seed=1):
        assert isinstance(p.answer, int) and p.answer >= 1
        assert is_correct(p.solution, p.answer) and step_labels(p.solution, p) == [True] * (len(p.steps) + 1)
        numbers = [parse_step(p.steps[0])[0], *(parse_step(s)[2] for s in p.steps)]  # the start, then each operand
        assert all(re.search(rf"(?<![0-9]){n}(?![0-9])", p.prompt) for n in numbers)  # … all told in the story


def test_generator_config_rejects_unknown_languages_and_ragged_levels():
    with pytest.raises(ConfigError, match="subset"):
        WordProblemConfig(languages=["eng", "xyz"])
    with pytest.raises(ConfigError, match="one value per level"):
        WordProblemConfig(steps=[2, 3])
