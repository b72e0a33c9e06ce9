"""Tests of pdpsgd.accounting: PRV/RDP accountants, calibration, planning.

Reference values come from closed forms (q = 1: Gaussian mechanism, Balle & Wang
2018) and from independent implementations (dp-accounting's PLD and RDP
accountants, test-only dependencies).
"""
import json
import logging
import math
import re

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import fft as sfft
from scipy import integrate, optimize, special

from pdpsgd.accounting import (
    DEFAULT_RDP_ORDERS,
    DeltaBounds,
    EpsilonBounds,
    PRVAccountant,
    PRVFailure,
    PrivacyPlan,
    RDPAccountant,
    calibrate_noise,
    make_accountant,
    plan_privacy,
    rdp_poisson_subsampled_gaussian,
)
from pdpsgd.accounting import prv as prv_module

logging.getLogger("absl").setLevel(logging.ERROR)

CHEAP = settings(max_examples=6, deadline=None, derandomize=True)


# ----------------------------------------------------------------------------------
# references
# ----------------------------------------------------------------------------------
def gaussian_delta(eps, mu):
    """Exact δ(ε) of the Gaussian mechanism with sensitivity/σ = μ (Balle & Wang 2018, Thm. 8)."""
    return special.ndtr(-eps / mu + mu / 2) - math.exp(eps + special.log_ndtr(-eps / mu - mu / 2))


def gaussian_epsilon(delta, mu):
    if gaussian_delta(0.0, mu) <= delta:
        return 0.0
    hi = 1.0
    while gaussian_delta(hi, mu) > delta:
        hi *= 2
    return optimize.brentq(lambda e: gaussian_delta(e, mu) - delta, 0.0, hi, xtol=1e-12, rtol=1e-12)


