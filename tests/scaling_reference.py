"""Epoch AI's fit of Hoffmann et al.'s Approach 3, restated operation for operation, for tests/test_scaling.py.

Source: github.com/epoch-research/analyzing-chinchilla, `data_analysis.ipynb` at commit
f341459609fa94e09ffcbfb7f46a9d0f52cd5389 (the last commit that changed the notebook; the repository's HEAD when read
was 92258837425e1b5f2851d624287f0120583a3d0e), section "Replicate methodology from Chinchilla paper": the
definitions cell (`log_sum_exp`, `custom_huber_loss` with delta=1e-3, `huber_loss_objective`) and the cell
"Replicate exactly" (the grid of initial values, the loop over `itertools.product(alpha_vals, beta_vals, e_vals,
a_vals, b_vals)` with `init_params = [a, b, e, alpha, beta]`, `scipy.optimize.minimize(..., method='L-BFGS-B')`
called without a gradient or options, and the rule `result.success and result.fun < best_loss`).

The repository carries no licence, so its text is not copied: every expression below performs the same
floating-point operations in the same order as theirs (the log of a sum of three exponentials, not a stabilised
log-sum-exp; Huber term by term, summed), and the loop visits the same starts in the same order with the same scipy
call and acceptance rule. Run once beside the notebook's own cells (numpy in place of autograd.numpy, which computes
the same values), it gave bitwise-equal best parameters on their 240 points with the full grid. Independent of
openpretrain: numpy and scipy only.
"""
import itertools

import numpy as np
from scipy.optimize import minimize

DELTA = 1e-3                         # their Huber threshold
ALPHAS = np.arange(0, 2.5, 0.5)      # their alpha_vals
BETAS = np.arange(0, 2.5, 0.5)       # their beta_vals
ES = np.arange(-1, 1.5, 0.5)         # their e_vals
AS = np.arange(0, 30, 5)             # their a_vals
BS = np.arange(0, 30, 5)             # their b_vals
AXES = (ALPHAS, BETAS, ES, AS, BS)   # in their loop's order


def predicted_log_loss(a, b, e, alpha, beta, N, D):
    "log(exp(a − α·log N) + exp(b − β·log D) + exp(e)), summed left to right."
    return np.log(np.exp(a - alpha * np.log(N)) + np.exp(b - beta * np.log(D)) + np.exp(e))


def summed_huber(observed, predicted, delta=DELTA):
    "Σ of ½·diff² where |diff| ≤ δ, else δ·(|diff| − ½δ), with diff = observed − predicted."
    diff = observed - predicted
    return np.sum(np.where(np.abs(diff) <= delta, 0.5 * diff**2, delta * (np.abs(diff) - 0.5 * delta)))


def objective(params, N, D, losses):
    "The summed Huber loss of the observed log losses against the prediction of params = (a, b, e, α, β)."
    a, b, e, alpha, beta = params
    return summed_huber(np.log(losses), predicted_log_loss(a, b, e, alpha, beta, N, D))


def fit(N, D, losses, axes=AXES):
    "The best (a, b, e, α, β) over L-BFGS-B runs from every start of the grid; None if no run succeeded."
    best_loss, best_params = np.inf, None
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):   # they silence these with np.seterr
        for alpha, beta, e, a, b in itertools.product(*axes):
            result = minimize(objective, [a, b, e, alpha, beta], args=(N, D, losses), method="L-BFGS-B")
            if result.success and result.fun < best_loss:
                best_loss, best_params = result.fun, result.x
    return best_params
