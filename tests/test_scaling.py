"""Scaling-law fits (openpretrain.training.scaling): recovery of a known surface, equality with Epoch AI's procedure,
intervals that cover, the token-efficiency multiplier, and the prediction file."""
import subprocess

import numpy as np
import pandas as pd
import pytest
import scaling_reference as epoch

from openpretrain.core import ConfigError
from openpretrain.training.scaling import (
    DEFAULT_GRID, EPOCH, EPOCH_GRID, SURFACE, FitError, LadderFit, LossSurface, Optimiser, bootstrap_surfaces,
    committed_before, fit_ladder, fit_multiplier, fit_surface, make_prediction, objective, points, predict,
    read_prediction, resample_runs, score_prediction, seed_sd, write_prediction)

CHINCHILLA = LossSurface(E=1.69, A=406.4, alpha=0.34, B=410.7, beta=0.28)   # Hoffmann et al. 2022, Eq. 10
N, D = (v.ravel() for v in np.meshgrid(np.geomspace(1e5, 1e7, 5), np.geomspace(1e6, 1e8, 5)))  # small-model scale
FAR = (1e8, 1e9)                                                             # 10× beyond both ends of the points


def noisy(seed: int, noise: float = 0.01) -> np.ndarray:
    return CHINCHILLA.loss(N, D) + np.random.default_rng(seed).normal(0, noise, N.size)


def ladder(rng, sizes=(1e5, 3e5, 1e6, 3e6), budgets=(2e6, 4e6, 8e6, 1.6e7, 3.2e7), seeds=(0, 1), noise=0.01,
           run_noise=0.0, m=1.0, tag="") -> pd.DataFrame:
    "A ladder on Chinchilla's surface: one run per size and seed, a point per cooldown budget; tokens worth m each."
    rows = []
    for n in sizes:
        for s in seeds:
            offset = rng.normal(0, run_noise)                  # what a run's seed shifts all its points by
            rows += [dict(N=n, D=d, loss=float(CHINCHILLA.loss(n, m * d)) + offset + rng.normal(0, noise),
                          run=f"{tag}{n:.0e}/{s}", seed=s) for d in budgets]
    return pd.DataFrame(rows)


# --- the fit ---------------------------------------------------------------------------------------------------

def test_fit_recovers_the_surface_from_noise_free_points():
    np.testing.assert_allclose(fit_surface(N, D, CHINCHILLA.loss(N, D)).theta, CHINCHILLA.theta, rtol=1e-6)


@pytest.mark.parametrize("seed", [0, 4, 8])
def test_fit_on_noisy_points_recovers_the_parameters_and_predicts_beyond_the_ladder(seed):
    fit = fit_surface(N, D, noisy(seed))
    assert abs(fit.alpha - 0.34) < 0.005 and abs(fit.beta - 0.28) < 0.005 and abs(fit.E - 1.69) < 0.1
    assert abs(fit.A / 406.4 - 1) < 0.05 and abs(fit.B / 410.7 - 1) < 0.05
    assert abs(fit.loss(*FAR) - CHINCHILLA.loss(*FAR)) < 0.03                 # 3.70 nats there


def test_analytic_gradient_equals_central_differences():
    x, theta = points(N, D, noisy(0)), CHINCHILLA.theta + [0.3, -0.2, 0.1, 0.01, -0.02]
    g = objective(theta, SURFACE, x, 1e-3)[1]
    central = [(objective(theta + h, SURFACE, x, 1e-3, False) - objective(theta - h, SURFACE, x, 1e-3, False)) / 2e-7
               for h in np.eye(5) * 1e-7]
    np.testing.assert_allclose(g, central, rtol=1e-5)


SUBGRID = {k: v[:2] for k, v in EPOCH_GRID.items()}   # 32 of Epoch's 4,500 starts, for time


