"""Test-time compute, the pure half of chapter 18 (17c_testbed, 17d_strategies): the grader, the step labels, the
generator, the selectors, beam search's bookkeeping and cost, revisions, compute-optimal selection, the FLOPs match
and the bootstrap, against hand-worked expectations."""
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openpretrain.core import ConfigError, from_dict
from openpretrain.evaluation.strategies import (SearchConfig, StudyConfig, accuracy_at_budget, aggregate, beam_search,
                                                best_of_n, bootstrap_ci, compute_optimal, difficulty_bins,
                                                flops_multiplier, inference_flops, majority_vote, matched_samples,
                                                oracle_bins, predicted_bins, pretrain_flops, revision_chains,
                                                select_chains, selection_stability, solution_prompt, splits, two_folds,
                                                weighted_best_of_n)
from openpretrain.evaluation.testbed import (LANGUAGES, Problem, WordProblemConfig, answer_line, extract_answer,
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


# --- selectors ----------------------------------------------------------------------------------------------------

def test_weighted_best_of_n_sums_the_scores_of_equal_answers():
    answers, scores = [7, 3, 3, 3, None, 9], [0.85, 0.3, 0.3, 0.3, 1.0, 0.2]
    assert weighted_best_of_n(answers, scores) == 3   # 3: 0.9 > 7: 0.85 > 9: 0.2; None never wins
    assert best_of_n(answers, scores) == 7            # the single best readable sample
    assert majority_vote(answers) == 3
    assert weighted_best_of_n([5, 6, 6, 5], [0.5, 0.25, 0.25, 0.0]) == 5  # 0.5 each: the first seen wins


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(0, 4)), min_size=1, max_size=12))
def test_weighted_best_of_n_with_equal_scores_is_majority_voting(answers):
    assert weighted_best_of_n(answers, [0.5] * len(answers)) == majority_vote(answers)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=12, unique=True))
def test_weighted_best_of_n_over_distinct_answers_is_plain_best_of_n(scores):
    answers = list(range(len(scores)))
    assert weighted_best_of_n(answers, scores) == best_of_n(answers, scores) == int(np.argmax(scores))


def test_accuracy_at_budget_is_the_chance_the_right_sample_is_drawn():
    # best-of-N picks sample 0 whenever it is in the subset: 2 of 3 two-sample subsets hold it
    assert accuracy_at_budget(best_of_n, [1, 2, 2], [0.9, 0.1, 0.1], 1, n=2, draws=3000) == pytest.approx(2 / 3, abs=0.03)
    assert accuracy_at_budget(best_of_n, [1, 2, 2], [0.9, 0.1, 0.1], 1, n=3) == 1.0
    with pytest.raises(ValueError, match="pool of at least 4"):
        accuracy_at_budget(best_of_n, [1, 2, 2], [0.9, 0.1, 0.1], 1, n=4)


def test_prm_aggregations_last_min_and_product_by_hand():
    scores = [0.5, 0.25, 0.75]
    assert (aggregate(scores, "last"), aggregate(scores, "min"), aggregate(scores, "prod")) == (0.75, 0.25, 0.09375)
    assert aggregate(scores) == 0.75  # the study's choice is the default
    assert aggregate([0.9] * 20, "prod") < aggregate([0.9] * 2, "prod")  # the product punishes length
    with pytest.raises(ValueError):
        aggregate([], "last")


# --- beam search --------------------------------------------------------------------------------------------------

def index_steps(prefixes):
    "A deterministic 'sampler': the j-th prefix of a round gets step j."
    return list(range(len(prefixes)))


def sum_scores(prefixes):
    return [sum(p) for p in prefixes]


def test_beam_search_keeps_the_top_n_over_m_and_spends_n_steps_a_round():
    # round 1: (0) (1) (2) (3), keep (3) (2); round 2: (3,0) (2,1) (3,2) (2,3) = 3 3 5 5, keep (3,2) (2,3);
    # round 3: four beams of three steps end
    r = beam_search(index_steps, sum_scores, lambda p: len(p) == 3, SearchConfig(n=4, beam_width=2))
    assert r.beams == [(3, 2, 0), (2, 3, 1), (3, 2, 2), (2, 3, 3)]
    assert r.scores.tolist() == [5, 6, 7, 8]
    assert (r.iterations, r.step_generations, r.budget, r.generation_equivalents) == (3, 12, 4, 4.0)