def pld_epsilon(groups, delta, vdi=3e-4):
    """Pessimistic PLD ε from dp-accounting (an upper bound on the true ε)."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    total = None
    for s, q, n in groups:
        p = pld_lib.from_gaussian_mechanism(s, sampling_prob=q, value_discretization_interval=vdi).self_compose(n)
        total = p if total is None else total.compose(p)
    return float(total.get_epsilon_for_delta(delta))


def prv(sigma, q, steps, **kw):
    a = PRVAccountant(**kw)
    a.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    return a


# ----------------------------------------------------------------------------------
# q = 1: exact Gaussian mechanism
# ----------------------------------------------------------------------------------
@CHEAP
@given(
    mu=st.floats(0.3, 8.0),  # composed μ = sqrt(steps) / σ, i.e. ε up to ~70
    steps=st.integers(1, 2000),
    delta=st.sampled_from([1e-3, 1e-5, 1e-7]),
)
def test_q1_epsilon_bounds_contain_exact_gaussian(mu, steps, delta):
    sigma = math.sqrt(steps) / mu
    exact = gaussian_epsilon(delta, mu)
    b = prv(sigma, 1.0, steps).epsilon(delta)
    assert b.method == "prv"
    assert b.lower <= exact <= b.upper
    assert abs(b.estimate - exact) <= 0.01 + 1e-6
    r = RDPAccountant().step(noise_multiplier=sigma, sample_rate=1.0, num_steps=steps).epsilon(delta)
    assert r.upper >= exact - 1e-9


@CHEAP
@given(mu=st.floats(0.3, 5.0), steps=st.integers(1, 500), eps=st.floats(0.2, 8.0))
def test_q1_delta_bounds_contain_exact_gaussian(mu, steps, eps):
    sigma = math.sqrt(steps) / mu
    exact = gaussian_delta(eps, mu)
    b = prv(sigma, 1.0, steps).delta(eps)
    assert isinstance(b, DeltaBounds)
    assert b.lower <= exact <= b.upper
    r = RDPAccountant().step(noise_multiplier=sigma, sample_rate=1.0, num_steps=steps).delta(eps)
    assert r.upper >= exact - 1e-12


def test_fallback_bounds_contain_exact_gaussian():
    for sigma, steps in [(0.8, 50), (2.0, 1000)]:
        exact = gaussian_epsilon(1e-5, math.sqrt(steps) / sigma)
        b = prv_module.pld_epsilon(((sigma, 1.0, steps),), 1e-5)
        assert b.method == "pld"
        assert b.lower <= exact <= b.upper
        assert b.upper - exact < 0.01


# dp-accounting's FFT composition is not round-off controlled: its pessimistic ε was below
# the exact one (σ=100, 10⁴ steps, δ=1e-12: 7.2293 < 7.2385; σ=5: 339.18 < 339.83)
UNDERSTATED = [(100.0, 10_000, 1e-12), (5.0, 10_000, 1e-12), (300.0, 100_000, 1e-11)]


def check_fallback_contains_exact_gaussian(sigma, steps, delta):
    """pld_epsilon / pld_delta at q = 1 bracket the exact curve; returns (μ, exact ε)."""
    mu = math.sqrt(steps) / sigma
    exact = gaussian_epsilon(delta, mu)
    groups = ((sigma, 1.0, steps),)
    b = prv_module.pld_epsilon(groups, delta)
    assert b.lower <= exact <= b.upper, (b, exact)
    eps = max(exact, 0.05)
    d = prv_module.pld_delta(groups, eps, scale=eps)
    assert d.lower <= gaussian_delta(eps, mu) <= d.upper, (d, gaussian_delta(eps, mu))
    return mu, exact


@pytest.mark.parametrize("sigma,steps,delta", UNDERSTATED)
def test_fallback_never_understates_the_exact_gaussian(sigma, steps, delta):
    mu, exact = check_fallback_contains_exact_gaussian(sigma, steps, delta)
    # the round-off bound covers what the pessimistic PLD lost
    pess, _ = prv_module._pld_pair(((sigma, 1.0, steps),), 0.01)
    lost = gaussian_delta(exact, mu) - float(pess.get_delta_for_epsilon(exact))
    assert lost <= prv_module.pld_roundoff(pess, steps)


@CHEAP
@given(
    sigma=st.floats(0.5, 300.0),
    steps=st.sampled_from([10, 1000, 10_000, 30_000]),
    delta=st.sampled_from([1e-5, 1e-8, 1e-10, 1e-11, 1e-12]),
)
def test_fallback_bounds_contain_exact_gaussian_everywhere(sigma, steps, delta):
    check_fallback_contains_exact_gaussian(sigma, steps, delta)


@pytest.mark.parametrize("sigma,delta", [(1000.0, 1e-11), (1000.0, 1e-10), (300.0, 1e-11)])
def test_round_off_of_a_long_history_never_understates(sigma, delta):
    # composing 10⁵ steps as an FFT to the 10⁵-th power leaves ~n ulps of smooth error in
    # δ that no negative entry shows: σ=1000, δ=1e-11: the PRV said ε <= 2.0099, exact 2.0237
    steps = 100_000
    mu = math.sqrt(steps) / sigma
    exact = gaussian_epsilon(delta, mu)
    acct = prv(sigma, 1.0, steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        b = acct.epsilon(delta)
        d = acct.delta(exact)
    assert b.lower <= exact <= b.upper, (b, exact)
    assert d.lower <= gaussian_delta(exact, mu) <= d.upper, (d, gaussian_delta(exact, mu))


@pytest.mark.skipif(np.finfo(np.longdouble).eps >= np.finfo(np.float64).eps, reason="no long double")
@pytest.mark.parametrize("sigma,q,steps,delta", [(1000.0, 1.0, 100_000, 1e-11), (0.6, 0.001, 30_000, 1e-8)])
def test_round_off_bound_covers_the_error_against_a_long_double_composition(sigma, q, steps, delta):
    acct = prv(sigma, q, steps)
    groups = acct._groups()
    derr = prv_module._default_delta_error(delta)
    comp = acct._compose(groups, derr)
    g = acct._grid_state(groups, derr).grid
    pmf, shift, _ = prv_module._discretise(sigma, q, g)
    f = sfft.irfft(sfft.rfft(pmf.astype(np.longdouble)) ** steps, g.n)
    f = np.roll(f, -(((steps - 1) * g.K) % g.n)).astype(np.float64)
    t = g.t_min + steps * shift + g.h * np.arange(g.n)
    worst = 0.0
    for eps in np.linspace(max(0.0, float(comp.t[0])), float(comp.t[-1]) - g.h, 60):
        m = t >= float(comp.t[np.searchsorted(comp.t, eps)]) - g.h / 2
        exact = float(np.sum(f[m] * -np.expm1(eps - t[m])))
        worst = max(worst, abs(comp.delta(float(eps)) - exact))
    assert 0 < worst <= comp.roundoff, (worst, comp.roundoff)


def test_a_cached_answer_reports_its_own_fallback_reason():
    acct = prv(1.0, 0.01, 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert acct.epsilon(1e-14).method != "prv"
        reason = acct.last_fallback_reason
        assert reason
        assert acct.epsilon(1e-5).method == "prv" and acct.last_fallback_reason is None
        acct.epsilon(1e-14)  # from the cache
        assert acct.last_fallback_reason == reason
        acct.epsilon(1e-5)
        assert acct.last_fallback_reason is None


@pytest.mark.parametrize("sigma,q", [(3000.0, 1e-6), (100.0, 1e-7), (1.0, 1e-9)])
def test_rdp_of_a_tiny_sampling_rate_still_bounds_the_exact_delta(sigma, q):
    # log A_α ~ 1e-18 rounded to 0 (and the quadrature's to -3e-14): δ(0) was reported as 0 or
    # 5e-324 and ε(1e-12) as 0, where one step's exact δ(0) = q·TV(N(1, σ²), N(0, σ²)) is ~4e-10
    exact0 = q * (2.0 * special.ndtr(0.5 / sigma) - 1.0)
    for acct in (RDPAccountant(), PRVAccountant()):
        acct.step(noise_multiplier=sigma, sample_rate=q, num_steps=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert acct.delta(0.0).upper >= exact0, acct
            assert acct.epsilon(1e-12).upper > 0.0, acct
    r = rdp_poisson_subsampled_gaussian(noise_multiplier=sigma, sample_rate=q)
    assert np.all(r > 0)


def test_pld_lower_bound_above_700_is_not_the_underflowed_loss():
    # dp-accounting returns the loss itself once exp(-loss) underflows: the optimistic
    # "lower" was 778.53 against the exact 778.18
    exact = gaussian_epsilon(1e-11, math.sqrt(100) / 0.3)
    b = prv_module.pld_epsilon(((0.3, 1.0, 100),), 1e-11)
    assert b.lower <= exact <= b.upper, (b, exact)


def test_delta_is_never_exactly_zero():
    # exp of a log-δ below -745 underflowed to a reported δ of exactly 0
    d = RDPAccountant().step(noise_multiplier=1.0, sample_rate=0.01, num_steps=10).delta(2000.0)
    assert 0.0 < d.upper <= 1e-300


def test_fallback_delta_is_monotone_across_the_pld_floor(monkeypatch):
    # below PLD_MIN_DELTA the PLD is not trusted; RDP's δ there was above the PLD's δ at a
    # smaller ε, so δ(ε) rose with ε
    def broken(*args, **kwargs):
        raise RuntimeError("Discrete mean differs from continuous mean significantly.")

    monkeypatch.setattr(prv_module, "_discretise", broken)
    acct = prv(1.0, 0.01, 1000)
    last = 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for eps in np.linspace(3.0, 6.0, 13):
            d = acct.delta(float(eps))
            assert 0.0 <= d.lower <= d.upper <= last, (eps, d, last)
            last = d.upper


# ----------------------------------------------------------------------------------
# monotonicity, heterogeneous composition
# ----------------------------------------------------------------------------------
@CHEAP
@given(
    q=st.sampled_from([1e-3, 1e-2, 0.05, 0.2, 1.0]),
    sigma=st.floats(0.6, 4.0),
    steps=st.integers(10, 3000),
)
def test_monotone_in_steps_and_noise(q, sigma, steps):
    base = prv(sigma, q, steps).epsilon(1e-5)
    more_steps = prv(sigma, q, 2 * steps).epsilon(1e-5)
    less_noise = prv(sigma / 1.2, q, steps).epsilon(1e-5)
    for other in (more_steps, less_noise):
        assert other.estimate > base.estimate
        assert other.upper > base.upper
        assert other.lower >= base.lower


@CHEAP
@given(
    runs=st.lists(
        st.tuples(st.sampled_from([0.7, 1.0, 1.5, 3.0]), st.sampled_from([0.005, 0.02, 0.1]), st.integers(1, 40)),
        min_size=2,
        max_size=4,
    )
)
def test_heterogeneous_history_equals_steps_given_one_at_a_time(runs):
    together = PRVAccountant()
    one_by_one = PRVAccountant()
    reversed_order = PRVAccountant()
    for s, q, n in runs:
        together.step(noise_multiplier=s, sample_rate=q, num_steps=n)
        for _ in range(n):
            one_by_one.step(noise_multiplier=s, sample_rate=q)
            one_by_one.epsilon(1e-5)  # running ε queries must not change the final answer
    for s, q, n in reversed(runs):
        reversed_order.step(noise_multiplier=s, sample_rate=q, num_steps=n)
    assert together.num_steps == one_by_one.num_steps == sum(n for _, _, n in runs)
    assert together.epsilon(1e-5) == one_by_one.epsilon(1e-5)
    assert together.epsilon(1e-5) == reversed_order.epsilon(1e-5)
    assert together.delta(2.0) == one_by_one.delta(2.0)


def test_a_schedule_of_many_distinct_noise_levels_keeps_one_transform_per_grid(monkeypatch):
    """Review, round 38: every distinct (σ, q) of a history kept its full-grid transform cached
    (2.6 GB for 200 of them at 50 steps each; a MemoryError at 1000). Now the product of the
    history's finished groups is kept, extended as it grows: with the per-(σ, q) caches cut to one
    entry, a noise schedule of 12 levels queried after every run keeps one transform of each kind,
    and gives bit for bit a fresh accountant's answer."""
    init = prv_module._GridState.__init__

    def tiny_cache(self, grid, max_bytes=1):
        init(self, grid, max_bytes=1)

    monkeypatch.setattr(prv_module._GridState, "__init__", tiny_cache)
    acct = PRVAccountant()
    running = []
    for k in range(12):
        acct.step(noise_multiplier=0.8 + 0.05 * k, sample_rate=0.02 if k % 2 else 0.01, num_steps=3 + k)
        running.append(acct.epsilon(1e-5))
        for st_ in acct._grids.values():
            assert len(st_.ffts) <= 1 and len(st_.powers) <= 1
    monkeypatch.setattr(prv_module._GridState, "__init__", init)
    fresh = PRVAccountant()
    for k in range(12):
        fresh.step(noise_multiplier=0.8 + 0.05 * k, sample_rate=0.02 if k % 2 else 0.01, num_steps=3 + k)
    assert running[-1] == fresh.epsilon(1e-5)
    assert all(a.upper <= b.upper for a, b in zip(running, running[1:]))


