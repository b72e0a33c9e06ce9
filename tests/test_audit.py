"""Membership-inference metrics, DP bounds and the one-run audit (pdpsgd.audit)."""
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from pdpsgd import audit as A


# ----------------------------------------------------------------------------- MIA metrics
def test_perfect_separation():
    r = A.mia_metrics([5, 6, 7, 1, 2, 3], [1, 1, 1, 0, 0, 0])
    assert r.auc == 1.0 and r.advantage == 1.0
    assert r.tpr_at_fpr[0.01] == 1.0 and r.tpr_at_fpr[0.001] == 1.0
    inv = A.mia_metrics([1, 2, 3, 5, 6, 7], [1, 1, 1, 0, 0, 0])
    assert inv.auc == 0.0 and inv.tpr_at_fpr[0.01] == 0.0


def test_identical_scores_are_chance():
    r = A.mia_metrics(np.zeros(10), np.arange(10) % 2 == 0)
    assert r.auc == 0.5 and r.advantage == 0.0 and r.tpr_at_fpr[0.01] == 0.0


def test_hand_made_case():
    # members 0.9, 0.4 ; non-members 0.5, 0.1: pairs (0.9>0.5, 0.9>0.1, 0.4<0.5, 0.4>0.1) -> 3/4
    r = A.mia_metrics([0.9, 0.4, 0.5, 0.1], [1, 1, 0, 0], fprs=(0.0, 0.5))
    assert r.auc == pytest.approx(0.75)
    assert r.tpr_at_fpr[0.0] == 0.5 and r.tpr_at_fpr[0.5] == 1.0
    assert r.advantage == pytest.approx(0.5)
    fpr, tpr, thr = A.roc_curve([0.9, 0.4, 0.5, 0.1], [1, 1, 0, 0])
    assert fpr[0] == tpr[0] == 0 and fpr[-1] == tpr[-1] == 1


def test_auc_matches_mannwhitney_and_ties():
    rng = np.random.default_rng(0)
    s = rng.integers(0, 5, 200).astype(float)  # many ties
    y = rng.random(200) < 0.4
    u = stats.mannwhitneyu(s[y], s[~y]).statistic
    assert A.mia_metrics(s, y).auc == pytest.approx(u / (y.sum() * (~y).sum()))


def test_loss_threshold_attack_direction():
    r = A.loss_threshold_attack([0.01, 0.02, 0.05], [1.0, 2.0, 0.5])  # members have low loss
    assert r.auc == 1.0 and r.num_members == 3 and r.num_nonmembers == 3


def test_metrics_reject_bad_input():
    with pytest.raises(ValueError):
        A.mia_metrics([1, 2], [1, 1])  # no non-member
    with pytest.raises(ValueError):
        A.mia_metrics([1, np.nan], [1, 0])
    with pytest.raises(ValueError):
        A.mia_metrics([1, 2, 3], [1, 0])


def test_logit_confidence():
    p = np.array([0.1, 0.5, 0.9, 0.999999])
    np.testing.assert_allclose(A.logit_confidence(-np.log(p)), np.log(p / (1 - p)), rtol=1e-6)
    assert np.isfinite(A.logit_confidence([0.0, 1e-20, 50.0])).all()


@pytest.mark.parametrize("online", [True, False])
@pytest.mark.parametrize("fix_variance", [True, False])
def test_lira_separates_simulated_shadows(online, fix_variance):
    rng = np.random.default_rng(1)
    K, n = 16, 400
    base = rng.normal(0, 2, n)  # example difficulty
    shadow_in = rng.random((K, n)) < 0.5
    shadow = base + 1.0 * shadow_in + rng.normal(0, 0.3, (K, n))
    member = rng.random(n) < 0.5
    target = base + 1.0 * member + rng.normal(0, 0.3, n)
    sc = A.lira_scores(target, shadow, shadow_in, online=online, fix_variance=fix_variance)
    lira = A.mia_metrics(sc, member)
    naive = A.mia_metrics(target, member)  # global threshold on the statistic
    assert lira.auc > 0.9 and lira.auc > naive.auc + 0.1


def test_lira_shapes_checked():
    with pytest.raises(ValueError):
        A.lira_scores(np.zeros(3), np.zeros((2, 4)), np.zeros((2, 4), bool))


