"""Empirical privacy: membership-inference attacks and a one-run privacy audit (numpy/scipy).

Attacks (scores: *higher = more likely a member*):

* :func:`mia_metrics` — ROC AUC, advantage max(TPR − FPR), TPR at fixed low FPRs of any score.
* :func:`loss_threshold_attack` — Yeom et al. (2018): score = −loss.
* :func:`lira_scores` — Carlini et al. (2022) likelihood-ratio attack from shadow models
  (online: Gaussian "in" vs "out" fit; offline: one-sided test against "out" only), on the
  logit-scaled confidence :func:`logit_confidence`.

What (ε, δ)-DP implies for any attack (Kairouz et al. 2015 hypothesis-testing region):

* :func:`dp_tpr_bound` — TPR ≤ min(1, e^ε·FPR + δ, 1 − e^−ε·(1 − δ − FPR)).
* :func:`dp_advantage_bound`, :func:`dp_auc_bound`.

One-run audit (Steinke, Nasr, Jagielski 2023, "Privacy Auditing with One (1) Training Run"):

* :func:`one_run_audit_pvalue` — under (ε, δ)-DP, the probability of ≥ v correct guesses out of
  r among m canaries each included independently with probability ½ (their Theorem with the
  δ term).
* :func:`one_run_audit_epsilon` — the largest ε rejected at the given confidence: a valid lower
  bound on the ε of any (ε, δ)-DP guarantee the training run could have.
* :func:`one_run_audit` — from canary scores: guess "in" for the k₊ highest, "out" for the k₋
  lowest, abstain on the rest; optionally the best of several (k₊, k₋) with a Bonferroni
  correction, so the reported bound stays valid.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, NamedTuple, Optional, Sequence, Tuple

import numpy as np
from scipy import stats

__all__ = [
    "MIAResult",
    "AuditResult",
    "roc_curve",
    "mia_metrics",
    "loss_threshold_attack",
    "logit_confidence",
    "lira_scores",
    "dp_tpr_bound",
    "dp_advantage_bound",
    "dp_auc_bound",
    "empirical_epsilon",
    "one_run_audit_pvalue",
    "one_run_audit_epsilon",
    "one_run_audit",
]

DEFAULT_FPRS: Tuple[float, ...] = (0.01, 0.001)


def _as_1d(x, name: str) -> np.ndarray:
    try:  # torch tensors and lists alike
        x = x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)
    except Exception as e:  # pragma: no cover - defensive
        raise TypeError(f"{name} must be array-like, got {type(x).__name__}") from e
    x = np.asarray(x)
    if x.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {x.shape}")
    return x


# ------------------------------------------------------------------------------------------
# Membership-inference metrics
# ------------------------------------------------------------------------------------------
class MIAResult(NamedTuple):
    """Summary of one membership-inference attack (scores: higher = member)."""

    auc: float
    advantage: float  # max over thresholds of TPR − FPR
    tpr_at_fpr: Dict[float, float]  # FPR level -> largest TPR with FPR ≤ level
    num_members: int
    num_nonmembers: int

    def as_dict(self) -> dict:
        return {
            "auc": self.auc,
            "advantage": self.advantage,
            "tpr_at_fpr": {str(k): v for k, v in self.tpr_at_fpr.items()},
            "num_members": self.num_members,
            "num_nonmembers": self.num_nonmembers,
        }


def _check_scores(scores, is_member) -> Tuple[np.ndarray, np.ndarray]:
    s = _as_1d(scores, "scores").astype(np.float64)
    y = _as_1d(is_member, "is_member").astype(bool)
    if s.shape != y.shape:
        raise ValueError(f"scores {s.shape} and is_member {y.shape} must have the same length")
    if not np.all(np.isfinite(s)):
        raise ValueError("scores must be finite (map ±inf/NaN to finite values first)")
    if y.all() or not y.any():
        raise ValueError("need at least one member and one non-member")
    return s, y


def roc_curve(scores, is_member) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fpr, tpr, thresholds) for the rule "member iff score ≥ threshold", ties kept together.

    Starts at (0, 0) (threshold +inf) and ends at (1, 1).
    """
    s, y = _check_scores(scores, is_member)
    order = np.argsort(-s, kind="mergesort")
    s, y = s[order], y[order]
    last = np.r_[np.nonzero(np.diff(s))[0], s.size - 1]  # last index of each tie group
    tp = np.cumsum(y)[last]
    fp = np.cumsum(~y)[last]
    tpr = np.r_[0.0, tp / y.sum()]
    fpr = np.r_[0.0, fp / (~y).sum()]
    return fpr, tpr, np.r_[np.inf, s[last]]