@pytest.mark.parametrize("kw,err", [({"fallback": "no"}, TypeError), ({"fallback": None}, TypeError),
                                    ({"max_grid_size": -5}, ValueError), ({"max_grid_size": 2.7}, ValueError),
                                    ({"max_grid_size": True}, ValueError)])
def test_bad_accountant_options_are_refused(kw, err):
    """Review, round 38: fallback="no" was taken as True, max_grid_size=-5 sent every query to the PLD."""
    with pytest.raises(err):
        PRVAccountant(**kw)
    assert PRVAccountant(max_grid_size=2e7, fallback=np.True_).max_grid_size == 20_000_000


@pytest.mark.parametrize("cls", [PRVAccountant, RDPAccountant])
def test_a_step_count_beyond_2_to_the_53_is_refused(cls):
    """Review, round 39: step(num_steps=10**400) was taken, and epsilon() then raised a bare
    OverflowError; counts past 2^53 (in one call or in all) are refused when recorded."""
    a = cls()
    with pytest.raises(ValueError, match="2\\^53"):
        a.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=10 ** 400)
    a.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=2 ** 53)
    with pytest.raises(ValueError, match="2\\^53"):
        a.step(noise_multiplier=2.0, sample_rate=0.01, num_steps=1)
    assert a.num_steps == 2 ** 53


def test_heterogeneous_composition_is_exact_not_worst_case():
    # noise decayed every epoch (seed paper 1): σ = 2.0, 1.6, 1.28, 1.02 for 250 steps each
    sigmas = [2.0 * 0.8 ** k for k in range(4)]
    acct = PRVAccountant()
    for s in sigmas:
        acct.step(noise_multiplier=s, sample_rate=0.02, num_steps=250)
    het = acct.epsilon(1e-5)
    worst = prv(min(sigmas), 0.02, 1000).epsilon(1e-5)
    best = prv(max(sigmas), 0.02, 1000).epsilon(1e-5)
    assert best.upper < het.lower and het.upper < worst.lower
    ref = pld_epsilon([(s, 0.02, 250) for s in sigmas], 1e-5)
    assert het.lower <= ref <= het.upper + 1e-3
    assert len(acct.history) == 4 and acct.history[0].noise_multiplier == 2.0


# ----------------------------------------------------------------------------------
# agreement with independent implementations
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "q,sigma,steps",
    [
        (1e-3, 0.8, 20000),
        (1e-3, 0.5, 5000),
        (0.01, 1.1, 10000),
        (0.01, 2.0, 1000),
        (0.1, 5.0, 100),
        (0.1, 1.0, 1000),
        (0.003, 1.5, 20000),
    ],
)
def test_agrees_with_dp_accounting_pld(q, sigma, steps):
    b = prv(sigma, q, steps).epsilon(1e-5)
    assert b.method == "prv"
    ref = pld_epsilon([(sigma, q, steps)], 1e-5)  # pessimistic: >= true ε, within ~2e-3 of it
    assert b.lower <= ref <= b.upper + 2e-3
    assert abs(ref - b.estimate) < 3e-3
    assert b.upper - b.lower < 0.03  # the bounds are informative


@pytest.mark.parametrize("sigma,expected", [(0.5, 166.566), (0.7, 77.717), (1.0, 38.170)])
def test_high_epsilon_regime_never_crashes_and_is_correct(sigma, expected):
    # prv-accountant 0.2.0 raises "Discrete mean differs..." at σ = 0.5 and 0.7 here.
    b = prv(sigma, 0.2, 500).epsilon(1e-5)
    assert all(math.isfinite(v) for v in b[:3])
    assert b.lower <= expected + 1e-3 and expected - 1e-3 <= b.upper
    ref = pld_epsilon([(sigma, 0.2, 500)], 1e-5, vdi=1e-3)
    assert b.lower <= ref <= b.upper + 2e-3


def test_agrees_with_prv_accountant_package_where_it_works():
    from prv_accountant import PoissonSubsampledGaussianMechanism
    from prv_accountant import PRVAccountant as UpstreamPRV

    up = UpstreamPRV(
        prvs=[PoissonSubsampledGaussianMechanism(sampling_probability=0.01, noise_multiplier=1.1)],
        max_self_compositions=[1000], eps_error=0.01, delta_error=1e-8,
    )
    lo, est, hi = up.compute_epsilon(delta=1e-5, num_self_compositions=[1000])
    b = prv(1.1, 0.01, 1000).epsilon(1e-5)
    assert abs(b.estimate - est) < 1e-3
    assert b.lower <= hi and lo <= b.upper


def test_delta_is_the_inverse_of_epsilon():
    a = prv(1.1, 0.01, 2000)
    e = a.epsilon(1e-5)
    d = a.delta(e.estimate)
    assert d.estimate == pytest.approx(1e-5, rel=1e-3)
    assert a.delta(e.upper).upper <= 1e-5 * 1.001
    assert a.delta(e.lower).lower >= 1e-5 * 0.999


# ----------------------------------------------------------------------------------
# fallback
# ----------------------------------------------------------------------------------
def test_fallback_to_pld_on_prv_failure(monkeypatch):
    good = prv(0.9, 0.05, 300).epsilon(1e-5)

    def broken(*args, **kwargs):
        raise RuntimeError("Discrete mean differs from continuous mean significantly.")

    monkeypatch.setattr(prv_module, "_discretise", broken)
    acct = prv(0.9, 0.05, 300)
    with pytest.warns(RuntimeWarning, match="PLD"):
        b = acct.epsilon(1e-5)
    assert b.method == "pld"
    assert "Discrete mean differs" in acct.last_fallback_reason
    assert b.lower <= good.upper and good.lower <= b.upper
    assert abs(b.upper - good.estimate) < 0.02
    assert acct.delta(b.upper).method == "pld"
    with pytest.raises(PRVFailure):
        prv(0.9, 0.05, 300, fallback=False).epsilon(1e-5)


