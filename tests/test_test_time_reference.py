"""Chapter 18's selectors and difficulty bins against a literal transcription of a public reimplementation of the
study: huggingface/search-and-learn, `src/sal/utils/math.py` (`find_answer_with_largest_sum`, `find_majority_answer`,
`compute_level`; ../shared/references.md §9).

The transcription keeps the reference's logic line for line; only `memoized_canonical_form` (latex2sympy and sympy
simplification of a LaTeX answer) becomes `str`, because every answer of our testbed is an exact integer, whose
canonical form is itself. Answers are integers here, never None: the reference has no "no answer" (its parser
returns "" and that string can win), ours never lets a missing answer win — the one deliberate difference, tested
at the end."""
from collections import defaultdict

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from openpretrain.evaluation.strategies import difficulty_bins, majority_vote, weighted_best_of_n


def memoized_canonical_form(expression: str) -> str:
    return expression   # an integer's canonical form is itself (the reference simplifies LaTeX with sympy)


def find_answer_with_largest_sum(answers, scores):
    if len(answers) == 0 or len(scores) == 0:
        raise ValueError("answers and scores cannot be empty")
    canonical_groups = defaultdict(float)
    canonical_to_original = {}
    for answer, score in zip(answers, scores):
        canonical_form = memoized_canonical_form(answer)
        canonical_groups[canonical_form] += score
        if canonical_form not in canonical_to_original:
            canonical_to_original[canonical_form] = answer
    max_canonical = max(canonical_groups, key=canonical_groups.get)
    return canonical_to_original[max_canonical]


def find_majority_answer(answers):
    if len(answers) == 0:
        raise ValueError("answers cannot be empty")
    canonical_groups = defaultdict(int)
    canonical_to_original = {}
    for answer in answers:
        canonical_form = memoized_canonical_form(answer)
        canonical_groups[canonical_form] += 1
        if canonical_form not in canonical_to_original:
            canonical_to_original[canonical_form] = answer
    max_count = max(canonical_groups.values())
    for canonical_form, count in canonical_groups.items():
        if count == max_count:
            return canonical_to_original[canonical_form]


def compute_level(x, metric, name, quintiles):
    if x[metric] < quintiles[0]:
        return {f"level_{name}": 5}
    elif x[metric] < quintiles[1]:
        return {f"level_{name}": 4}
    elif x[metric] < quintiles[2]:
        return {f"level_{name}": 3}
    elif x[metric] < quintiles[3]:
        return {f"level_{name}": 2}
    else:
        return {f"level_{name}": 1}


samples = st.lists(st.tuples(st.integers(0, 5), st.floats(0, 1)), min_size=1, max_size=32)


@settings(max_examples=300, deadline=None)
@given(samples)
def test_weighted_best_of_n_picks_what_search_and_learn_picks(pairs):
    answers, scores = [a for a, _ in pairs], [s for _, s in pairs]
    ref = find_answer_with_largest_sum([str(a) for a in answers], scores)
    assert str(weighted_best_of_n(answers, scores)) == ref   # ties too: both keep the first answer seen


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=32))
def test_majority_vote_picks_what_search_and_learn_picks(answers):
    assert str(majority_vote(answers)) == find_majority_answer([str(a) for a in answers])


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40).flatmap(lambda m: st.lists(st.integers(0, 2048), min_size=5 * m, max_size=5 * m, unique=True)))
def test_difficulty_bins_are_search_and_learns_levels_of_the_quintiles(hits):
    # distinct pass@1 values of 2,048 samples (the study's count); with 5m of them the quintiles split them evenly.
    # The reference's caller passes the metric's quintiles (not in the stored file): np.quantile's, linear.
    values = [h / 2048 for h in hits]
    quintiles = np.quantile(values, [0.2, 0.4, 0.6, 0.8])
    ref = [compute_level({"pass@1": v}, "pass@1", "oracle", quintiles)["level_oracle"] for v in values]
    assert difficulty_bins(values).tolist() == ref


def test_where_ours_differs_a_missing_answer_never_wins():
    answers, scores = ["", "", "7"], [0.5, 0.5, 0.9]           # the reference's parser gives "" for no answer
    assert find_answer_with_largest_sum(answers, scores) == ""  # and no answer wins there
    assert weighted_best_of_n([None, None, 7], scores) == 7     # ours: None is not an answer
    assert find_majority_answer(answers) == "" and majority_vote([None, None, 7]) == 7