@pytest.mark.parametrize("seed", [0, 1])
def test_epoch_settings_reproduce_epochs_code_on_a_subgrid(seed):
    "Same objective, starts, optimiser call and acceptance rule: the same best parameters, to the last bits."
    ours = fit_surface(N, D, noisy(seed), grid=SUBGRID, optimiser=EPOCH)
    theirs = epoch.fit(N, D, noisy(seed), axes=tuple(SUBGRID.values()))
    np.testing.assert_allclose([ours.A, ours.B, ours.E, ours.alpha, ours.beta],
                               np.concatenate([np.exp(theirs[:3]), theirs[3:]]), rtol=1e-12)


def test_our_objective_equals_epochs_bit_for_bit():
    "Any difference in the last bit sends Epoch's finite-difference paths elsewhere; 500 θs across their grid's box."
    x, L = points(N, D, noisy(0)), noisy(0)
    thetas = np.random.default_rng(0).uniform([0, 0, -1, 0, 0], [25, 25, 1, 2, 2], size=(500, 5))
    for theta in [CHINCHILLA.theta, *thetas]:
        assert objective(theta, SURFACE, x, 1e-3, gradient=False) == epoch.objective(theta, N, D, L), theta


@pytest.mark.slow
def test_epoch_settings_reproduce_epochs_code_on_their_full_grid():
    ours = fit_surface(N, D, noisy(0), grid=EPOCH_GRID, optimiser=EPOCH)
    theirs = epoch.fit(N, D, noisy(0))
    np.testing.assert_allclose([ours.A, ours.B, ours.E, ours.alpha, ours.beta],
                               np.concatenate([np.exp(theirs[:3]), theirs[3:]]), rtol=1e-12)


@pytest.mark.slow
def test_the_default_fit_reaches_epochs_optimum_or_lower():
    "32 starts with the analytic gradient and tight tolerances against Epoch's 4,500 starts with scipy's defaults."
    x, theirs = points(N, D, noisy(0)), epoch.fit(N, D, noisy(0))
    ours = fit_surface(N, D, noisy(0))
    assert objective(ours.theta, SURFACE, x, 1e-3, False) <= objective(theirs, SURFACE, x, 1e-3, False) * (1 + 1e-9)
    assert abs(ours.loss(*FAR) / LossSurface.from_theta(theirs).loss(*FAR) - 1) < 1e-4


def test_default_grid_is_a_subgrid_of_epochs():
    assert all(set(v) <= set(EPOCH_GRID[k].tolist()) for k, v in DEFAULT_GRID.items())


def test_a_fit_where_no_start_converges_says_so():
    with pytest.raises(FitError, match="none of 32 starts converged"):
        fit_surface(N, D, noisy(0), optimiser=Optimiser(maxiter=1))
    with pytest.raises(ValueError, match="positive and finite"):
        fit_surface(N, D, -noisy(0))


# --- intervals --------------------------------------------------------------------------------------------------

def test_resampling_keeps_runs_whole():
    frame = ladder(np.random.default_rng(0))
    sample = resample_runs(frame, np.random.default_rng(1))
    assert len(sample) == len(frame) and set(sample.run) < set(frame.run)
    for run, rows in sample.groupby("run"):
        original = frame[frame.run == run]
        assert len(rows) % len(original) == 0 and set(rows.loss) == set(original.loss)


def test_bootstrap_is_reproducible_and_refits_every_resample_but_the_full_data():
    frame = ladder(np.random.default_rng(0), seeds=(0,))           # 4 runs: 9 % of resamples draw each once
    full = fit_surface(frame.N, frame.D, frame.loss)
    boots = bootstrap_surfaces(frame, 40, seed=0, start=full)
    assert boots == bootstrap_surfaces(frame, 40, seed=0, start=full)
    rng, sizes = np.random.default_rng(0), frame.groupby("run").size()     # replay the draws
    once = [resample_runs(frame, rng).groupby("run").size().equals(sizes) for _ in range(40)]
    assert [b == full for b in boots] == once and any(once)


def test_bootstrap_interval_covers_the_true_extrapolated_loss():
    "20 synthetic ladders (4 sizes × 2 seeds × 5 cooldowns): the 95 % interval at 3× the largest N and D covers."
    truth, covered = float(CHINCHILLA.loss(1e7, 1e8)), 0
    for k in range(20):
        est = predict(fit_ladder(ladder(np.random.default_rng(k)), n_boot=30, seed=k), 1e7, 1e8)
        covered += est.lo <= truth <= est.hi
    assert covered >= 15, covered