def test_fallback_on_non_finite_and_inconsistent_results(monkeypatch):
    real = prv_module._discretise

    def nan_pmf(*args, **kwargs):
        pmf, shift, mean = real(*args, **kwargs)
        pmf = pmf.copy()
        pmf[len(pmf) // 2] = np.nan
        return pmf, shift, mean

    monkeypatch.setattr(prv_module, "_discretise", nan_pmf)
    with pytest.warns(RuntimeWarning):
        assert prv(1.0, 0.01, 100).epsilon(1e-5).method == "pld"

    for cells in (-30, 30):  # a mis-aligned PMF (too optimistic or too pessimistic)
        def shifted(*args, **kwargs):
            pmf, shift, mean = real(*args, **kwargs)
            return np.roll(pmf, cells), shift, mean

        monkeypatch.setattr(prv_module, "_discretise", shifted)
        acct = prv(1.0, 0.01, 100)
        with pytest.warns(RuntimeWarning, match="mean"):
            assert acct.epsilon(1e-5).method == "pld"

    def lower_above_rdp(*args, **kwargs):  # the RDP cross-check catches what the mean check cannot
        return EpsilonBounds(50.0, 50.0, 50.0, "prv")

    monkeypatch.setattr(prv_module, "_discretise", real)
    monkeypatch.setattr(prv_module.PRVAccountant, "_prv_epsilon_raw", lower_above_rdp)
    with pytest.warns(RuntimeWarning, match="RDP"):
        b = prv(1.0, 0.01, 100).epsilon(1e-5)
    assert b.method == "pld" and b.upper < 50


def test_fallback_when_grid_too_large():
    with pytest.warns(RuntimeWarning, match="max_grid_size"):
        b = prv(1.0, 0.1, 200, max_grid_size=1000).epsilon(1e-5)
    assert b.method == "pld"
    assert b.lower <= prv(1.0, 0.1, 200).epsilon(1e-5).upper


def dp_accounting_rdp(sigma, q, steps, *, delta=None, epsilon=None):
    """ε (or δ) from dp-accounting's RDP accountant: an independent valid upper bound."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant()
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(delta) if epsilon is None else acc.get_delta(epsilon)


def test_fallback_at_tiny_delta_is_never_looser_than_rdp():
    # Below δ ~ 1e-12 the PRV round-off check fails and dp-accounting's PLD is noise:
    # at δ = 1e-14 its optimistic ε was 8.60 and its pessimistic 8.77 against a valid
    # RDP bound of 4.98; at δ = 1e-15 it returned inf and the accountant raised.
    acct = prv(1.0, 0.01, 1000)
    uppers = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for delta in (1e-10, 1e-12, 1e-13, 1e-14, 1e-15, 1e-20):
            b = acct.epsilon(delta)
            ref = dp_accounting_rdp(1.0, 0.01, 1000, delta=delta)
            assert math.isfinite(b.upper) and 0.0 <= b.lower <= b.estimate <= b.upper
            assert b.upper <= ref * (1 + 1e-4), (delta, b, ref)
            uppers.append(b.upper)
    assert uppers == sorted(uppers)  # a smaller δ never gets a smaller ε
    assert acct.epsilon(1e-14).method == "rdp"
    # the PLD still answers where it is trusted (its round-off, ~1e-12 here, below δ/10),
    # and is tighter than RDP there
    b = prv_module.pld_epsilon(((1.0, 0.01, 1000),), 1e-10)
    assert b.method == "pld" and b.upper < dp_accounting_rdp(1.0, 0.01, 1000, delta=1e-10)
    assert prv_module.pld_epsilon(((1.0, 0.01, 1000),), 1e-12).method == "rdp"
    # calibration at a tiny δ adds no more noise than RDP calibration (it added 24 % more)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        s_prv = calibrate_noise(target_epsilon=5.0, delta=1e-14, sample_rate=0.01, steps=1000)
    s_rdp = calibrate_noise(target_epsilon=5.0, delta=1e-14, sample_rate=0.01, steps=1000, accountant="rdp")
    assert s_prv <= s_rdp * 1.002


def test_fallback_survives_millions_of_steps():
    # ~2e6 steps: the optimistic PLD's losses reach -709 and dp-accounting raised
    # OverflowError from the fallback itself.
    acct = prv(0.5, 1e-3, 2_000_000)
    with pytest.warns(RuntimeWarning, match="max_grid_size"):
        b = acct.epsilon(1e-6)
    ref = dp_accounting_rdp(0.5, 1e-3, 2_000_000, delta=1e-6)
    assert b.method in ("pld", "rdp") and math.isfinite(b.upper)
    assert 0.0 <= b.lower <= b.upper <= ref * (1 + 1e-4)
    # ... and where the PRV does work, the fallback agrees with it (pessimistic side)
    p = prv(0.5, 1e-3, 20_000).epsilon(1e-6)
    f = prv_module.pld_epsilon(((0.5, 1e-3, 20_000),), 1e-6)
    assert p.lower - 1e-3 <= f.upper and f.lower <= p.upper


def test_delta_at_a_large_epsilon_is_never_looser_than_rdp():
    # the PRV's upper δ is at least its δ error (1e-10 by default): at ε = 5 it said 1.0e-10 where
    # RDP proves 8.4e-15 (and its estimate, 2.4e-14, was above that valid bound)
    acct = prv(1.0, 0.01, 1000)
    last = 1.0
    for eps in (1.0, 2.0, 3.0, 4.0, 5.0, 8.0):
        d = acct.delta(eps)
        ref = dp_accounting_rdp(1.0, 0.01, 1000, epsilon=eps)
        assert 0.0 <= d.lower <= d.estimate <= d.upper <= min(last, ref * (1 + 1e-4)), (eps, d, ref)
        last = d.upper
    assert acct.delta(2.0).method == "prv" and acct.delta(5.0).method == "rdp"


def test_delta_fallback_is_never_looser_than_rdp(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("Discrete mean differs from continuous mean significantly.")

    monkeypatch.setattr(prv_module, "_discretise", broken)
    acct = prv(1.0, 0.01, 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for eps, method in ((2.0, "pld"), (5.0, "rdp"), (9.0, "rdp")):
            d = acct.delta(eps)
            ref = dp_accounting_rdp(1.0, 0.01, 1000, epsilon=eps)
            assert d.method == method, (eps, d)
            assert 0.0 <= d.lower <= d.upper <= ref * (1 + 1e-4) + 1e-300, (eps, d, ref)
            assert d.upper <= 1.0


def test_delta_fallback_mesh_follows_the_history_not_the_queried_epsilon(monkeypatch):
    """Review, round 38: delta(ε)'s PLD fallback took its mesh from the queried ε, so δ(0) of a
    history of ε in the hundreds (σ = 0.0126, one step) ran on the finest mesh (107 s). Its mesh now
    follows the history's RDP ε (as epsilon()'s does); the bounds still contain the exact δ(0) of one
    subsampled step, q·(2Φ(1/(2σ)) − 1)."""
    seen = []
    real = prv_module.pld_delta

    def spy(groups, epsilon, **kw):
        seen.append(kw["scale"])
        return real(groups, epsilon, **kw)

    monkeypatch.setattr(prv_module, "pld_delta", spy)
    monkeypatch.setattr(prv_module, "_discretise", lambda *a, **k: (_ for _ in ()).throw(PRVFailure("forced")))
    sigma, q = 0.05, 1e-3
    acct = prv(sigma, q, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        d = acct.delta(0.0)
    rdp_eps = dp_accounting_rdp(sigma, q, 1, delta=prv_module.DELTA_SCALE_AT)
    assert seen and seen[0] >= 0.5 * rdp_eps > 1.0
    exact = q * (2 * special.ndtr(1 / (2 * sigma)) - 1)
    assert d.method == "pld" and d.lower <= exact * (1 + 1e-9) and exact <= d.upper * (1 + 1e-9), (d, exact)


# ----------------------------------------------------------------------------------
# RDP
# ----------------------------------------------------------------------------------
@CHEAP
@given(q=st.floats(1e-4, 1.0), sigma=st.floats(0.4, 20.0))
def test_rdp_integer_orders_match_dp_accounting(q, sigma):
    from dp_accounting.rdp.rdp_privacy_accountant import _compute_rdp_poisson_subsampled_gaussian

    orders = [a for a in DEFAULT_RDP_ORDERS if float(a).is_integer()]
    ours = rdp_poisson_subsampled_gaussian(noise_multiplier=sigma, sample_rate=q, orders=orders)
    ref = _compute_rdp_poisson_subsampled_gaussian(q, sigma, orders)
    np.testing.assert_allclose(ours, ref, rtol=1e-9, atol=1e-300)


@CHEAP
@given(q=st.floats(1e-3, 0.9), sigma=st.floats(0.4, 10.0), alpha=st.floats(1.05, 12.0))
def test_rdp_fractional_orders_match_direct_integration(q, sigma, alpha):
    def integrand(x):
        ratio = 1 - q + q * math.exp((2 * x - 1) / (2 * sigma ** 2))
        return math.exp(-x * x / (2 * sigma ** 2)) / (sigma * math.sqrt(2 * math.pi)) * ratio ** alpha

    lo, hi = -40 * sigma, alpha + 40 * sigma
    pts = sorted({0.0, 0.5, 1.0, alpha, min(hi, 2 * alpha)})
    val, _ = integrate.quad(integrand, lo, hi, points=pts, limit=500, epsabs=0, epsrel=1e-12)
    expected = math.log(val) / (alpha - 1)
    ours = rdp_poisson_subsampled_gaussian(noise_multiplier=sigma, sample_rate=q, orders=[alpha])[0]
    assert ours == pytest.approx(expected, rel=1e-6, abs=1e-13)


@CHEAP
@given(
    q=st.sampled_from([1e-3, 0.01, 0.1, 1.0]),
    sigma=st.floats(0.5, 5.0),
    steps=st.integers(1, 5000),
    delta=st.sampled_from([1e-5, 1e-8]),
)
def test_rdp_accountant_matches_dp_accounting_and_bounds_prv(q, sigma, steps, delta):
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    orders = [a for a in DEFAULT_RDP_ORDERS if float(a).is_integer()]  # exact in both
    ref = rdp_privacy_accountant.RdpAccountant(orders=orders)
    ref.compose(dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps))
    ours = RDPAccountant(orders=orders).step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    e = ours.epsilon(delta)
    assert e.method == "rdp" and e.lower == 0.0
    assert e.upper == pytest.approx(ref.get_epsilon(delta), rel=1e-7, abs=1e-9)
    d = ours.delta(1.0)
    assert d.upper == pytest.approx(ref.get_delta(1.0), rel=1e-6, abs=1e-15)
    # RDP is a valid upper bound: never below the PRV lower bound
    assert RDPAccountant().step(noise_multiplier=sigma, sample_rate=q, num_steps=steps).epsilon(delta).upper \
        >= prv(sigma, q, steps).epsilon(delta).lower - 1e-9


# ----------------------------------------------------------------------------------
# calibration and planning
# ----------------------------------------------------------------------------------
@settings(max_examples=4, deadline=None, derandomize=True)
@given(
    target=st.floats(0.5, 10.0),
    q=st.sampled_from([1e-3, 0.01, 0.1]),
    steps=st.integers(100, 5000),
)
def test_calibrate_then_epsilon_round_trip(target, q, steps):
    sigma = calibrate_noise(target_epsilon=target, delta=1e-5, sample_rate=q, steps=steps)
    assert prv(sigma, q, steps).epsilon(1e-5).upper <= target
    assert prv(sigma * (1 - 1e-3), q, steps).epsilon(1e-5).upper > target  # smallest to rtol


def test_calibrate_returns_the_sigma_it_evaluated_at_the_range_ends():
    # (review, round 37) met at sigma_range[0]: it returned s_min, but had evaluated exp(log(s_min)),
    # one ulp above it for some s_min, whose ε is a hair lower: the returned σ's ε exceeded the target
    q, steps, delta = 0.01, 10, 1e-5
    checked = 0
    for s_min in (0.1, 0.3, 0.7, 1.1, 0.45):
        above = math.exp(math.log(s_min))
        if above == s_min:
            continue
        target = prv(above, q, steps).epsilon(delta).upper
        if not prv(s_min, q, steps).epsilon(delta).upper > target:
            continue
        checked += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (before the fix: "met already at the smallest σ")
            sigma = calibrate_noise(target_epsilon=target, delta=delta, sample_rate=q, steps=steps,
                                    sigma_range=(s_min, 1000.0))
        assert sigma >= s_min
        assert prv(sigma, q, steps).epsilon(delta).upper <= target
    assert checked  # (at least one s_min whose exp(log) is not itself and whose ε tells them apart)
    # the upper end too (mutation review, round 41): met only at sigma_range[1], it returns s_max
    # itself, not exp(log(s_max)), which is one ulp below it for some s_max and has a higher ε
    checked = 0
    for s_max in (0.35, 2.89):
        below = math.exp(math.log(s_max))
        if below >= s_max:
            continue
        target = prv(s_max, q, steps).epsilon(delta).upper
        if not prv(below, q, steps).epsilon(delta).upper > target:
            continue
        checked += 1
        sigma = calibrate_noise(target_epsilon=target, delta=delta, sample_rate=q, steps=steps,
                                sigma_range=(0.2, s_max))
        assert sigma == s_max and prv(sigma, q, steps).epsilon(delta).upper <= target
    assert checked

def test_calibrate_rdp_is_one_word_and_more_conservative():
    kw = dict(target_epsilon=3.0, delta=1e-5, sample_rate=0.01, steps=2000)
    s_rdp = calibrate_noise(**kw, accountant="rdp")
    s_prv = calibrate_noise(**kw)
    assert s_rdp > s_prv
    r = RDPAccountant().step(noise_multiplier=s_rdp, sample_rate=0.01, num_steps=2000)
    assert r.epsilon(1e-5).upper <= 3.0
    assert RDPAccountant().step(noise_multiplier=s_rdp * 0.999, sample_rate=0.01, num_steps=2000) \
        .epsilon(1e-5).upper > 3.0
    assert isinstance(make_accountant("rdp"), RDPAccountant)
    assert isinstance(make_accountant("prv"), PRVAccountant)


def test_plan_privacy():
    plan = plan_privacy(3.0, 1e-5, 50_000, 500, 3)
    assert isinstance(plan, PrivacyPlan)
    assert plan.sample_rate == pytest.approx(0.01)
    assert plan.steps == 300
    assert plan.epsilon.upper <= 3.0 and plan.epsilon.method == "prv"
    assert plan.accountant == "prv"
    assert plan.noise_multiplier == calibrate_noise(target_epsilon=3.0, delta=1e-5, sample_rate=0.01, steps=300)
    plan_rdp = plan_privacy(3.0, 1e-5, 50_000, 500, 3, accountant="rdp")
    assert plan_rdp.accountant == "rdp" and plan_rdp.noise_multiplier > plan.noise_multiplier
    assert plan_privacy(3.0, 1e-5, 1000, 64, 2.5).steps == math.ceil(2.5 * 1000 / 64)


# ----------------------------------------------------------------------------------
# state, caching, speed
# ----------------------------------------------------------------------------------
def test_state_dict_round_trip():
    acct = PRVAccountant(eps_error=0.02)
    acct.step(noise_multiplier=1.1, sample_rate=0.01, num_steps=100)
    acct.step(noise_multiplier=0.9, sample_rate=0.02, num_steps=50)
    state = json.loads(json.dumps(acct.state_dict()))
    acct2 = PRVAccountant.from_state_dict(state)
    assert acct2.eps_error == 0.02
    assert acct2.history == acct.history
    assert acct2.epsilon(1e-5) == acct.epsilon(1e-5)
    r = RDPAccountant.from_state_dict(state)  # histories are accountant-agnostic
    assert r.history == acct.history
    assert r.epsilon(1e-5).upper >= acct.epsilon(1e-5).lower
    fresh = PRVAccountant()
    fresh.load_state_dict(state)
    assert fresh.num_steps == 150
    with pytest.raises(ValueError, match="history"):
        PRVAccountant.from_state_dict({"nope": 1})


def test_empty_history_and_zero_steps():
    a = PRVAccountant()
    a.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=0)
    assert a.epsilon(1e-5) == EpsilonBounds(0.0, 0.0, 0.0, "none")
    assert a.delta(1.0).upper == 0.0
    assert RDPAccountant().epsilon(1e-5).upper == 0.0


def test_running_epsilon_is_monotone_and_equals_a_fresh_accountant():
    # Speed (running ε per step, 10k-step ε, calibration) is measured in
    # benchmarks/bench_accounting.py, not asserted here: timed tests are flaky on shared machines.
    acct = PRVAccountant()
    prev = 0.0
    for _ in range(300):
        acct.step(noise_multiplier=1.0, sample_rate=0.01)
        e = acct.epsilon(1e-5)
        assert e.estimate >= prev
        prev = e.estimate
    assert acct.epsilon(1e-5) == e  # repeated query: same (cached) answer
    assert e == prv(1.0, 0.01, 300).epsilon(1e-5)  # same as a fresh accountant


# ----------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("q", [0.0, -0.1, 1.5, float("nan")])
def test_bad_sample_rate(q):
    with pytest.raises(ValueError, match=r"sample_rate must be in \(0, 1\]"):
        PRVAccountant().step(noise_multiplier=1.0, sample_rate=q)
    with pytest.raises(ValueError, match="sample_rate"):
        calibrate_noise(target_epsilon=1.0, delta=1e-5, sample_rate=q, steps=10)


@pytest.mark.parametrize("sigma", [0.0, -1.0, float("inf")])
def test_bad_noise_multiplier(sigma):
    with pytest.raises(ValueError, match="noise_multiplier must be a finite number > 0"):
        RDPAccountant().step(noise_multiplier=sigma, sample_rate=0.1)


def test_changing_eps_error_after_a_query_takes_a_new_grid():
    """Review, round 35: the grid cache's key left out eps_error, so after `a.eps_error = 1e-4` a
    query reused the mesh built for eps_error=1 and reported bounds [1.8925, 1.8930] around a true
    ε of 1.829."""
    a = prv(1.0, 0.01, 1000)
    a.eps_error = 1.0
    a.epsilon(1e-5)
    a.eps_error = 1e-3
    got, ref = a.epsilon(1e-5), prv(1.0, 0.01, 1000, eps_error=1e-3).epsilon(1e-5)
    assert got == ref
    assert got.lower <= pld_epsilon([(1.0, 0.01, 1000)], 1e-5) <= got.upper + 2e-3


@pytest.mark.parametrize("sigma", [1e-3, 0.0099])
def test_a_tiny_noise_multiplier_is_refused_not_run_out_of_memory(sigma):
    """Review, round 35: σ = 1e-3 passed the checks, then the RDP/PRV grids (∝ 1/σ²) took over 24 GB
    and the OS killed the process with no Python error."""
    from pdpsgd.accounting import rdp_poisson_subsampled_gaussian

    for acct in (PRVAccountant(), RDPAccountant()):
        with pytest.raises(ValueError, match="below 0.01: ε would be in the thousands"):
            acct.step(noise_multiplier=sigma, sample_rate=0.01)
    with pytest.raises(ValueError, match="below 0.01"):
        rdp_poisson_subsampled_gaussian(noise_multiplier=sigma, sample_rate=0.01)
    with pytest.raises(ValueError, match="below the smallest σ"):
        calibrate_noise(target_epsilon=1.0, delta=1e-5, sample_rate=0.01, steps=10, sigma_range=(sigma, 10.0))
    PRVAccountant().step(noise_multiplier=0.01, sample_rate=0.01)  # (the floor itself is taken)


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 2.0])
def test_bad_delta(delta):
    a = prv(1.0, 0.1, 10)
    with pytest.raises(ValueError, match=r"delta must be in the open interval \(0, 1\)"):
        a.epsilon(delta)
    with pytest.raises(ValueError, match="delta"):
        calibrate_noise(target_epsilon=1.0, delta=delta, sample_rate=0.1, steps=10)


def test_bad_steps_and_epsilon():
    with pytest.raises(ValueError, match="num_steps must be >= 0"):
        PRVAccountant().step(noise_multiplier=1.0, sample_rate=0.1, num_steps=-1)
    with pytest.raises(TypeError, match="integer"):
        PRVAccountant().step(noise_multiplier=1.0, sample_rate=0.1, num_steps=1.5)
    with pytest.raises(ValueError, match="steps must be >= 0"):
        calibrate_noise(target_epsilon=1.0, delta=1e-5, sample_rate=0.1, steps=-5)
    with pytest.raises(ValueError, match="epsilon must be a finite number >= 0"):
        prv(1.0, 0.1, 10).delta(-1.0)
    with pytest.raises(ValueError, match="target_epsilon must be"):
        calibrate_noise(target_epsilon=0.0, delta=1e-5, sample_rate=0.1, steps=10)
    with pytest.raises(ValueError, match="unknown accountant"):
        make_accountant("moments")
    with pytest.raises(ValueError, match="expected_batch_size"):
        plan_privacy(1.0, 1e-5, 100, 200, 1)


def test_unreachable_target_names_the_search_range():
    with pytest.raises(ValueError, match=r"unreachable.*search range is \[0\.1, 50\]"):
        calibrate_noise(target_epsilon=0.05, delta=1e-5, sample_rate=0.5, steps=10_000, sigma_range=(0.1, 50))


def test_target_met_at_smallest_sigma_warns():
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        s = calibrate_noise(target_epsilon=1000.0, delta=1e-5, sample_rate=0.01, steps=10, sigma_range=(0.5, 10))
    assert s == 0.5
    assert [w.filename for w in rec if "smallest" in str(w.message)] == [__file__]


def test_delta_of_the_reported_epsilon_is_at_most_the_target_delta():
    """δ(ε(δ).upper).upper ≤ δ also for small δ (review, round 36: delta() used an absolute δ error of
    1e-10 whatever the answer, so at δ = 3e-10 it reported 4e-10 for the ε reported at 3e-10)."""
    from pdpsgd.accounting import PRVAccountant

    acct = PRVAccountant().step(noise_multiplier=1.0, sample_rate=0.01, num_steps=1000)
    for target in (1e-5, 1e-8, 1e-9, 3e-10):
        eps = acct.epsilon(delta=target)
        back = acct.delta(epsilon=eps.upper)
        assert back.upper <= target * (1 + 1e-9), (target, eps, back)
        assert back.lower <= target


def test_a_history_too_long_for_the_pld_fallback_is_answered_by_rdp(monkeypatch):
    """1e8 steps (σ = 50, q = 1e-4): the PRV grid is too large and the PLD fallback's sparse
    self-composition never returned (review, round 36: dp-accounting evaluates size**steps as a
    Python integer). Past PLD_MAX_STEPS the fallback answers with RDP, at once; a PLD that fails
    (a MemoryError) does too."""
    from pdpsgd.accounting import PRVAccountant, RDPAccountant
    from pdpsgd.accounting import prv

    n = 10**8
    rdp = RDPAccountant().step(noise_multiplier=50.0, sample_rate=1e-4, num_steps=n).epsilon(1e-5).upper
    real = prv._pld_pair

    def guarded(groups, *a, **k):
        assert sum(c for _, _, c in groups) <= prv.PLD_MAX_STEPS, "the PLD of a history past PLD_MAX_STEPS"
        return real(groups, *a, **k)

    monkeypatch.setattr(prv, "_pld_pair", guarded)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acct = PRVAccountant().step(noise_multiplier=50.0, sample_rate=1e-4, num_steps=n)
        eps = acct.epsilon(1e-5)
        assert eps.method == "rdp" and eps.upper == pytest.approx(rdp, rel=1e-12)
        d = acct.delta(eps.upper)
        assert d.method == "rdp" and d.upper <= 1e-5 * (1 + 1e-9)

    def broken(*a, **k):
        raise MemoryError("composition too large")

    monkeypatch.setattr(prv, "_pld_pair", broken)
    groups = ((1.0, 0.01, 1000),)
    e = prv.pld_epsilon(groups, 1e-5)
    assert e.method == "rdp" and math.isfinite(e.upper)
    d = prv.pld_delta(groups, 2.0)
    assert d.method == "rdp" and 0 < d.upper < 1


# ----------------------------------------------------------------------------------
# mutation review, round 40: changes the suite did not notice
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["prv", "rdp"])
def test_repeats_of_one_setting_that_are_not_adjacent_all_count(kind):
    """(σ1, q, 5), (σ2, q, 3), (σ1, q, 5) is (σ1, q, 10) + (σ2, q, 3): composition commutes, and the
    runs of one setting add up (a max of them counted 5 of the 10)."""
    a, b = make_accountant(kind), make_accountant(kind)
    for s, n in ((1.1, 5), (2.0, 3), (1.1, 5)):
        a.step(noise_multiplier=s, sample_rate=0.05, num_steps=n)
    b.step(noise_multiplier=1.1, sample_rate=0.05, num_steps=10)
    b.step(noise_multiplier=2.0, sample_rate=0.05, num_steps=3)
    c = make_accountant(kind)
    c.step(noise_multiplier=1.1, sample_rate=0.05, num_steps=5)
    c.step(noise_multiplier=2.0, sample_rate=0.05, num_steps=3)
    assert a.epsilon(1e-5).upper == pytest.approx(b.epsilon(1e-5).upper, rel=1e-9)
    assert a.epsilon(1e-5).upper > c.epsilon(1e-5).upper * 1.05


def test_a_plans_epsilon_is_its_own_steps():
    """plan.epsilon is what a fresh accountant gives for plan.steps steps at (σ, q), not one fewer."""
    plan = plan_privacy(3.0, 1e-5, num_examples=1000, expected_batch_size=50, epochs=2)
    acct = make_accountant("prv")
    acct.step(noise_multiplier=plan.noise_multiplier, sample_rate=plan.sample_rate, num_steps=plan.steps)
    assert plan.epsilon.upper == pytest.approx(acct.epsilon(1e-5).upper, rel=1e-12)
    fewer = make_accountant("prv")
    fewer.step(noise_multiplier=plan.noise_multiplier, sample_rate=plan.sample_rate, num_steps=plan.steps - 1)
    assert fewer.epsilon(1e-5).upper < plan.epsilon.upper


def test_pld_fallback_takes_its_epsilon_at_delta_less_its_roundoff(monkeypatch):
    """The pessimistic PLD's ε is read at δ − r (r its round-off bound), and is the answer when below
    RDP's: with r made large, reading it at δ understates it."""
    groups = ((1.0, 0.01, 200),)
    delta = 1e-5
    pess, _ = prv_module._pld_or_none(groups, 0.01)
    monkeypatch.setattr(prv_module, "pld_roundoff", lambda pld, steps: 0.09 * delta)
    res = prv_module.pld_epsilon(groups, delta, eps_error=0.01)
    assert res.method == "pld", res
    assert res.upper == pytest.approx(pess.get_epsilon_for_delta(delta - 0.09 * delta), rel=1e-9)
    assert res.upper > pess.get_epsilon_for_delta(delta) + 1e-4