def test_beam_search_returns_the_first_n_beams_to_end_and_counts_what_they_cost():
    # a step 0 ends a beam, as does a third step: (0) ends in round 1, (3,0) in round 2, then four end at once
    done = lambda p: p[-1] == 0 or len(p) == 3
    r = beam_search(index_steps, sum_scores, done, SearchConfig(n=4, beam_width=2))
    assert r.beams == [(0,), (3, 0), (3, 2, 0), (2, 3, 1)]
    assert r.scores.tolist() == [0, 3, 5, 6]
    assert r.step_generations == 12 and r.generation_equivalents == pytest.approx(12 / 2.25)


def test_beam_search_refills_to_n_when_fewer_than_n_over_m_stay_open():
    # round 1 ends (0) (1) (2); only (3) stays open and is copied four times; round 2 ends three more: stop at N
    done = lambda p: p[-1] < 3
    r = beam_search(index_steps, sum_scores, done, SearchConfig(n=4, beam_width=2))
    assert r.beams == [(0,), (1,), (2,), (3, 0)]
    assert (r.iterations, r.step_generations) == (2, 8)


def test_beam_search_gives_up_after_max_iterations_without_padding():
    r = beam_search(index_steps, sum_scores, lambda p: False, SearchConfig(n=4, beam_width=4, max_iterations=5))
    assert r.beams == [] and r.scores.shape == (0,) and (r.iterations, r.step_generations) == (5, 20)
    assert math.isnan(r.generation_equivalents)


def test_lookahead_scores_the_end_of_the_rollout_and_keeps_the_candidate():
    seen = []
    def last_step(prefixes):
        seen.append(list(prefixes))
        return [p[-1] for p in prefixes]
    greedy = lambda prefixes: [10 - p[-1] for p in prefixes]
    r = beam_search(index_steps, last_step, lambda p: len(p) == 2, SearchConfig(n=2, beam_width=2, lookahead=1), greedy)
    assert seen[0] == [(0, 10), (1, 9)]          # the verifier saw the rollouts, not (0) and (1)
    assert r.beams == [(0, 0), (0, 1)]           # (0) kept for its rollout's 10; the rollout step is not kept
    plain = beam_search(index_steps, last_step, lambda p: len(p) == 2, SearchConfig(n=2, beam_width=2))
    assert plain.beams == [(1, 0), (1, 1)]       # scored on the current text, (1) wins


def test_lookahead_costs_n_times_k_plus_one_a_round_when_rollouts_run_full():
    cfg = SearchConfig(n=4, beam_width=2, lookahead=3, max_iterations=2)
    r = beam_search(index_steps, sum_scores, lambda p: False, cfg, greedy=lambda ps: [1] * len(ps))
    assert cfg.budget == 16 and r.step_generations == 2 * cfg.budget
    with pytest.raises(ValueError, match="greedy"):
        beam_search(index_steps, sum_scores, lambda p: False, cfg)


def test_search_config_needs_n_a_multiple_of_the_beam_width():
    with pytest.raises(ConfigError, match="multiple"):
        SearchConfig(n=10, beam_width=4)


# --- revisions ----------------------------------------------------------------------------------------------------

def test_revision_prompt_keeps_the_four_most_recent_attempts_oldest_first():
    prompt = solution_prompt("What is 2 + 2?", [f"Answer: {i}" for i in range(1, 7)])
    assert prompt == ("What is 2 + 2?\n\nAttempt 1:\nAnswer: 3\n\nAttempt 2:\nAnswer: 4\n\n"
                      "Attempt 3:\nAnswer: 5\n\nAttempt 4:\nAnswer: 6\n\nSolution:\n")
    assert solution_prompt("Q") == "Q\n\nSolution:\n"