def test_seed_noise_is_pooled_over_points_with_two_or_more_seeds():
    frame = pd.DataFrame(dict(N=[1.0] * 5, D=[1.0, 1.0, 2.0, 2.0, 3.0], loss=[1.0, 3.0, 5.0, 5.0, 9.0],
                              seed=[0, 1, 0, 1, 0]))
    assert seed_sd(frame) == 1.0                          # √((1·2 + 1·0) / 2); D = 3 has one seed
    assert seed_sd(frame.drop(columns="seed")) == 0.0 and seed_sd(frame[frame.seed == 0]) == 0.0


def test_seed_noise_widens_the_interval_in_quadrature():
    exact = LadderFit(CHINCHILLA, [CHINCHILLA], 0.01, [])
    est = predict(exact, 1e7, 1e8, level=0.95)
    assert est.hi - est.loss == pytest.approx(1.959964 * 0.01) and est.loss - est.lo == pytest.approx(1.959964 * 0.01)
    spread = LadderFit(CHINCHILLA, [CHINCHILLA, LossSurface(1.69 + 0.03, 406.4, 0.34, 410.7, 0.28)], 0.01, [])
    hi = predict(spread, 1e7, 1e8).hi - predict(spread, 1e7, 1e8).loss
    assert hi == pytest.approx(np.hypot(0.03 * 0.975, 1.959964 * 0.01))       # percentile 97.5 of {0, 0.03}


def test_a_surface_alone_predicts_a_point_and_refits_their_percentile_interval():
    assert predict(CHINCHILLA, 1e7, 1e8).lo == predict(CHINCHILLA, 1e7, 1e8).hi == CHINCHILLA.loss(1e7, 1e8)
    boots = [LossSurface(1.69 + k / 100, 406.4, 0.34, 410.7, 0.28) for k in range(101)]
    est = predict(boots, 1e7, 1e8, level=0.9)
    assert est.lo == pytest.approx(CHINCHILLA.loss(1e7, 1e8) + 0.05) and est.hi == pytest.approx(
        CHINCHILLA.loss(1e7, 1e8) + 0.95)
    with pytest.raises(ValueError, match="at least one"):
        predict([], 1e7, 1e8)


# --- the multiplier ---------------------------------------------------------------------------------------------

ABLATION = dict(sizes=(1e6,), budgets=(1e6, 2e6, 4e6, 8e6, 1.6e7, 3.2e7), seeds=(0, 1, 2))   # one size, 3 seeds
SIZES = dict(sizes=(1e5, 1e6, 1e7), budgets=(1e6, 4e6, 1.6e7), seeds=(0, 1))                # three sizes, 2 seeds


@pytest.mark.parametrize("shape", [ABLATION, SIZES], ids=["one size", "three sizes"])
def test_multiplier_recovers_a_true_m_of_1_5(shape):
    rng = np.random.default_rng(0)
    m = fit_multiplier(ladder(rng, **shape), ladder(rng, m=1.5, tag="b", **shape), n_boot=30, seed=0)
    assert abs(m.m - 1.5) < 0.015 and m.lo <= m.m <= m.hi and m.hi - m.lo < 0.05    # sd of m here: ~0.003
    assert m.fewer_tokens == pytest.approx(1 - 1 / m.m)


def test_multiplier_interval_covers_the_true_m():
    "10 draws of two recipes at three sizes, two seeds each: the 95 % interval holds m = 1.5 (measured: 19 of 20)."
    covered = 0
    for k in range(10):
        rng = np.random.default_rng(100 + k)
        m = fit_multiplier(ladder(rng, **SIZES), ladder(rng, m=1.5, tag="b", **SIZES), n_boot=30, seed=k)
        covered += m.lo <= 1.5 <= m.hi
    assert covered >= 8, covered