def test_prv_answer_is_rdps_whenever_rdp_is_below_prvs_upper_bound(monkeypatch):
    """RDP's ε is a valid upper bound: taken whenever it is below the PRV's upper bound (also when
    above the PRV's estimate)."""
    acct = PRVAccountant()
    acct.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=100)
    groups = acct._groups()
    rdp_eps, _ = prv_module.epsilon_from_rdp(prv_module._RDP_ORDERS, acct._total_rdp(groups), 1e-5)
    monkeypatch.setattr(PRVAccountant, "_prv_epsilon_raw",
                        lambda self, g, d, e: EpsilonBounds(rdp_eps * 0.5, rdp_eps * 0.9, rdp_eps * 1.1, "prv"))
    res = acct._prv_epsilon(groups, 1e-5, 1e-7)
    assert res.upper == pytest.approx(rdp_eps) and res.method == "rdp"


def test_a_plan_with_delta_not_below_one_over_n_warns():
    """Review of round 40: δ = 0.5 was accepted without a word (it permits publishing an example)."""
    with pytest.warns(UserWarning, match="not below 1/N"):
        plan_privacy(8.0, 0.02, num_examples=100, expected_batch_size=10, epochs=1, accountant="rdp")
    with pytest.warns(UserWarning, match="not below 1/N"):  # (δ = 1/N itself: mutation review, round 41)
        plan_privacy(8.0, 0.01, num_examples=100, expected_batch_size=10, epochs=1, accountant="rdp")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_privacy(8.0, 1e-3, num_examples=100, expected_batch_size=10, epochs=1, accountant="rdp")