def test_revision_chains_run_in_lockstep_with_one_call_a_round():
    calls = []
    def revise(prompts):
        calls.append(prompts)
        return [f"Answer: {p.count('Attempt ')}" for p in prompts]
    chains = revision_chains("Q", revise, chains=3, length=6, context=4)
    assert len(calls) == 6 and all(len(c) == 3 for c in calls)     # 18 generations in 6 batched calls
    assert chains == [[f"Answer: {n}" for n in (0, 1, 2, 3, 4, 4)]] * 3


def test_splits_cover_every_sequential_to_parallel_ratio_of_the_budget():
    assert splits(16) == [(16, 1), (8, 2), (4, 4), (2, 8), (1, 16)]
    assert all(c * length == 256 for c, length in splits(256)) and len(splits(256)) == 9
    with pytest.raises(ValueError):
        splits(6)


def test_chain_selection_chooses_within_each_chain_then_across_chains():
    answers, scores = [[1, 2, 2], [3, 3, 1]], [[0.875, 0.25, 0.25], [0.5, 0.5, 0.125]]
    assert select_chains(answers, scores) == 3               # winners 1 (0.875) and 3 (1.0)
    assert weighted_best_of_n(sum(answers, []), sum(scores, [])) == 1  # pooled: 1 and 3 tie at 1.0
    assert select_chains(answers, scores, "majority") == 2   # winners 2 and 3, one vote each
    assert select_chains([[4], [5], [5]], [[0.9], [0.3], [0.4]]) == weighted_best_of_n([4, 5, 5], [0.9, 0.3, 0.4])


# --- difficulty and compute-optimal selection ---------------------------------------------------------------------

def test_difficulty_bins_are_equal_count_quintiles_easiest_first():
    bins = difficulty_bins(np.linspace(1, 0, 500))
    assert bins.tolist() == np.repeat([1, 2, 3, 4, 5], 100).tolist()
    correct = np.arange(4)[None, :] < np.array([1, 4, 0, 3, 2])[:, None]  # (5, 4): pass@1 ¼, 1, 0, ¾, ½
    assert oracle_bins(correct).tolist() == [4, 1, 5, 2, 3]
    assert predicted_bins(np.tile(np.linspace(1, 0, 10)[:, None], 4)).tolist() == np.repeat([1, 2, 3, 4, 5], 2).tolist()


def test_two_fold_cross_validation_chooses_on_one_fold_and_scores_the_other():
    acc = np.array([[1, 1, 0, 0, 0, 0, 1, 0],
                    [0, 1, 1, 1, 1, 1, 0, 1]])
    bins, folds = np.array([1, 1, 1, 1, 2, 2, 2, 2]), np.array([0, 0, 1, 1, 0, 0, 1, 1])
    cv = compute_optimal(acc, bins, folds)
    assert cv.choice.tolist() == [[0, 1], [1, 0]]
    assert cv.per_question.tolist() == [0, 1, 0, 0, 0, 0, 0, 1] and cv.accuracy == 0.25
    with pytest.raises(ValueError, match="each fold"):
        compute_optimal(acc, bins, np.zeros(8, dtype=int))


def test_cross_validation_removes_the_optimism_of_choosing_among_noise():
    rng = np.random.default_rng(0)
    acc = (rng.random((40, 500)) < 0.5).astype(float)  # 40 strategies, all coin flips
    bins = np.repeat([1, 2, 3, 4, 5], 100)
    in_sample = np.mean([acc[:, bins == b].mean(1).max() for b in range(1, 6)])
    cv = compute_optimal(acc, bins, two_folds(bins, seed=0)).accuracy
    assert in_sample > 0.6 and abs(cv - 0.5) < 0.05


def test_two_folds_halve_every_bin():
    folds = two_folds(np.repeat([1, 2, 3], [10, 11, 1]), seed=0)
    assert [folds[:10].sum(), folds[10:21].sum(), folds[21:].sum()] == [5, 5, 0]