def test_multiplier_of_identical_recipes_is_one():
    a = ladder(np.random.default_rng(0), **ABLATION)
    same = fit_multiplier(a, a.assign(run=lambda f: "b" + f.run), n_boot=10, seed=0)
    assert abs(same.m - 1) < 1e-6 and same.lo <= 1 <= same.hi


def test_multiplier_of_independent_draws_of_one_recipe_covers_one():
    rng = np.random.default_rng(1)
    m = fit_multiplier(ladder(rng, **ABLATION), ladder(rng, tag="b", **ABLATION), n_boot=30, seed=0)
    assert m.lo <= 1 <= m.hi, (m.lo, m.hi)


# --- the prediction file ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prediction():
    fit = fit_ladder(ladder(np.random.default_rng(0)), n_boot=10, seed=0)
    return make_prediction(fit, 1e7, 1e8, quantity="synthetic loss, nats/token", created="2025-01-31")


def test_prediction_file_round_trips(tmp_path, prediction):
    path = write_prediction(tmp_path / "sub" / "prediction.yaml", prediction)
    assert read_prediction(path) == prediction and [p.name for p in path.parent.iterdir()] == ["prediction.yaml"]
    assert prediction.lo <= prediction.loss <= prediction.hi and len(prediction.runs) == 8


@pytest.mark.parametrize("old, new, field", [
    ("level: 0.95", "level: 1.5", "Prediction.level"),
    ("\nlo:", "\n# lo:", "Prediction.lo"),
    ("  beta:", "  # beta:", "Prediction.surface.beta"),
    ("loss: ", "loss: high ", "Prediction.loss"),
    ("quantity:", "qantity:", "Prediction.quantity"),
    ("\nhi: ", "\nhi: -", "lo"),                            # an interval that misses its own loss
])
def test_malformed_prediction_names_the_field(tmp_path, prediction, old, new, field):
    text = write_prediction(tmp_path / "p.yaml", prediction).read_text()
    (tmp_path / "p.yaml").write_text(text.replace(old, new, 1))
    with pytest.raises(ConfigError) as e:
        read_prediction(tmp_path / "p.yaml")
    assert e.value.field == field, str(e.value)


def test_missing_or_unparsable_prediction_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no prediction here"):
        read_prediction(tmp_path / "absent.yaml")
    (tmp_path / "p.yaml").write_text("loss: [1\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        read_prediction(tmp_path / "p.yaml")


def test_score_says_whether_the_interval_holds_the_observed_loss(prediction):
    inside = score_prediction(prediction, prediction.loss + 0.5 * (prediction.hi - prediction.loss))
    outside = score_prediction(prediction, prediction.hi + 0.01)
    assert inside["inside"] and not outside["inside"]
    assert outside["error"] == pytest.approx(prediction.hi + 0.01 - prediction.loss)


def test_committed_before_finds_the_commit_that_added_the_file(tmp_path, prediction):
    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.org", *args], cwd=tmp_path,
                              check=True, capture_output=True, text=True).stdout.strip()
    path = write_prediction(tmp_path / "prediction.yaml", prediction)
    assert committed_before(path) is None                                    # not in git
    git("init", "-q")
    assert committed_before(path) is None                                    # in git, never committed
    git("add", "prediction.yaml"), git("commit", "-qm", "prediction")
    git("commit", "-q", "--allow-empty", "-m", "the base run")
    found = committed_before(path)
    assert found.sha == git("rev-parse", "HEAD~1") and found.edits == 0 and found.clean
    assert found.time == int(git("log", "-1", "--format=%ct", "HEAD~1"))
    path.write_text(path.read_text() + "\n")
    assert not committed_before(path).clean                                  # edited on disk after the commit
    git("commit", "-qam", "edit")
    assert committed_before(path).edits == 1 and committed_before(path, "HEAD~1").edits == 0
    (tmp_path / "late.yaml").write_text("x"), git("add", "late.yaml"), git("commit", "-qm", "late")
    assert committed_before(tmp_path / "late.yaml", "HEAD~1") is None       # added after that commit