def test_calibrate_noise_gives_one_fallback_warning_per_call():
    """Each σ the search tries fails PRV for its own reason (numbers in it): one warning per call that says
    how many fell back, not one per σ (review, round 42: five RuntimeWarnings from one call); the search's
    other warnings still come through."""
    from pdpsgd.accounting import calibrate_noise

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s = calibrate_noise(target_epsilon=3, delta=0.5, sample_rate=0.01, steps=100)
    fell = [x for x in w if "PRV accounting unreliable" in str(x.message)]
    assert len(fell) == 1 and len(w) == 1 and fell[0].category is RuntimeWarning, [str(x.message) for x in w]
    assert re.search(r"at [2-9]\d* of the σ the search tried", str(fell[0].message)), str(fell[0].message)
    assert fell[0].filename == __file__  # (the user's line, as pdpsgd's warnings name it)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert calibrate_noise(target_epsilon=3, delta=1e-5, sample_rate=0.01, steps=100, sigma_range=(5, 50)) == 5
    assert len(w) == 1 and "met already at the smallest σ" in str(w[0].message)
    assert 0 < s < 1


# ----------------------------------------------------------------------------------
# mutation review, round 44: each test below fails under a mutant the suite had let pass (the grid's mesh and
# domain, the round-off guards, the PLD floor, delta_error >= delta, zero-step runs loaded, calibration's start)
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("sigma,steps,delta,delta_error,method", [(2.0, 100, 1e-5, 5e-6, "prv"),
                                                                   (5.0, 1000, 1e-6, 9e-7, "rdp")])