# ----------------------------------------------------------------------------- DP bounds
def test_dp_tpr_bound():
    assert A.dp_tpr_bound(0.01, 1.0, 0.0) == pytest.approx(math.e * 0.01)
    assert A.dp_tpr_bound(0.0, 2.0, 1e-5) == pytest.approx(1e-5)
    assert A.dp_tpr_bound(0.5, math.inf, 0.0) == 1.0
    assert A.dp_tpr_bound(0.3, 0.0, 0.0) == pytest.approx(0.3)  # 0-DP: no better than chance
    f = np.linspace(0, 1, 101)
    b = A.dp_tpr_bound(f, 1.5, 1e-3)
    assert np.all(np.diff(b) >= -1e-15) and np.all(b >= f - 1e-12) and b[-1] == 1.0


def test_advantage_and_auc_bounds_consistent_with_curve():
    for eps, delta in [(0.5, 0.0), (1.0, 1e-5), (3.0, 1e-5)]:
        f = np.linspace(0, 1, 200001)
        assert A.dp_advantage_bound(eps, delta) == pytest.approx(np.max(A.dp_tpr_bound(f, eps, delta) - f), abs=1e-5)
        assert 0.5 <= A.dp_auc_bound(eps, delta) <= 1.0
    assert A.dp_auc_bound(0.0, 0.0) == pytest.approx(0.5, abs=1e-6)
    assert A.dp_advantage_bound(1.0, 0.0) == pytest.approx((math.e - 1) / (math.e + 1))


def test_empirical_epsilon_inverts_bound():
    for eps in [0.5, 1.0, 2.0]:
        fpr = 0.05
        tpr = A.dp_tpr_bound(fpr, eps, 0.0)
        assert A.empirical_epsilon(tpr, fpr, 0.0) == pytest.approx(eps)
    assert A.empirical_epsilon(0.3, 0.3) == 0.0


# ----------------------------------------------------------------------------- one-run audit
def test_audit_random_guesses_give_about_zero():
    assert A.one_run_audit_epsilon(500, 1000, 1000) == 0.0
    assert A.one_run_audit_epsilon(0, 0, 1000) == 0.0
    assert A.one_run_audit_epsilon(520, 1000, 1000) < 0.1