def mia_metrics(scores, is_member, fprs: Sequence[float] = DEFAULT_FPRS) -> MIAResult:
    """AUC, advantage and TPR at low FPR of a membership score (higher = member).

    AUC is the Mann–Whitney statistic P[s_member > s_nonmember] + ½P[tie]; TPR at FPR α is the
    largest TPR of a threshold rule with FPR ≤ α (Carlini et al.'s convention, no interpolation;
    it needs ≳ 1/α non-members to mean anything: with n non-members FPR moves in steps of 1/n).
    """
    s, y = _check_scores(scores, is_member)
    n1, n0 = int(y.sum()), int((~y).sum())
    ranks = stats.rankdata(s)  # average ranks for ties
    auc = float((ranks[y].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))
    fpr, tpr, _ = roc_curve(s, y)
    adv = float(np.max(tpr - fpr))
    at = {}
    for a in fprs:
        if not 0 <= a <= 1:
            raise ValueError(f"FPR levels must be in [0, 1], got {a}")
        ok = fpr <= a + 1e-12
        at[float(a)] = float(tpr[ok].max())
    return MIAResult(auc, adv, at, n1, n0)


def loss_threshold_attack(member_losses, nonmember_losses, fprs: Sequence[float] = DEFAULT_FPRS) -> MIAResult:
    """Yeom et al. (2018): predict "member" when the loss is below a threshold (score = −loss)."""
    m = _as_1d(member_losses, "member_losses").astype(np.float64)
    n = _as_1d(nonmember_losses, "nonmember_losses").astype(np.float64)
    scores = -np.concatenate([m, n])
    labels = np.r_[np.ones(m.size, bool), np.zeros(n.size, bool)]
    return mia_metrics(scores, labels, fprs)


def logit_confidence(losses) -> np.ndarray:
    """Logit-scaled confidence φ = log(p / (1 − p)) with p = exp(−loss) (cross-entropy losses).

    Carlini et al. (2022) fit Gaussians to φ, which is close to normal across training runs.
    Computed stably as −loss − log(−expm1(−loss)); losses are clamped to ≥ 1e-30.
    """
    l = np.maximum(_as_1d(losses, "losses").astype(np.float64), 1e-30)
    return -l - np.log(-np.expm1(-l))