def test_epsilon_bounds_fold_a_large_delta_error_the_right_way(sigma, steps, delta, delta_error, method):
    """With δ_error a large part of δ, upper must be read at δ − δ_err and lower at δ + δ_err:
    the bounds still contain the exact Gaussian ε (q = 1)."""
    exact = gaussian_epsilon(delta, math.sqrt(steps) / sigma)
    b = prv(sigma, 1.0, steps, delta_error=delta_error).epsilon(delta)
    assert b.lower <= exact <= b.upper, (b, exact)
    # the PRV answers itself (an inverted δ-error fold makes its bounds inconsistent -> PLD fallback),
    # or RDP where RDP is the tighter bound
    assert b.method == method, b


def test_delta_beyond_the_prv_grid_is_never_zero_and_bounds_the_exact_delta():
    """Far past the PRV grid the discrete δ is 0; the reported upper bound must still be positive and
    above the exact δ (the δ error is added, then RDP, tighter, answers)."""
    sigma, steps = 2.0, 100
    mu = math.sqrt(steps) / sigma
    acct = prv(sigma, 1.0, steps)
    for eps in (45.0, 60.0):
        exact = gaussian_delta(eps, mu)
        assert exact > 0
        d = acct.delta(eps)
        assert d.upper >= exact, (eps, d, exact)
        assert d.lower <= exact