def test_audit_grows_with_accuracy_and_is_monotone():
    r = m = 1000
    eps = [A.one_run_audit_epsilon(v, r, m) for v in range(500, 1001, 25)]
    assert all(b >= a for a, b in zip(eps, eps[1:]))
    assert eps[-1] > 5.0 and eps[len(eps) // 2] > 0.5
    # all-correct bound ~ log(r / log(1/β)): more guesses, larger possible bound
    assert A.one_run_audit_epsilon(100, 100, 1000) < A.one_run_audit_epsilon(1000, 1000, 1000)


@given(v=st.integers(0, 200), r=st.integers(1, 200), d=st.sampled_from([0.0, 1e-6, 1e-3]))
def test_audit_monotone_in_correct_and_delta(v, r, d):
    v = min(v, r)
    m = 400
    e = A.one_run_audit_epsilon(v, r, m, d)
    assert e >= 0
    if v < r:
        assert A.one_run_audit_epsilon(v + 1, r, m, d) >= e - 1e-5
    assert A.one_run_audit_epsilon(v, r, m, 0.0) >= e - 1e-5  # δ only weakens the bound


def test_pvalue_properties():
    assert A.one_run_audit_pvalue(0, 10, 10, 1.0) == 1.0
    assert A.one_run_audit_pvalue(10, 10, 10, math.inf) == 1.0
    q = 1 / (1 + math.exp(-1.0))
    assert A.one_run_audit_pvalue(8, 10, 10, 1.0) == pytest.approx(stats.binom.sf(7, 10, q))
    assert A.one_run_audit_pvalue(8, 10, 10, 1.0, 1e-3) > A.one_run_audit_pvalue(8, 10, 10, 1.0)
    ps = [A.one_run_audit_pvalue(80, 100, 100, e) for e in np.linspace(0, 5, 20)]
    assert all(b >= a - 1e-15 for a, b in zip(ps, ps[1:]))  # δ = 0: increasing in ε
    ps_d = [A.one_run_audit_pvalue(80, 100, 100, e, 1e-5) for e in np.linspace(0.1, 5, 20)]
    np.testing.assert_allclose(ps_d, A._pvalues(80, 100, 100, np.linspace(0.1, 5, 20), 1e-5), rtol=1e-10)
    # δ > 0: every ε below the bound is rejected (the first crossing is found, not a later one)
    for v, d in [(80, 1e-5), (95, 1e-3), (700, 1e-5)]:
        r = m = 100 if v < 100 else 1000
        e = A.one_run_audit_epsilon(v, r, m, d)
        assert e > 0
        assert all(A.one_run_audit_pvalue(v, r, m, x, d) < 0.05 for x in np.linspace(0, e, 200))
    with pytest.raises(ValueError):
        A.one_run_audit_epsilon(11, 10, 10)


@pytest.mark.parametrize("eps0", [0.5, 1.0, 2.0, 4.0])
def test_audit_is_valid_exactly_on_randomized_response(eps0):
    """P[bound > ε0] ≤ 5% under ε0-DP randomized response, summed exactly over all outcomes."""
    m = 500
    q0 = 1 / (1 + math.exp(-eps0))
    bound = np.array([A.one_run_audit_epsilon(v, m, m) for v in range(m + 1)])
    p_exceed = stats.binom.pmf(np.arange(m + 1), m, q0)[bound > eps0].sum()
    assert p_exceed <= 0.05 + 1e-12


@pytest.mark.parametrize("eps0,delta", [(1.0, 0.0), (2.0, 1e-5)])
def test_audit_is_valid_on_simulated_canaries(eps0, delta):
    """Simulated ε0-DP randomized-response canaries, scored and audited end to end."""
    rng = np.random.default_rng(12345)
    m, trials, exceed = 1000, 300, 0
    q0 = 1 / (1 + math.exp(-eps0))
    for _ in range(trials):
        inc = rng.random(m) < 0.5
        answer = np.where(rng.random(m) < q0, inc, ~inc)  # ε0-DP randomized response
        scores = answer + 1e-3 * rng.random(m)  # tie-break
        res = A.one_run_audit(scores, inc, delta=delta, k_pos=m // 2, k_neg=m // 2)
        exceed += res.epsilon_lower_bound > eps0
    # the true exceedance probability is ≤ 5%; allow 2 binomial standard deviations of noise
    assert exceed / trials <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / trials)


def test_one_run_audit_from_scores():
    rng = np.random.default_rng(3)
    m = 2000
    inc = rng.random(m) < 0.5
    strong = A.one_run_audit(inc + 0.01 * rng.random(m), inc, delta=1e-5)
    weak = A.one_run_audit(inc * 0.3 + rng.normal(0, 1, m), inc, delta=1e-5)
    none = A.one_run_audit(rng.normal(0, 1, m), inc, delta=1e-5)
    assert strong.epsilon_lower_bound > 4 and strong.num_correct == strong.num_guesses
    assert 0 < weak.epsilon_lower_bound < strong.epsilon_lower_bound
    assert none.epsilon_lower_bound < 0.3
    # Bonferroni over a grid never beats the single best k at the uncorrected level
    single = A.one_run_audit(inc + 0.01 * rng.random(m), inc, delta=1e-5, k_pos=strong.k_pos, k_neg=strong.k_neg)
    assert single.epsilon_lower_bound >= strong.epsilon_lower_bound
    with pytest.raises(ValueError):
        A.one_run_audit(np.zeros(5), np.zeros(5, bool), k_pos=4, k_neg=4)


def test_bad_audit_inputs_are_refused():
    """Review, round 38: an empty k grid raised ZeroDivisionError; TPR 1.5 gave ε = inf, δ < 0 a finite ε."""
    import numpy as np

    from pdpsgd import audit as A

    s, inc = np.arange(10.0), np.arange(10) % 2 == 0
    with pytest.raises(ValueError, match="at least one value"):
        A.one_run_audit(s, inc, k_pos=[])
    with pytest.raises(ValueError, match="at least one value"):
        A.one_run_audit(s, inc, k_pos=5, k_neg=[])
    for args in ((1.5, 0.1), (0.9, 0.1, -0.5), (0.5, -0.1), (0.5, 0.1, 1.0)):
        with pytest.raises(ValueError, match="TPR and FPR in"):
            A.empirical_epsilon(*args)
    assert A.empirical_epsilon(0.5, 0.1) == pytest.approx(math.log(5))


@pytest.mark.parametrize("members_first", [True, False])  # (both, always: 12 derandomized draws of a
@given(levels=st.integers(1, 6), seed=st.integers(0, 2 ** 16))  # boolean all came up False)
def test_tied_scores_unrelated_to_membership_certify_nothing(levels, seed, members_first):
    """Review of round 40: ties were broken by the canaries' order, so scores unrelated to membership
    (0/1 correctness, rounded losses) with the members listed first certified ε ≥ 3.9 (2.5 at five
    levels, 4.6 with every score equal). Ties across a cut are abstained on; such scores certify
    nothing, in whatever order the canaries come."""
    rng = np.random.default_rng(seed)
    m = 600
    inc = np.zeros(m, bool)
    if members_first:
        inc[: m // 2] = True
    else:
        inc[rng.permutation(m)[: m // 2]] = True
    scores = rng.integers(0, levels, m).astype(float)
    res = A.one_run_audit(scores, inc, k_neg=[0, m // 4])
    assert res.epsilon_lower_bound < 0.6, res


def test_ties_inside_a_cut_still_guess_and_a_real_signal_survives_rounding():
    inc = np.zeros(1000, bool)
    inc[:500] = True
    s = inc * 1.0 + np.random.default_rng(2).normal(0, 0.5, 1000)
    exact = A.one_run_audit(s, inc).epsilon_lower_bound
    rounded = A.one_run_audit(np.round(s, 1), inc)
    assert exact > 2.0 and rounded.epsilon_lower_bound > 0.8 * exact
    assert rounded.num_guesses <= rounded.k_pos + rounded.k_neg
    r, v = A._guess_counts(np.array([3.0, 3.0, 2.0, 1.0]), np.array([True, False, True, False]), 2, 1)
    assert (r, v) == (3, 2)  # (the tied top two are both inside the cut: guessed)
    r, v = A._guess_counts(np.array([3.0, 2.0, 2.0, 1.0]), np.array([True, True, False, False]), 2, 1)
    assert (r, v) == (2, 2)  # (2.0 straddles the cut: both abstained on)


def test_audit_bounds_against_their_closed_forms_and_the_corrections():
    """Mutation review, round 40: the δ terms of the TPR / advantage bounds, the vectorised p-value's
    2·m·δ term and the Bonferroni correction over a k grid could each be changed unnoticed."""
    e, d = 1.0, 0.1
    for f in (0.0, 0.2, 0.5, 0.9):
        assert A.dp_tpr_bound(f, e, d) == pytest.approx(min(1.0, math.exp(e) * f + d, 1 - math.exp(-e) * (1 - d - f)))
    assert A.dp_advantage_bound(e, d) == pytest.approx((math.e - 1 + 2 * d) / (math.e + 1))
    grid = np.linspace(0, 1, 20001)
    assert A.dp_advantage_bound(e, d) == pytest.approx(float(np.max(A.dp_tpr_bound(grid, e, d) - grid)), abs=1e-4)
    eps = np.array([0.1, 0.5, 1.0, 2.0])
    for v, r, m, dl in ((30, 40, 200, 1e-3), (12, 20, 20, 1e-4)):
        want = [A.one_run_audit_pvalue(v, r, m, float(x), dl) for x in eps]
        assert np.allclose(A._pvalues(v, r, m, eps, dl), want, rtol=1e-12, atol=0)
    inc = np.zeros(400, bool)
    inc[:200] = True
    s = inc * 1.0 + np.random.default_rng(3).normal(0, 0.7, 400)
    ks = [200, 100, 50, 25]
    res = A.one_run_audit(s, inc, k_pos=ks)
    per = []
    for k in ks:
        r, v = A._guess_counts(s, inc, k, 0)
        per.append((A.one_run_audit_epsilon(v, r, 400, 0.0, 1 - 0.05 / len(ks)),
                    A.one_run_audit_epsilon(v, r, 400, 0.0, 0.95)))
    assert res.epsilon_lower_bound == pytest.approx(max(p[0] for p in per))
    assert res.epsilon_lower_bound < max(p[1] for p in per)


def test_empirical_epsilon_inverts_the_tpr_bound_with_delta_on_the_high_fpr_side():
    """(Mutation review, round 44.) On the high-FPR side the (ε, δ) region is 1 − FPR ≤ e^ε (1 − TPR) + δ: the point estimate
    log((1 − δ − FPR)/(1 − TPR)) must give back ε for a point on that edge of dp_tpr_bound."""
    from pdpsgd import audit as A

    for eps, delta, fpr in ((1.0, 0.05, 0.6), (0.5, 0.1, 0.8), (2.0, 0.01, 0.3)):
        tpr = 1.0 - math.exp(-eps) * (1.0 - delta - fpr)  # the edge (below e^ε·FPR + δ here)
        assert tpr < math.exp(eps) * fpr + delta
        assert A.dp_tpr_bound(fpr, eps, delta) == pytest.approx(tpr, rel=1e-12)
        assert A.empirical_epsilon(tpr, fpr, delta) == pytest.approx(eps, rel=1e-9)
    assert A.empirical_epsilon(0.99, 0.5, 0.1) == pytest.approx(math.log(0.4 / 0.01))