def lira_scores(
    target_stats,
    shadow_stats,
    shadow_in,
    *,
    online: bool = True,
    fix_variance: bool = True,
    min_std: float = 1e-6,
) -> np.ndarray:
    """LiRA membership scores (Carlini et al. 2022), higher = member.

    Args:
        target_stats: (n,) the statistic (e.g. :func:`logit_confidence` of the loss) of each
            candidate example under the target model.
        shadow_stats: (K, n) the same statistic under K shadow models.
        shadow_in: (K, n) bool, whether shadow k was trained on example i.
        online: True: log N(x; μ_in, σ_in²) − log N(x; μ_out, σ_out²); False (offline, "out"
            models only): log Φ((x − μ_out)/σ_out), a one-sided test that x is larger than an
            "out" model gives.
        fix_variance: use one global σ_in (σ_out) for all examples (the paper's choice with few
            shadow models); else per-example standard deviations (floored at ``min_std``).
    Examples with no "in" (or no "out") shadow model use the global mean of that side.
    """
    x = _as_1d(target_stats, "target_stats").astype(np.float64)
    S = np.asarray(shadow_stats, dtype=np.float64)
    IN = np.asarray(shadow_in, dtype=bool)
    if S.ndim != 2 or S.shape[1] != x.size or IN.shape != S.shape:
        raise ValueError(f"shadow_stats and shadow_in must be (K, {x.size}); got {S.shape} and {IN.shape}")
    if not np.all(np.isfinite(S)) or not np.all(np.isfinite(x)):
        raise ValueError("statistics must be finite")

    def side(mask: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        cnt = mask.sum(0)
        tot = max(int(cnt.sum()), 1)
        gmean = (S * mask).sum() / tot
        mean = np.where(cnt > 0, (S * mask).sum(0) / np.maximum(cnt, 1), gmean)
        resid = np.where(mask, S - mean[None, :], 0.0)
        if fix_variance:
            dof = max(int(cnt.sum()) - int((cnt > 0).sum()), 1)
            std = np.full_like(mean, math.sqrt((resid ** 2).sum() / dof))
        else:
            var = (resid ** 2).sum(0) / np.maximum(cnt - 1, 1)
            gvar = (resid ** 2).sum() / max(int(cnt.sum()) - int((cnt > 0).sum()), 1)
            std = np.sqrt(np.where(cnt > 1, var, gvar))
        return mean, np.maximum(std, min_std)

    mu_out, sd_out = side(~IN)
    if not online:
        if not (~IN).any():
            raise ValueError("offline LiRA needs 'out' shadow models")
        return stats.norm.logcdf((x - mu_out) / sd_out)
    if not IN.any() or not (~IN).any():
        raise ValueError("online LiRA needs both 'in' and 'out' shadow models")
    mu_in, sd_in = side(IN)
    return stats.norm.logpdf(x, mu_in, sd_in) - stats.norm.logpdf(x, mu_out, sd_out)


# ------------------------------------------------------------------------------------------
# What (ε, δ)-DP implies
# ------------------------------------------------------------------------------------------
def _check_eps_delta(epsilon: float, delta: float) -> Tuple[float, float]:
    epsilon, delta = float(epsilon), float(delta)
    if not epsilon >= 0 or math.isnan(epsilon):
        raise ValueError(f"epsilon must be ≥ 0 (inf allowed), got {epsilon}")
    if not 0 <= delta <= 1:
        raise ValueError(f"delta must be in [0, 1], got {delta}")
    return epsilon, delta


def dp_tpr_bound(fpr, epsilon: float, delta: float):
    """Largest TPR any membership test can have at this FPR against an (ε, δ)-DP mechanism.

    TPR ≤ min(1, e^ε·FPR + δ, 1 − e^−ε·(1 − δ − FPR)) (Kairouz, Oh, Viswanath 2015); the first
    term is the familiar TPR ≤ e^ε·FPR + δ. Vectorised over ``fpr``.
    """
    epsilon, delta = _check_eps_delta(epsilon, delta)
    f = np.asarray(fpr, dtype=np.float64)
    if np.any((f < 0) | (f > 1)):
        raise ValueError("fpr must be in [0, 1]")
    if math.isinf(epsilon):
        out = np.ones_like(f)
    else:
        out = np.minimum.reduce([
            np.ones_like(f),
            math.exp(epsilon) * f + delta,
            1.0 - math.exp(-epsilon) * (1.0 - delta - f),
        ])
    out = np.clip(out, 0.0, 1.0)
    return float(out) if out.ndim == 0 else out


def dp_advantage_bound(epsilon: float, delta: float) -> float:
    """max(TPR − FPR) under (ε, δ)-DP: (e^ε − 1 + 2δ) / (e^ε + 1)."""
    epsilon, delta = _check_eps_delta(epsilon, delta)
    if math.isinf(epsilon):
        return 1.0
    return min(1.0, (math.expm1(epsilon) + 2 * delta) / (math.exp(epsilon) + 1))


def dp_auc_bound(epsilon: float, delta: float, grid: int = 100_001) -> float:
    """Largest ROC AUC under (ε, δ)-DP: the area under :func:`dp_tpr_bound` (numerically)."""
    f = np.linspace(0.0, 1.0, grid)
    return float(np.trapezoid(dp_tpr_bound(f, epsilon, delta), f)) if hasattr(np, "trapezoid") else float(
        np.trapz(dp_tpr_bound(f, epsilon, delta), f))


def empirical_epsilon(tpr: float, fpr: float, delta: float = 0.0) -> float:
    """Point estimate of the ε an observed (FPR, TPR) pair implies (inverting :func:`dp_tpr_bound`).

    max(log((TPR − δ)/FPR), log((1 − δ − FPR)/(1 − TPR))), floored at 0. A *point estimate*
    without confidence: for a statistically valid lower bound use :func:`one_run_audit_epsilon`.
    """
    tpr, fpr, delta = float(tpr), float(fpr), float(delta)
    if not (0.0 <= tpr <= 1.0 and 0.0 <= fpr <= 1.0 and 0.0 <= delta < 1.0):  # (review, round 38: TPR 1.5 gave inf)
        raise ValueError(f"need TPR and FPR in [0, 1] and δ in [0, 1), got tpr={tpr}, fpr={fpr}, delta={delta}")
    cands = [0.0]
    if tpr - delta > 0:
        cands.append(math.inf if fpr == 0 else math.log((tpr - delta) / fpr))
    if 1 - delta - fpr > 0:
        cands.append(math.inf if tpr >= 1 else math.log((1 - delta - fpr) / (1 - tpr)))
    return max(cands)


# ------------------------------------------------------------------------------------------
# One-run audit (Steinke, Nasr, Jagielski 2023)
# ------------------------------------------------------------------------------------------
def _check_counts(num_correct: int, num_guesses: int, num_canaries: int) -> Tuple[int, int, int]:
    v, r, m = int(num_correct), int(num_guesses), int(num_canaries)
    if not (v == num_correct and r == num_guesses and m == num_canaries):
        raise ValueError("counts must be integers")
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 ≤ num_correct ≤ num_guesses ≤ num_canaries, got {v}, {r}, {m}")
    return v, r, m


def one_run_audit_pvalue(num_correct: int, num_guesses: int, num_canaries: int, epsilon: float, delta: float = 0.0) -> float:
    """P[≥ v correct guesses] under the null hypothesis "the run is (ε, δ)-DP".

    m canaries are each included independently with probability ½; the auditor makes r guesses
    (abstaining on the other m − r) and v of them are right. Under ε-DP the number correct is
    stochastically dominated by Binomial(r, e^ε/(1 + e^ε)) (randomized response), so

        p = P[Bin(r, q) ≥ v] + 2·m·δ·max_{1≤i≤v} P[v − i ≤ Bin(r, q) < v] / i,   q = e^ε/(1+e^ε)

    (Steinke, Nasr, Jagielski 2023, the bound with δ > 0), capped at 1.
    """
    v, r, m = _check_counts(num_correct, num_guesses, num_canaries)
    epsilon, delta = _check_eps_delta(epsilon, delta)
    if v == 0:
        return 1.0
    if math.isinf(epsilon):
        return 1.0  # (∞, δ)-DP constrains nothing
    q = 1.0 / (1.0 + math.exp(-epsilon))
    beta = float(stats.binom.sf(v - 1, r, q))
    alpha = 0.0
    if delta > 0:
        j = np.arange(v - 1, -1, -1)  # v-1, v-2, ..., 0
        partial = np.cumsum(stats.binom.pmf(j, r, q))  # i-th entry: P[v-i ≤ Bin < v]
        alpha = float(np.max(partial / np.arange(1, v + 1)))
    return min(1.0, beta + 2.0 * m * delta * alpha)


def _pvalues(v: int, r: int, m: int, eps: np.ndarray, delta: float) -> np.ndarray:
    """:func:`one_run_audit_pvalue` for an array of ε (v ≥ 1)."""
    q = 1.0 / (1.0 + np.exp(-eps))[:, None]
    beta = stats.binom.sf(v - 1, r, q[:, 0])
    j = np.arange(v - 1, -1, -1)[None, :]
    partial = np.cumsum(stats.binom.pmf(j, r, q), axis=1)
    alpha = np.max(partial / np.arange(1, v + 1)[None, :], axis=1)
    return np.minimum(1.0, beta + 2.0 * m * delta * alpha)


def one_run_audit_epsilon(
    num_correct: int,
    num_guesses: int,
    num_canaries: int,
    delta: float = 0.0,
    confidence: float = 0.95,
    *,
    tol: float = 1e-6,
    eps_max: float = 100.0,
    grid_step: float = 0.01,
) -> float:
    """ε lower bound at ``confidence`` from a one-run audit (Steinke, Nasr, Jagielski 2023).

    The smallest ε at which :func:`one_run_audit_pvalue` (v, r, m, ε, δ) reaches
    β = 1 − confidence, i.e. every ε' below the returned value is rejected: with probability
    ≥ ``confidence`` over the canaries' coin flips, the run is *not* (ε', δ)-DP for any such ε'.
    0 when nothing can be rejected. With δ = 0 the p-value increases with ε (bisection to
    ``tol``); with δ > 0 its δ term need not be monotone in ε, so the first crossing is located
    by a scan on a grid of ``grid_step`` followed by bisection inside the crossing cell.

    The δ term adds up to 2·m·δ to the p-value, so a bound above 0 needs m·δ ≪ 1 − confidence:
    with m = 1000 canaries and δ = 1e-3 nothing can be certified, whatever the mechanism.
    """
    v, r, m = _check_counts(num_correct, num_guesses, num_canaries)
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    _check_eps_delta(0.0, delta)
    beta = 1.0 - confidence
    p = lambda e: one_run_audit_pvalue(v, r, m, e, delta)  # noqa: E731
    if p(0.0) >= beta:
        return 0.0
    lo = 0.0
    if delta == 0:
        hi = 1.0
        while p(hi) < beta:
            lo, hi = hi, 2 * hi
            if hi > eps_max:
                return eps_max
    else:
        start = 0.0
        while True:  # vectorised scan, 256 grid points at a time
            grid = start + grid_step * np.arange(1, 257)
            bad = np.nonzero(_pvalues(v, r, m, grid, delta) >= beta)[0]
            if bad.size:
                hi = float(grid[bad[0]])
                lo = float(grid[bad[0] - 1]) if bad[0] > 0 else start
                break
            start = float(grid[-1])
            if start > eps_max:
                return eps_max
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if p(mid) < beta:
            lo = mid
        else:
            hi = mid
    return lo


class AuditResult(NamedTuple):
    epsilon_lower_bound: float
    num_canaries: int
    num_guesses: int
    num_correct: int
    k_pos: int
    k_neg: int
    confidence: float  # the overall confidence (after any Bonferroni split)
    delta: float

    def as_dict(self) -> dict:
        return self._asdict()


def _guess_counts(scores: np.ndarray, inc: np.ndarray, k_pos: int, k_neg: int) -> Tuple[int, int]:
    """(guesses, correct ones): "included" for the ``k_pos`` highest scores, "excluded" for the ``k_neg``
    lowest. Scores tied across a cut are abstained on, the whole tied group (review of round 40: a sort
    broke ties by the canaries' order, so an auditor who listed members first guessed them right from
    scores unrelated to membership, 250/250 on 0/1 scores: ε ≥ 3.9 for a run that leaks nothing); the
    guesses stay a function of the scores alone, as the bound needs."""
    m = scores.size
    order = np.argsort(-scores, kind="mergesort")
    srt = scores[order]
    if 0 < k_pos < m and srt[k_pos - 1] == srt[k_pos]:
        pos = np.flatnonzero(scores > srt[k_pos - 1])
    else:
        pos = order[:k_pos]
    cut = m - k_neg
    if k_neg == 0:
        neg = order[:0]
    elif 0 < cut and srt[cut] == srt[cut - 1]:
        neg = np.flatnonzero(scores < srt[cut])
    else:
        neg = order[cut:]
    return int(pos.size + neg.size), int(inc[pos].sum() + (~inc[neg]).sum())


def one_run_audit(
    scores,
    included,
    *,
    delta: float = 0.0,
    k_pos: Optional[int | Iterable[int]] = None,
    k_neg: int | Iterable[int] = 0,
    confidence: float = 0.95,
) -> AuditResult:
    """One-run audit from canary scores (higher = more likely included).

    Guess "included" for the ``k_pos`` highest-scoring canaries and "excluded" for the ``k_neg``
    lowest (abstain on the rest, and on every canary whose score is tied with one across either cut, so
    ``num_guesses`` may be below ``k_pos + k_neg``), count correct guesses, convert with
    :func:`one_run_audit_epsilon`. ``k_pos``/``k_neg`` may be lists: every combination is tried
    and the best bound is returned at a Bonferroni-corrected per-test confidence
    1 − (1 − confidence)/#combinations, so the reported bound holds at ``confidence`` overall.
    Default ``k_pos``: a geometric grid of m/2, m/4, ... down to ≥ 10 (capped at 8 values).

    The choice of k must not depend on the scores beyond this (fix the grid in advance).
    """
    s = _as_1d(scores, "scores").astype(np.float64)
    inc = _as_1d(included, "included").astype(bool)
    if s.shape != inc.shape:
        raise ValueError("scores and included must have the same length")
    if not np.all(np.isfinite(s)):
        raise ValueError("scores must be finite")
    m = s.size
    if m == 0:
        raise ValueError("need at least one canary")
    if k_pos is None:
        ks, k = [], max(1, m // 2)
        while k >= 10 and len(ks) < 8:
            ks.append(k)
            k //= 2
        k_pos = ks or [max(1, m // 2)]
    kp = [int(k) for k in (k_pos if isinstance(k_pos, Iterable) else [k_pos])]
    kn = [int(k) for k in (k_neg if isinstance(k_neg, Iterable) else [k_neg])]
    combos = [(a, b) for a in kp for b in kn]
    if not combos:  # (review, round 38: ZeroDivisionError)
        raise ValueError(f"k_pos and k_neg need at least one value each, got k_pos={kp}, k_neg={kn}")
    for a, b in combos:
        if a < 0 or b < 0 or a + b > m or a + b == 0:
            raise ValueError(f"need k_pos, k_neg ≥ 0 with 0 < k_pos + k_neg ≤ m={m}, got ({a}, {b})")
    per_test = 1.0 - (1.0 - confidence) / len(combos)
    best = None
    for a, b in combos:
        r, v = _guess_counts(s, inc, a, b)
        eps = one_run_audit_epsilon(v, r, m, delta, per_test)
        if best is None or eps > best.epsilon_lower_bound:
            best = AuditResult(eps, m, r, v, a, b, confidence, float(delta))
    assert best is not None
    return best