def test_selection_stability_is_zero_for_clear_winners_and_large_for_near_ties():
    rng = np.random.default_rng(1)
    bins = np.repeat([1, 2, 3, 4, 5], 100)
    far = np.vstack([rng.random(500) < 0.1, rng.random(500) < 0.9])
    assert selection_stability(far, bins, n_boot=100).changed.tolist() == [0.0] * 5
    same = np.vstack([rng.random(500) < 0.4] * 2)  # identical strategies: the first always wins the tie
    assert selection_stability(same, bins, n_boot=50).changed.tolist() == [0.0] * 5
    near = np.vstack([rng.random(500) < 0.40, rng.random(500) < 0.41])
    stab = selection_stability(near, bins, n_boot=200)
    assert stab.frequency.sum(1).tolist() == pytest.approx([1.0] * 5) and stab.changed.mean() > 0.15


# --- FLOPs --------------------------------------------------------------------------------------------------------

def test_flops_multiplier_is_the_study_formula_for_a_14x_larger_model():
    # M + 3 (D_pre / D_inf)(M − 1) with M = 14: 14 + 39 / R
    assert flops_multiplier(14, 0.16) == pytest.approx(257.75)
    assert flops_multiplier(14, 0.79) == pytest.approx(14 + 39 / 0.79)
    assert flops_multiplier(14, 22) == pytest.approx(14 + 39 / 22)
    assert [matched_samples(14, r) for r in (0.16, 0.79, 22)] == [257, 63, 15]
    assert matched_samples(2, 3) == 3 and matched_samples(2, 3, samples=8) == 24  # 2 + 3·1/3
    assert matched_samples(8, 0.14) == 158  # 8 + 21 / 0.14 is 157.99999999999997 in floating point
    with pytest.raises(ValueError):
        flops_multiplier(0.5, 1)


@settings(max_examples=100, deadline=None)
@given(st.floats(1e6, 1e11), st.floats(1, 100), st.floats(1e9, 1e13), st.floats(1e6, 1e13))
def test_matched_inference_makes_total_flops_equal(params, ratio, d_pre, d_inf):
    k = flops_multiplier(ratio, d_inf / d_pre)
    small = pretrain_flops(params, d_pre) + inference_flops(params, k * d_inf)
    large = pretrain_flops(ratio * params, d_pre) + inference_flops(ratio * params, d_inf)
    assert small == pytest.approx(large, rel=1e-9)


# --- bootstrap ----------------------------------------------------------------------------------------------------

def test_bootstrap_percentiles_on_a_two_question_case():
    # resampled means of [0, 1] are 0, ½, 1 with mass ¼, ½, ¼: the 2.5 % and 97.5 % points are 0 and 1
    assert bootstrap_ci([0.0, 1.0], n_boot=4000) == (0.0, 1.0)
    lo, hi = bootstrap_ci([0.0, 1.0], level=0.4, n_boot=4000)
    assert (lo, hi) == (0.5, 0.5)  # the 30 % and 70 % points both fall on ½


def test_bootstrap_interval_covers_the_true_mean_at_the_nominal_rate():
    rng = np.random.default_rng(0)
    samples = rng.normal(0.3, 1.0, size=(400, 60))  # 400 experiments of 60 questions, true mean 0.3
    lo, hi = bootstrap_ci(samples, level=0.9, n_boot=1000, seed=1)
    coverage = np.mean((lo <= 0.3) & (0.3 <= hi))
    assert 0.85 <= coverage <= 0.94


def test_study_config_reads_nested_sections_and_refuses_bad_values():
    cfg = from_dict(StudyConfig, {"budgets": [1, 2, 4], "search": {"n": 8, "lookahead": 3}, "revision": {"context": 2}})
    assert (cfg.search.budget, cfg.revision.context, cfg.bins) == (32, 2, 5)
    assert StudyConfig().inference_ratios == [0.16, 0.79, 22.0] and StudyConfig().budgets[-1] == 256
    for bad, message in [({"budgets": [3]}, "powers of two"), ({"bins": 1}, "outside"),
                         ({"inference_ratios": [0.0]}, "R > 0"), ({"revision": {"selection": "vote"}}, "verifier")]:
        with pytest.raises(ConfigError, match=message):
            from_dict(StudyConfig, bad)