@pytest.mark.parametrize("sigma,q,steps,delta", [(1.0, 0.01, 1000, 1e-5), (0.8, 0.05, 300, 1e-6),
                                                  (2.0, 1.0, 50, 1e-5), (1.1, 0.02, 17, 1e-5)])
def test_prv_grid_is_as_fine_and_as_wide_as_the_error_analysis_requires(sigma, q, steps, delta):
    """The grid of a query must satisfy Gopi et al.'s conditions, as the upstream package computes them:
    mesh h <= eps_error / sqrt(steps/2 · log(12/δ_err)) and domain ⊇ [-L, L] with
    L = prv_accountant.accountant.compute_safe_domain_size(...)."""
    from prv_accountant import PoissonSubsampledGaussianMechanism
    from prv_accountant.accountant import compute_safe_domain_size

    acct = prv(sigma, q, steps)
    b = acct.epsilon(delta)
    assert b.method in ("prv", "rdp")
    derr = max(delta / 1000.0, min(1e-12, delta / 10.0))  # the documented default δ error
    g = acct._grid_state(acct._groups(), derr).grid
    h_req = 0.01 / math.sqrt(steps / 2.0 * math.log(12.0 / derr))
    L_req = compute_safe_domain_size([PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=sigma)],
                                     [steps], 0.01, derr)
    assert g.h <= h_req * (1 + 1e-12), (g.h, h_req)
    assert g.t_max >= L_req * (1 - 1e-9) and -g.t_min >= L_req * (1 - 1e-9), (g.t_min, g.t_max, L_req)


def test_pld_roundoff_grows_with_the_number_of_composed_steps():
    """dp-accounting composes n steps by an n-th power of a float64 FFT: a smooth error of up to
    ~1.5·n ulps (measured, see prv.POWER_ROUNDOFF) that leaves no negative PMF entries. The round-off
    bound of the PLD fallback must grow at least that fast with n, whatever the PMF shows."""
    pess, _ = prv_module._pld_pair(((1000.0, 1.0, 1),), 0.01)
    eps64 = float(np.finfo(np.float64).eps)
    r1 = prv_module.pld_roundoff(pess, 1)
    for n in (10 ** 5, 10 ** 7):
        assert prv_module.pld_roundoff(pess, n) - r1 >= 1.5 * (n - 1) * eps64


def test_loaded_zero_step_runs_are_dropped_like_step_drops_them():
    """step(num_steps=0) records nothing; a state with zero-step runs loads to the same history
    (they must not show up in ``history`` / ``state_dict``, nor make an empty history non-empty)."""
    a = PRVAccountant.from_state_dict({"history": [[1.0, 0.1, 0], [2.0, 0.1, 5], [3.0, 0.2, 0]]})
    assert [tuple(r) for r in a.history] == [(2.0, 0.1, 5)]
    assert a.state_dict()["history"] == [[2.0, 0.1, 5]]
    b = RDPAccountant.from_state_dict({"history": [[1.0, 0.1, 0]]})
    assert b.history == () and b.epsilon(1e-5).method == "none"


def test_pld_delta_fallback_never_reports_a_pld_delta_below_its_trusted_floor():
    """Below PLD_MIN_DELTA (1e-12) dp-accounting's PLD is not trusted: pld_delta's answer is floored
    there, or comes from RDP (q = 1, σ = 1, 10 steps, ε = 27: the PLD alone says 5.7e-13)."""
    groups = ((1.0, 1.0, 10),)
    for eps in (24.0, 27.0, 30.0):
        d = prv_module.pld_delta(groups, eps)
        exact = gaussian_delta(eps, math.sqrt(10) / 1.0)
        assert d.upper >= exact
        assert d.method == "rdp" or d.upper >= prv_module.PLD_MIN_DELTA, (eps, d)


def test_a_delta_error_not_below_delta_is_refused():
    """delta_error >= δ leaves no room for a bound at δ − δ_err: a ValueError, not a silent fallback."""
    for de in (1e-5, 5e-5):
        with pytest.raises(ValueError, match="delta_error"):
            prv(1.0, 0.01, 100, delta_error=de).epsilon(1e-5)
    assert prv(1.0, 0.01, 100, delta_error=5e-6).epsilon(1e-5).upper > 0


def test_prv_epsilon_upper_covers_its_round_off_bound(monkeypatch):
    """The PRV's estimated float round-off r is folded into δ: upper is read at δ − δ_err − r. With r
    inflated (POWER_ROUNDOFF raised so that r ≈ 0.09 δ, still under MAX_ROUNDOFF) the upper bound must
    still cover the exact ε at δ − r (q = 1, exact Gaussian curve)."""
    sigma, steps, delta = 3.0, 100, 1e-5
    eps64 = float(np.finfo(np.float64).eps)
    monkeypatch.setattr(prv_module, "POWER_ROUNDOFF", 0.09 * delta / (steps * eps64))
    acct = prv(sigma, 1.0, steps)
    b = acct.epsilon(delta)
    r = acct._compose(acct._groups(), max(delta / 1000.0, min(1e-12, delta / 10.0))).roundoff
    assert 0.085 * delta < r < 0.1 * delta
    assert b.method == "prv", b
    mu = math.sqrt(steps) / sigma
    assert b.upper >= gaussian_epsilon(delta - r, mu), (b, gaussian_epsilon(delta - r, mu))
    assert b.lower <= gaussian_epsilon(delta + r, mu)


def test_prv_is_not_used_where_its_round_off_exceeds_a_tenth_of_delta(monkeypatch):
    """MAX_ROUNDOFF: the PRV answers only where its round-off bound r is below δ/10 (the estimate is
    generous, not rigorous); with r ≈ δ/2 (POWER_ROUNDOFF raised) the accountant falls back, and the
    fallback's bounds contain the exact ε (q = 1)."""
    sigma, steps, delta = 3.0, 100, 1e-5
    eps64 = float(np.finfo(np.float64).eps)
    monkeypatch.setattr(prv_module, "POWER_ROUNDOFF", 0.5 * delta / (steps * eps64))
    acct = prv(sigma, 1.0, steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        b = acct.epsilon(delta)
    assert b.method != "prv", b
    assert acct.last_fallback_reason and "round-off" in acct.last_fallback_reason
    exact = gaussian_epsilon(delta, math.sqrt(steps) / sigma)
    assert b.lower <= exact <= b.upper, (b, exact)


def test_pld_epsilon_below_the_trusted_delta_is_rdps():
    """Below PLD_MIN_DELTA (1e-12) the ε fallback is RDP's, even where the PLD's round-off check
    would pass (one step: r ≈ 7e-15); RDP's ε is above the exact one."""
    for sigma, delta in ((1.0, 5e-13), (5.0, 1e-13)):
        b = prv_module.pld_epsilon(((sigma, 1.0, 1),), delta)
        assert b.method == "rdp", b
        assert b.upper >= gaussian_epsilon(delta, 1.0 / sigma)


def test_calibration_needs_only_a_few_accountant_evaluations(monkeypatch):
    """calibrate_noise starts from the RDP solution (a bisection in log σ) and needs few PRV
    evaluations (docstring: typically 4-6); a wrong RDP start costs many more."""
    from pdpsgd.accounting import calibrate_noise

    calls = []
    real = PRVAccountant.epsilon

    def counting(self, delta):
        calls.append(self.history)
        return real(self, delta)

    monkeypatch.setattr(PRVAccountant, "epsilon", counting)
    sigma = calibrate_noise(target_epsilon=2.0, delta=1e-5, sample_rate=0.01, steps=500)
    assert prv(sigma, 0.01, 500).epsilon(1e-5).upper <= 2.0
    assert len(calls) <= 9, len(calls)
