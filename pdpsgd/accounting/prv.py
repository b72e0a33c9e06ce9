"""PRV accountant (Gopi, Lee & Wutschitz 2021) for DP-SGD with Poisson sampling.

Numerical composition of privacy random variables (PRVs), built on the
``prv-accountant`` package's method and error analysis, with three changes that
make it fast and robust:

1. **One grid, many compositions.** Each distinct (σ, q) of the history is
   discretised once on a shared grid and kept in Fourier space; the composed PRV of
   a history ``{(σ_k, q_k): n_k}`` is ``irfft(Π_k F_k ** n_k)`` — one inverse FFT,
   exact heterogeneous composition (no "worst σ"). The grid is a deterministic
   function of the history, with the step count rounded up on a √2 ladder and the
   domain on a 1.1 ladder, so a training loop asking for ε after every step
   re-discretises only O(log T) times; composed results are cached on the history,
   and results never depend on the order of queries.
2. **Accurate truncated mean.** ``prv-accountant`` 0.2.0 computes the mean of the
   truncated PRV with ``scipy.integrate.quad`` over the whole domain, which is
   wrong by orders of the mesh size when the domain is wide (high ε; e.g. q=0.2,
   σ=0.7, 500 steps: quad gives 0.1031, the true mean is 0.06593) and then raises
   "Discrete mean differs from continuous mean significantly". Here the mean is
   integrated in the Gaussian (x) space with composite Gauss-Legendre quadrature,
   where the integrand is smooth and localised, so the mean-shift check of the
   method passes legitimately.
3. **Tail-accurate CDF.** Cell masses are differences of the CDF in the lower half
   and of the survival function in the upper half (no cancellation near 1).

The error bounds are those of ``prv-accountant`` (Gopi et al. 2021, Thm. 5.5 with
the domain size of Remark 5.6): ``eps_error`` (default 0.01) and ``delta_error``
(default δ/1000, at least min(1e-12, δ/10): below ~1e-12 float64 round-off
matters).

Failures are detected — any exception, a non-finite or unnormalised composed PMF,
a mean-shift beyond half a mesh cell, a composed mean that is not the sum of the
per-step means (aliasing on the periodic grid), a grid larger than
``max_grid_size``, float64 round-off above δ/10 (:data:`MAX_ROUNDOFF`; the n-th
power of the FFT adds ~n ulps, :data:`POWER_ROUNDOFF`, which had under-stated ε at
q = 1, σ = 1000, 10⁵ steps, δ = 1e-11), or a PRV lower bound above
the (always valid) RDP upper bound — and the accountant then
falls back to the PLD accountant of ``dp-accounting`` (pessimistic
connect-the-dots for ``upper``/``estimate``, optimistic privacy buckets for
``lower``, each with its round-off folded into δ, :func:`pld_roundoff`), checked
against RDP: the smaller upper bound is returned, and below δ = 1e-12
(:data:`PLD_MIN_DELTA`) or where the PLD's round-off exceeds δ/10 only RDP's; the
result says so in its ``method`` field.
"""
from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np
from scipy import fft as sfft
from scipy import special

from .._warn import warn
from ._common import (
    DeltaBounds,
    EpsilonBounds,
    HistoryAccountant,
    check_delta,
    check_epsilon,
    optional_delta_error,
)
from .rdp import DEFAULT_RDP_ORDERS, delta_from_rdp, epsilon_from_rdp, rdp_poisson_subsampled_gaussian

__all__ = ["PRVAccountant", "PRVFailure"]

Groups = Tuple[Tuple[float, float, int], ...]

#: δ_error used first by :meth:`PRVAccountant.delta` when ``delta_error`` is not set (then the
#: rule of :meth:`PRVAccountant.epsilon` applied to the answer, when finer).
DEFAULT_DELTA_ERROR_FOR_DELTA = 1e-10
_RDP_ORDERS = np.asarray(DEFAULT_RDP_ORDERS, dtype=np.float64)


class PRVFailure(RuntimeError):
    """The PRV computation is not trustworthy for this input (triggers the fallback)."""


# ----------------------------------------------------------------------------------
# The PRV of one step of the Poisson-subsampled Gaussian (remove direction, which
# dominates add for ε >= 0): Y = log(1 - q + q exp((2x - 1) / (2σ²))),
# x ~ (1 - q) N(0, σ²) + q N(1, σ²).  Same law as prv_accountant's
# PoissonSubsampledGaussianMechanism.
# ----------------------------------------------------------------------------------
def _z_of_t(t: np.ndarray, q: float) -> np.ndarray:
    """z = log((e^t - (1 - q)) / q), i.e. the value of (2x - 1)/(2σ²) where Y = t."""
    t = np.asarray(t, dtype=np.float64)
    if q == 1.0:
        return t.copy()
    out = np.full(t.shape, -np.inf)
    log_q = math.log(q)
    pos = t > 0
    tp = t[pos]
    out[pos] = tp + np.log1p(-(1.0 - q) * np.exp(-tp)) - log_q
    neg = (~pos) & (t > math.log1p(-q))
    with np.errstate(divide="ignore"):
        out[neg] = np.log(np.expm1(t[neg]) + q) - log_q
    return out


def _cdf_sf(t: np.ndarray, sigma: float, q: float, want: str = "both") -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """CDF and/or survival function of the one-step PRV at ``t`` (each accurate in its tail)."""
    z = _z_of_t(t, q)
    u = sigma * z
    c = 0.5 / sigma
    F = S = None
    with np.errstate(invalid="ignore"):
        if want in ("both", "F"):
            F = q * special.ndtr(u - c)
            if q < 1.0:
                F += (1.0 - q) * special.ndtr(u + c)
        if want in ("both", "S"):
            S = q * special.ndtr(c - u)
            if q < 1.0:
                S += (1.0 - q) * special.ndtr(-u - c)
    return F, S


_GL_X, _GL_W = np.polynomial.legendre.leggauss(16)


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """Inner product without BLAS (a threaded BLAS dot can stall for ~10 ms on busy CPUs)."""
    return float(np.einsum("i,i->", a, b))


def _truncated_mean(sigma: float, q: float, t_lo: float, t_hi: float) -> float:
    """E[Y | t_lo <= Y <= t_hi] by Gauss-Legendre quadrature in x space."""
    s2 = sigma * sigma
    x_lo = -40.0 * sigma
    x_hi = 1.0 + 40.0 * sigma
    z = _z_of_t(np.array([t_lo, t_hi]), q)
    if np.isfinite(z[0]):
        x_lo = max(x_lo, s2 * z[0] + 0.5)
    x_hi = min(x_hi, s2 * z[1] + 0.5)
    if not x_hi > x_lo:
        raise PRVFailure("empty truncation window for the PRV mean")
    width = min(sigma / 4.0, s2)
    panels = max(1, int(math.ceil((x_hi - x_lo) / width)))
    edges = np.linspace(x_lo, x_hi, panels + 1)
    mid = 0.5 * (edges[1:] + edges[:-1])[:, None]
    half = 0.5 * (edges[1:] - edges[:-1])[:, None]
    x = (mid + half * _GL_X[None, :]).ravel()
    w = (half * _GL_W[None, :]).ravel()
    a = (2.0 * x - 1.0) / (2.0 * s2)
    if q == 1.0:
        y = a
        dens = np.exp(-0.5 * ((x - 1.0) / sigma) ** 2)
    else:
        y = np.logaddexp(math.log1p(-q), math.log(q) + a)
        dens = (1.0 - q) * np.exp(-0.5 * (x / sigma) ** 2) + q * np.exp(-0.5 * ((x - 1.0) / sigma) ** 2)
    mass = float(_dot(w, dens))
    if not mass > 0:
        raise PRVFailure("zero mass in the PRV truncation window")
    return float(_dot(w, y * dens)) / mass


# ----------------------------------------------------------------------------------
# Grid
# ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Grid:
    h: float            # mesh size
    n: int              # number of points (even)
    K: int              # t_min = -K h, t_max = (K + 1) h, n = 2K + 2
    capacity: int       # max total number of steps the mesh is valid for
    L: float            # half-width the grid was required to cover
    eps_error: float
    delta_error: float

    @property
    def t_min(self) -> float:
        return -self.K * self.h

    @property
    def t_max(self) -> float:
        return (self.K + 1) * self.h


def _mesh_size(capacity: int, eps_error: float, delta_error: float) -> float:
    # Gopi et al. 2021, Thm. 5.5 (as in prv_accountant.PRVAccountant)
    return eps_error / math.sqrt(capacity / 2.0 * math.log(12.0 / delta_error))


def _default_delta_error(delta: float) -> float:
    return max(delta / 1000.0, min(1e-12, delta / 10.0))


def _capacity(total: int) -> int:
    """Smallest value of the ladder round(2^(k/2)) that is >= total."""
    if total <= 2:
        return max(1, total)
    k = math.ceil(2.0 * math.log2(total) - 1e-9)
    return max(total, int(math.ceil(2.0 ** (k / 2.0) - 1e-9)))


def _ladder(L: float) -> float:
    """Round L up to the ladder 1.1^k (k integer)."""
    return 1.1 ** math.ceil(math.log(L) / math.log(1.1) - 1e-12)


def _even_fast_len(n: int) -> int:
    m = max(n, 2)
    while True:
        m = sfft.next_fast_len(m, real=True)
        if m % 2 == 0:
            return m
        m += 1


def _rev_cumsum(x: np.ndarray, block: int = 1024) -> np.ndarray:
    """Σ_{j>=i} x_j for all i, accumulated from the top in blocks.

    Entry i only involves terms j >= i, and the blocked order bounds the round-off
    by ~(block + len/block) ulps of the entry itself (plain cumsum: ~len ulps).
    """
    m = len(x)
    pad = (-m) % block
    y = np.concatenate([x[::-1], np.zeros(pad, dtype=x.dtype)]).reshape(-1, block)
    c = np.cumsum(y, axis=1)
    offsets = np.cumsum(c[:, -1])
    c[1:] += offsets[:-1, None]
    return c.reshape(-1)[:m][::-1]


@dataclass
class _Composed:
    """Upper part (t >= -eps_error - 2h) of a composed discrete PRV (float64).

    With d1_i = Σ_{j>=i} p_j and E_i = Σ_{j>=i} p_j e^{t_i - t_j} (both computed
    from the top, so with *relative* round-off), the hockey-stick divergence at a
    grid point is δ(t_i) = d1_i - E_i, and on [t_{i-1}, t_i) it is
    δ(ε) = d1_i - e^{ε - t_i} E_i — the formulas of
    prv_accountant.DiscretePrivacyRandomVariable, without its long-double arrays.
    """

    t: np.ndarray       # grid points
    d1: np.ndarray
    E: np.ndarray
    ndelta: np.ndarray  # E - d1 = -δ(t_i), increasing
    n: int              # full grid size
    roundoff: float     # estimated absolute round-off of δ (FFT noise, summation, the n-th power)

    def epsilon(self, delta: float) -> float:
        i = int(np.searchsorted(self.ndelta, -delta, side="left"))
        if i == 0:
            return 0.0  # δ(t_0) <= delta with t_0 < 0: ε = 0
        if i >= len(self.t):
            raise PRVFailure("δ not reached inside the grid (tail beyond the domain)")
        d1, E = float(self.d1[i]), float(self.E[i])
        if not (d1 - delta > 0 and E > 0):
            raise PRVFailure("degenerate cell in ε inversion")
        return max(0.0, float(self.t[i]) + math.log((d1 - delta) / E))

    def delta(self, epsilon: float) -> float:
        if epsilon < float(self.t[0]):
            raise PRVFailure("ε below the computed part of the grid")
        i = int(np.searchsorted(self.t, epsilon, side="left"))
        if i >= len(self.t):
            return 0.0
        return max(0.0, float(self.d1[i]) - math.exp(epsilon - float(self.t[i])) * float(self.E[i]))


class _GridState:
    """A grid and the Fourier transforms of the PRVs discretised on it (LRU, byte-bounded)."""

    def __init__(self, grid: _Grid, max_bytes: int = 64 * 2 ** 20) -> None:
        self.grid = grid
        self.ffts: "OrderedDict[Tuple[float, float], Tuple[np.ndarray, float, float]]" = OrderedDict()
        self.powers: "OrderedDict[Tuple[float, float, int], Tuple[np.ndarray, float, float]]" = OrderedDict()
        self.max_bytes = max_bytes
        # (groups[:-1] of the last history composed on this grid, the product of their transforms'
        # powers in order, Σ n·shift, Σ n·mean): a history that grows by steps of its last (σ, q), or
        # by a new (σ, q), costs one or two multiplications, and memory stays one transform, however
        # many distinct (σ, q) it holds (review, round 38: every distinct pair's transform was kept:
        # 2.6 GB for 200 of them, a MemoryError at 1000)
        self.prefix: Optional[Tuple[Tuple[Tuple[float, float, int], ...], Optional[np.ndarray], float, float]] = None

    def compose(self, groups: Sequence[Tuple[float, float, int]]) -> Tuple[np.ndarray, float, float]:
        """(Π_k F_k^{n_k}, Σ n_k·shift_k, Σ n_k·mean_k) over ``groups`` in order: the product of
        groups[:-1] from the cached prefix (extended by one group when the history added one), the
        same operations in the same order as a product from scratch, so a result never depends on
        which histories were composed before."""
        head = tuple(groups[:-1])
        pre = self.prefix
        if pre is None or pre[0] != head:
            if pre is not None and len(pre[0]) == len(head) - 1 and head[:-1] == pre[0]:
                start, F, shift, mean = len(pre[0]), pre[1], pre[2], pre[3]
            else:
                start, F, shift, mean = 0, None, 0.0, 0.0
            for s, q, n in head[start:]:
                Fn, sk, mk = self.power(s, q, n)
                F = Fn if F is None else F * Fn
                shift += n * sk
                mean += n * mk
            self.prefix = pre = (head, F, shift, mean)
        s, q, n = groups[-1]
        Fn, sk, mk = self.power(s, q, n)
        return (Fn if pre[1] is None else pre[1] * Fn), pre[2] + n * sk, pre[3] + n * mk

    def fft_of(self, sigma: float, q: float) -> Tuple[np.ndarray, float, float]:
        """(rfft of the discretised PRV, its mean shift, its continuous truncated mean)."""
        key = (sigma, q)
        hit = self.ffts.get(key)
        if hit is not None:
            self.ffts.move_to_end(key)
            return hit
        pmf, shift, mean = _discretise(sigma, q, self.grid)
        out = (sfft.rfft(pmf), shift, mean)
        self.ffts[key] = out
        while len(self.ffts) > 1 and sum(v[0].nbytes for v in self.ffts.values()) > self.max_bytes:
            self.ffts.popitem(last=False)
        return out

    def power(self, sigma: float, q: float, n: int) -> Tuple[np.ndarray, float, float]:
        """(F ** n, shift, mean) — cached, so runs of a history that no longer grow
        (e.g. past epochs of a noise schedule) cost one multiplication per query."""
        key = (sigma, q, n)
        hit = self.powers.get(key)
        if hit is not None:
            self.powers.move_to_end(key)
            return hit
        F, shift, mean = self.fft_of(sigma, q)
        out = (F ** n, shift, mean)
        self.powers[key] = out
        while len(self.powers) > 1 and sum(v[0].nbytes for v in self.powers.values()) > self.max_bytes:
            self.powers.popitem(last=False)
        return out


def _discretise(sigma: float, q: float, g: _Grid) -> Tuple[np.ndarray, float, float]:
    """Cell-centred discretisation of the PRV truncated to [t_min, t_max].

    Returns (pmf on the grid, mean shift to apply to the grid, continuous mean).

    Cell masses are CDF differences below t = 0 and survival-function differences
    above (accurate in both tails). Cells below log(1 - q) (where the PRV has no
    mass) and above the point where the survival function underflows are zero and
    are not evaluated.
    """
    h, n = g.h, g.n
    t_min, t_max = g.t_min, g.t_max
    F_lo, _ = _cdf_sf(np.array([t_min]), sigma, q)
    _, S_hi = _cdf_sf(np.array([t_max]), sigma, q)
    remaining = 1.0 - float(F_lo[0]) - float(S_hi[0])
    if not remaining > 0.5:
        raise PRVFailure("the grid does not contain the bulk of the PRV")
    # window of edge indices j0..j1 (edge j sits at t_min + (j - 1/2) h)
    j0 = 0
    if q < 1.0:
        j0 = min(n, max(0, int(math.floor((math.log1p(-q) - t_min) / h + 0.5))))
    z_cut = (0.5 / sigma + 40.0) / sigma
    t_cut = z_cut if q == 1.0 else float(np.logaddexp(math.log1p(-q), math.log(q) + z_cut))
    j1 = min(n, max(j0 + 1, int(math.ceil((t_cut - t_min) / h + 0.5)) + 1))
    j = np.arange(j0, j1 + 1, dtype=np.float64)
    e = np.clip(t_min + (j - 0.5) * h, t_min, t_max)
    low = e <= 0.0
    F = np.zeros_like(e)
    S = np.zeros_like(e)
    F[low], _ = _cdf_sf(e[low], sigma, q, want="F")
    _, S[~low] = _cdf_sf(e[~low], sigma, q, want="S")
    # cell k (edges k, k+1): F-difference, S-difference, or the straddling cell
    lo_c = low[1:]
    hi_c = ~low[:-1]
    mass = np.where(lo_c, F[1:] - F[:-1], np.where(hi_c, S[:-1] - S[1:], (1.0 - S[1:]) - F[:-1]))
    mass = np.maximum(mass, 0.0) / remaining
    pmf = np.zeros(n, dtype=np.float64)
    pmf[j0:j1] = mass
    t = t_min + np.arange(j0, j1, dtype=np.float64) * h
    mean_d = float(_dot(t, mass))
    mean_c = _truncated_mean(sigma, q, t_min, t_max)
    shift = mean_c - mean_d
    if not abs(shift) < h / 2:
        raise PRVFailure(
            f"discrete mean differs from continuous mean (shift {shift:.3g} >= h/2 = {h / 2:.3g})"
        )
    return pmf, shift, mean_c


# ----------------------------------------------------------------------------------
# PLD fallback (dp-accounting)
# ----------------------------------------------------------------------------------
def _pld_pair(groups: Groups, eps_error: float, scale: float = 0.0):
    """Pessimistic and optimistic dp-accounting PLDs of the history.

    The discretisation interval is ~sqrt(eps_error / (2 steps)) (the pessimistic
    PLD's excess ε grows like steps · interval²), at most 1e-3, and at least
    1e-5 · ``scale`` (an ε estimate) so that extreme-ε histories stay tractable.
    """
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    total = sum(n for _, _, n in groups)
    vdi = min(1e-3, math.sqrt(eps_error / (2.0 * max(total, 1))))
    vdi = max(vdi, 2e-5, 1e-5 * scale)
    pess = opt = None
    for s, q, n in groups:
        p = pld_lib.from_gaussian_mechanism(
            s, sampling_prob=q, value_discretization_interval=vdi, pessimistic_estimate=True
        ).self_compose(n)
        o = pld_lib.from_gaussian_mechanism(
            s, sampling_prob=q, value_discretization_interval=vdi, pessimistic_estimate=False,
            use_connect_dots=False,
        ).self_compose(n)
        pess = p if pess is None else pess.compose(p)
        opt = o if opt is None else opt.compose(o)
    return pess, opt


#: δ at which the RDP ε of a history sets the PLD fallback's mesh for ``delta`` queries (their ε
#: need not be the history's scale: ε = 0 asked of a history of ε ~ 100).
DELTA_SCALE_AT = 1e-5


#: Below this δ dp-accounting's PLD is not trusted: its composed PMF is truncated at
#: 1e-15 and float64 FFT round-off reaches ~1e-14, so at δ = 1e-14 (σ=1, q=0.01,
#: 1000 steps) its *optimistic* ε (8.60) exceeds the valid RDP upper bound (4.98).
PLD_MIN_DELTA = 1e-12


#: Past this many steps the PLD fallback is not run and RDP answers: dp-accounting's sparse
#: self-composition first evaluates size**steps as a Python integer, which at 1e8 steps did not
#: finish (review, round 36; 1e7 steps: ~1.4 s).
PLD_MAX_STEPS = 10**7


def _pld_or_none(groups: Groups, eps_error: float, scale: float = 0.0):
    """``_pld_pair``, or None when the history is too long for it or it fails (then RDP answers)."""
    if sum(n for _, _, n in groups) > PLD_MAX_STEPS:
        return None
    try:
        return _pld_pair(groups, eps_error, scale)
    except (ArithmeticError, ValueError, MemoryError):
        return None


def _guarded(f, *args) -> float:
    """``float(f(*args))``, or NaN when dp-accounting fails (e.g. an ``OverflowError``
    in the optimistic PLD of ~2e6 steps, whose privacy losses reach -709, or a
    ``MemoryError`` of a huge composition)."""
    try:
        return float(f(*args))
    except (ArithmeticError, ValueError, MemoryError):
        return math.nan


def pld_roundoff(pld: Any, steps: int) -> float:
    """Estimate (a generous one) of the floating-point error of δ from a composed dp-accounting PLD.

    dp-accounting composes by raising an FFT to the n-th power in float64 and does not
    control the round-off, which grows with n and the PMF length m: at q = 1, σ = 100,
    10⁴ steps its *pessimistic* ε at δ = 1e-12 was 7.2293 where the exact ε is 7.2385
    (σ = 300, 10⁶ steps, δ = 1e-11: 26.06 against 27.36) — a privacy under-statement.
    The FFT leaves noise of about equal size on every entry, visible where the true
    mass is ~0 as negative entries; with s the largest such magnitude (at least one
    ulp of the largest mass), m·s estimates (generously: no entry's noise is assumed
    to cancel another's) the sum of the noise over all m entries.
    The n-th power adds a smooth error of ~n ulps (:data:`POWER_ROUNDOFF`) that leaves
    no negative entries. NaN when the PMF cannot be read (then the PLD is not used).
    """
    eps64 = float(np.finfo(np.float64).eps)
    err = 0.0
    try:
        pmfs = (pld._pmf_remove, pld._pmf_add)
        for pmf in pmfs:
            p = np.asarray(pmf.to_dense_pmf()._probs, dtype=np.float64)
            if p.size == 0:
                continue
            s = max(-float(p.min()), eps64 * float(p.max()))
            err = max(err, p.size * s)
    except (AttributeError, TypeError, ValueError, MemoryError):
        return math.nan
    return err + POWER_ROUNDOFF * steps * eps64


#: The PRV's or the PLD's ε is used only where its round-off is below this fraction of
#: δ; the round-off is then folded into δ.
MAX_ROUNDOFF = 0.1
#: Round-off of composing n steps by an n-th power of a float64 FFT, in ulps per step
#: (measured: up to 1.5 n ulps in a tail sum of the PRV against a long-double FFT, 0.35 n
#: against the exact q = 1 curve; dp-accounting alike).
POWER_ROUNDOFF = 16.0


def _rdp_total(groups: Groups) -> np.ndarray:
    total = np.zeros_like(_RDP_ORDERS)
    for s, q, n in groups:
        total = total + n * rdp_poisson_subsampled_gaussian(noise_multiplier=s, sample_rate=q, orders=_RDP_ORDERS)
    return total


def pld_epsilon(groups: Groups, delta: float, *, eps_error: float = 0.01, scale: float = 0.0) -> EpsilonBounds:
    """ε bounds from dp-accounting's PLD accountant (used as the fallback), checked
    against RDP.

    ``upper`` is the smaller of the pessimistic PLD ε at δ − r (r: the PLD's round-off,
    :func:`pld_roundoff`) and the RDP ε (both valid upper bounds; ``method`` names the
    one used); ``lower`` is the optimistic PLD ε at δ + r when it is consistent
    (≤ ``upper``), else 0. For δ < :data:`PLD_MIN_DELTA`, r > :data:`MAX_ROUNDOFF`·δ,
    or when the PLD is inconsistent with RDP or fails, the answer is RDP's.
    """
    rdp_eps, _ = epsilon_from_rdp(_RDP_ORDERS, _rdp_total(groups), delta)
    upper = lower = math.nan
    pair = _pld_or_none(groups, eps_error, scale) if delta >= PLD_MIN_DELTA else None
    if pair is not None:
        pess, opt = pair
        steps = sum(n for _, _, n in groups)
        r_p, r_o = pld_roundoff(pess, steps), pld_roundoff(opt, steps)
        if r_p <= MAX_ROUNDOFF * delta:
            upper = _guarded(pess.get_epsilon_for_delta, delta - r_p)
        if r_o <= MAX_ROUNDOFF * delta:
            lower = _guarded(opt.get_epsilon_for_delta, delta + r_o)
            if lower >= 700.0:
                # past ~710, exp(-loss) underflows and dp-accounting returns the loss itself,
                # above the true ε (q=1, σ=0.3, 100 steps, δ=1e-11: 778.53 vs exact 778.18)
                lower = 0.0
    if lower > rdp_eps * (1 + 1e-6) + 1e-6:
        # an optimistic ε above a valid upper bound: the PLD numbers are not to be trusted
        upper = lower = math.nan
    if not upper <= rdp_eps:  # NaN, inf, or looser than RDP
        if not math.isfinite(rdp_eps):
            raise RuntimeError(f"PLD fallback and RDP both returned a non-finite ε ({upper}, {rdp_eps}).")
        lower = lower if lower <= rdp_eps else 0.0
        return EpsilonBounds(max(0.0, lower), rdp_eps, rdp_eps, "rdp")
    lower = lower if lower <= upper else 0.0  # NaN (a failed optimistic run) -> 0
    return EpsilonBounds(max(0.0, lower), upper, upper, "pld")


def pld_delta(groups: Groups, epsilon: float, *, eps_error: float = 0.01, scale: float = 0.0) -> DeltaBounds:
    """δ bounds from dp-accounting's PLD accountant (used as the fallback), checked
    against RDP as in :func:`pld_epsilon`: ``upper`` is the smaller of the RDP δ and
    the pessimistic PLD δ plus its round-off, the latter floored at :data:`PLD_MIN_DELTA`
    (below it the PLD is not trusted; the floor keeps δ(ε) monotone); a PLD whose
    optimistic δ exceeds RDP's is not used."""
    rdp_d, _ = delta_from_rdp(_RDP_ORDERS, _rdp_total(groups), epsilon)
    rdp_d = min(1.0, float(rdp_d))
    pair = _pld_or_none(groups, eps_error, scale)
    if pair is None:
        return DeltaBounds(0.0, rdp_d, rdp_d, "rdp")
    pess, opt = pair
    steps = sum(n for _, _, n in groups)
    r_p, r_o = pld_roundoff(pess, steps), pld_roundoff(opt, steps)
    upper = _guarded(pess.get_delta_for_epsilon, epsilon) + r_p
    lower = _guarded(opt.get_delta_for_epsilon, epsilon) - r_o
    if math.isnan(upper) or lower > rdp_d * (1 + 1e-6) + 1e-12:  # (NaN explicit: min/max hide it)
        upper = lower = math.nan
    else:
        upper = min(1.0, max(upper, PLD_MIN_DELTA))
        lower = max(0.0, lower) if lower == lower else 0.0
    if not upper <= rdp_d:  # NaN, or looser than RDP
        lower = lower if lower <= rdp_d else 0.0
        return DeltaBounds(lower, rdp_d, rdp_d, "rdp")
    lower = lower if lower <= upper else 0.0
    return DeltaBounds(lower, upper, upper, "pld")


# ----------------------------------------------------------------------------------
# The accountant
# ----------------------------------------------------------------------------------
class PRVAccountant(HistoryAccountant):
    """PRV accountant for DP-SGD with Poisson sampling (add/remove-one neighbours).

    ::

        acct = PRVAccountant()
        acct.step(noise_multiplier=1.1, sample_rate=0.01, num_steps=100)  # σ, q may vary
        acct.epsilon(delta=1e-5)     # EpsilonBounds(lower, estimate, upper, method)
        acct.delta(epsilon=3.0)      # DeltaBounds(lower, estimate, upper, method)
        state = acct.state_dict(); acct2 = PRVAccountant.from_state_dict(state)

    Options (keyword-only):

    * ``eps_error`` — ε discretisation error of the PRV method (default 0.01); the
      reported ``upper - lower`` is about ``2 * eps_error`` where the PRV method answers (on the
      PLD / RDP fallback at high ε, ``lower``, the optimistic PLD's, can be far below ``upper``:
      q = 0.1, σ = 1, 10⁵ steps gives lower 462 for a true ~955; a valid bound, a loose one).
      ε as a function of the steps is monotone only up to ``eps_error`` (the grid changes
      with the step count: σ = 5, q = 0.001 gives upper 0.011304 at 11 steps, 0.011243 at 12).
    * ``delta_error`` — δ error; default max(δ/1000, min(1e-12, δ/10)) for
      :meth:`epsilon` and for :meth:`delta` 1e-10, or the same rule applied to the answer when
      that is finer (round 36: so that δ(ε(δ).upper).upper ≤ δ at small δ in the usual regimes;
      not a guarantee: where ε(δ).upper is near or below ``eps_error`` the δ at that ε carries the ε
      discretisation error and comes out larger, never smaller; review, round 38).
    * ``fallback`` — fall back to dp-accounting's PLD when the PRV computation is
      detected to be unreliable (default True); with False such cases raise
      :class:`PRVFailure`.
    * ``max_grid_size`` — largest PRV grid (points) before falling back (default 2**23).

    Results are cached on the history, so ``epsilon`` after every ``step`` is cheap
    (one inverse FFT of the cached per-(σ, q) transforms).

    Formal guarantee: for add/remove-one neighbouring datasets, the composition of
    the recorded steps (each: Poisson subsampling with rate q, clipped-sum sensitivity
    1, Gaussian noise σ) is (ε, δ)-DP with ε = ``epsilon(δ).upper`` and, equivalently,
    (ε, ``delta(ε).upper``)-DP. With ``method == "prv"`` this rests on the error
    bounds of Gopi et al. 2021 (Thm. 5.5); with ``"pld"`` on dp-accounting's
    pessimistic PLD; with ``"rdp"`` (where RDP's bound is tighter than the PRV's or the
    PLD's, e.g. :meth:`delta` at a large ε, or δ < 1e-12 or below ten times the float64
    round-off of a long history, where neither the PRV nor the PLD is trusted) on the RDP bound.
    """

    name = "prv"

    def __init__(
        self,
        *,
        eps_error: float = 0.01,
        delta_error: Optional[float] = None,
        fallback: bool = True,
        max_grid_size: int = 2 ** 23,
    ) -> None:
        super().__init__()
        eps_error = float(eps_error)
        if not (math.isfinite(eps_error) and 0 < eps_error <= 1):
            raise ValueError(f"eps_error must be in (0, 1], got {eps_error!r}.")
        self.eps_error = eps_error
        self.delta_error = optional_delta_error(delta_error)
        if not isinstance(fallback, (bool, np.bool_)):  # (review, round 38: "no" was True, None False)
            raise TypeError(f"fallback must be True or False, got {fallback!r}")
        self.fallback = bool(fallback)
        if isinstance(max_grid_size, (bool, np.bool_)) or not isinstance(max_grid_size, numbers.Real) \
                or not float(max_grid_size).is_integer() or max_grid_size < 1:
            raise ValueError(f"max_grid_size must be a positive whole number (PRV grid points), got {max_grid_size!r}")
        self.max_grid_size = int(max_grid_size)
        self._grids: "OrderedDict[float, _GridState]" = OrderedDict()
        self._composed: "OrderedDict[Any, _Composed]" = OrderedDict()
        self._results: "OrderedDict[Any, Any]" = OrderedDict()
        self._rdp: Dict[Tuple[float, float], np.ndarray] = {}
        self._warned: set = set()
        #: why the last query fell back to PLD (None if it did not)
        self.last_fallback_reason: Optional[str] = None

    def _options(self) -> Dict[str, Any]:
        return {
            "eps_error": self.eps_error,
            "delta_error": self.delta_error,
            "fallback": self.fallback,
            "max_grid_size": self.max_grid_size,
        }

    # -- RDP helpers (domain size and sanity check) ---------------------------
    def _step_rdp(self, sigma: float, q: float) -> np.ndarray:
        key = (sigma, q)
        r = self._rdp.get(key)
        if r is None:
            r = rdp_poisson_subsampled_gaussian(noise_multiplier=sigma, sample_rate=q, orders=_RDP_ORDERS)
            self._rdp[key] = r
        return r

    def _total_rdp(self, groups: Groups, scale: float = 1.0) -> np.ndarray:
        total = np.zeros_like(_RDP_ORDERS)
        for s, q, n in groups:
            total = total + (n * scale) * self._step_rdp(s, q)
        return total

    def _required_L(self, groups: Groups, capacity: int, delta_error: float) -> float:
        """Domain half-width of Remark 5.6 in Gopi et al. (as prv_accountant does it)."""
        total = sum(n for _, _, n in groups)
        scale = capacity / total
        L, _ = epsilon_from_rdp(_RDP_ORDERS, self._total_rdp(groups, scale), delta_error / 4.0)
        for s, q, _n in groups:
            Lk, _ = epsilon_from_rdp(_RDP_ORDERS, self._step_rdp(s, q), delta_error / 8.0 / capacity)
            L = max(L, Lk)
        return max(L, self.eps_error) + 3.0

    # -- grid management -------------------------------------------------------
    def _grid_state(self, groups: Groups, delta_error: float) -> _GridState:
        """The grid for this history: a deterministic function of (history, errors).

        The mesh is set for the number of steps rounded up to a √2-ladder
        ("capacity", a finer mesh than needed is valid) and the domain half-width is
        rounded up to a 1.1-ladder (a wider domain is valid), so consecutive queries
        of a growing history share the grid (and the cached per-(σ, q) transforms),
        and results never depend on the order of queries.
        """
        total = sum(n for _, _, n in groups)
        capacity = _capacity(total)
        L = _ladder(self._required_L(groups, total, delta_error))
        key = (capacity, L, delta_error, self.eps_error)  # (the mesh depends on eps_error: review, round 35)
        state = self._grids.get(key)
        if state is not None:
            self._grids.move_to_end(key)
            return state
        h = _mesh_size(capacity, self.eps_error, delta_error)
        K = int(math.ceil(L / h))
        n = _even_fast_len(2 * K + 2)
        if n > self.max_grid_size:
            raise PRVFailure(
                f"PRV grid of {n} points exceeds max_grid_size={self.max_grid_size} "
                f"(domain ±{L:.3g}, mesh {h:.3g})"
            )
        grid = _Grid(h=h, n=n, K=n // 2 - 1, capacity=capacity, L=L,
                     eps_error=self.eps_error, delta_error=delta_error)
        state = _GridState(grid)
        self._grids[key] = state
        while len(self._grids) > 2:
            self._grids.popitem(last=False)
        return state

    def _compose(self, groups: Groups, delta_error: float) -> _Composed:
        key = (groups, delta_error, self.eps_error)
        hit = self._composed.get(key)
        if hit is not None:
            self._composed.move_to_end(key)
            return hit
        state = self._grid_state(groups, delta_error)
        g = state.grid
        F, shift, mean = state.compose(groups)
        total = sum(n for _, _, n in groups)
        f = sfft.irfft(F, g.n)
        f = np.roll(f, -(((total - 1) * g.K) % g.n))
        if not np.all(np.isfinite(f)):
            raise PRVFailure("non-finite composed PMF")
        mass = float(f.sum())
        if abs(mass - 1.0) > 1e-6 or float(f.min()) < -1e-9:
            raise PRVFailure(f"composed PMF is not a distribution (mass {mass!r}, min {float(f.min())!r})")
        # Means add under composition, and each discretised PRV has exactly the
        # continuous mean; a mismatch means aliasing (mass wrapped around the
        # periodic grid) or a corrupted PMF.
        mean_d = g.t_min + shift + g.h * float(_dot(np.arange(g.n, dtype=np.float64), f))
        if not abs(mean_d - mean) <= g.h:
            raise PRVFailure(f"composed mean {mean_d:.6g} differs from the sum of means {mean:.6g}")
        t0 = g.t_min + shift
        j0 = max(0, int(math.floor((-(self.eps_error + 2.0 * g.h) - t0) / g.h)))
        t = t0 + g.h * np.arange(j0, g.n, dtype=np.float64)
        if t[-1] - t[0] > 700.0:
            raise PRVFailure("grid too wide for float64 evaluation (ε > ~300)")
        p = f[j0:]
        d1 = _rev_cumsum(p)
        E = _rev_cumsum(p * np.exp(t[0] - t)) * np.exp(t - t[0])
        # Round-off in a tail sum of the composed PMF. The FFT leaves noise of a few
        # ulps of max(f) on every entry, visible as the negative entries (true values
        # are >= 0); its sum over m entries is estimated as 6 sqrt(m) times its RMS
        # (estimated from the negative entries), plus the blocked-summation error.
        neg = np.minimum(p, 0.0)
        rms = math.sqrt(2.0 * _dot(neg, neg) / len(p))
        eps64 = np.finfo(np.float64).eps
        # (twice: δ = d1 - e^(ε-t) E is a difference of two tail sums)
        roundoff = 2.0 * (6.0 * math.sqrt(len(p)) * rms + (1024 + len(p) / 1024) * eps64)
        # Raising the transforms to the n-th power multiplies their relative round-off by n:
        # a smooth error of ~n ulps in the tail sums that leaves no negative entries
        # (q = 1, σ = 1000, 10⁵ steps: δ off by -7.8e-12 with the estimate above at 5.5e-13,
        # and ε at δ = 1e-11 under-stated, 2.0099 against the exact 2.0237).
        roundoff += POWER_ROUNDOFF * total * eps64
        comp = _Composed(t=t, d1=d1, E=E, ndelta=E - d1, n=g.n, roundoff=roundoff)
        self._composed[key] = comp
        while len(self._composed) > 4:
            self._composed.popitem(last=False)
        return comp

    def _remember(self, key: Any, value: Any) -> Any:
        # the fallback reason is kept with the result, so a cache hit reports its own
        self._results[key] = (value, self.last_fallback_reason)
        while len(self._results) > 256:
            self._results.popitem(last=False)
        return value

    def _recall(self, key: Any) -> Any:
        hit = self._results.get(key)
        if hit is None:
            return None
        self._results.move_to_end(key)
        value, self.last_fallback_reason = hit
        return value

    def _on_failure(self, reason: str) -> None:
        self.last_fallback_reason = reason
        if reason not in self._warned and not getattr(self, "_quiet_fallback", False):  # (calibrate_noise: told once)
            self._warned.add(reason)
            warn(
                f"PRV accounting unreliable here ({reason}); using dp-accounting's PLD accountant "
                "instead (or RDP, where that is tighter or the PLD is not reliable).",
                RuntimeWarning,
            )

    # -- public queries ----------------------------------------------------------
    def epsilon(self, delta: float) -> EpsilonBounds:
        """Bounds on ε for the given δ. Formal guarantee: the history is (``upper``, δ)-DP."""
        delta = check_delta(delta)
        groups = self._groups()
        if not groups:
            return EpsilonBounds(0.0, 0.0, 0.0, "none")
        delta_error = self.delta_error if self.delta_error is not None else _default_delta_error(delta)
        if delta_error >= delta:
            raise ValueError(f"delta_error ({delta_error:g}) must be smaller than delta ({delta:g}).")
        key = ("eps", groups, delta, delta_error, self.eps_error)
        hit = self._recall(key)
        if hit is not None:
            return hit
        try:
            res = self._prv_epsilon(groups, delta, delta_error)
            self.last_fallback_reason = None
        except Exception as exc:  # noqa: BLE001 - any failure of the PRV path triggers the fallback
            if not self.fallback:
                if isinstance(exc, PRVFailure):
                    raise
                raise PRVFailure(f"PRV accounting failed: {exc}") from exc
            self._on_failure(f"{type(exc).__name__}: {exc}")
            scale, _ = epsilon_from_rdp(_RDP_ORDERS, self._total_rdp(groups), delta)
            res = pld_epsilon(groups, delta, eps_error=self.eps_error, scale=scale)
        return self._remember(key, res)

    def _prv_epsilon(self, groups: Groups, delta: float, delta_error: float) -> EpsilonBounds:
        res = self._prv_epsilon_raw(groups, delta, delta_error)
        lower, est, upper = res[:3]
        if not all(math.isfinite(v) for v in (lower, est, upper)) or not (lower <= est <= upper):
            raise PRVFailure(f"inconsistent PRV bounds ({lower}, {est}, {upper})")
        # RDP always gives a valid upper bound: a PRV lower bound above it is wrong.
        rdp_eps, _ = epsilon_from_rdp(_RDP_ORDERS, self._total_rdp(groups), delta)
        if lower > rdp_eps * (1 + 1e-6) + 1e-6:
            raise PRVFailure(f"PRV lower bound {lower:.6g} exceeds the RDP upper bound {rdp_eps:.6g}")
        if rdp_eps < upper:  # RDP's bound is the tighter valid one (rare for ε)
            return EpsilonBounds(min(lower, rdp_eps), min(est, rdp_eps), float(rdp_eps), "rdp")
        return res

    def _prv_epsilon_raw(self, groups: Groups, delta: float, delta_error: float) -> EpsilonBounds:
        comp = self._compose(groups, delta_error)
        if comp.roundoff > MAX_ROUNDOFF * delta:
            raise PRVFailure(
                f"floating-point round-off (<= {comp.roundoff:.2g}) would exceed {MAX_ROUNDOFF:g} δ (δ={delta:.2g})"
            )
        derr = delta_error + comp.roundoff  # the round-off bound is folded into the δ error
        if derr >= delta:
            raise PRVFailure(f"δ error {derr:.2g} not below δ={delta:.2g}")
        est = comp.epsilon(delta)
        upper = comp.epsilon(delta - derr) + self.eps_error
        lower = max(0.0, comp.epsilon(delta + derr) - self.eps_error)
        return EpsilonBounds(float(lower), float(est), float(upper), "prv")

    def delta(self, epsilon: float) -> DeltaBounds:
        """Bounds on δ for the given ε. Formal guarantee: the history is (ε, ``upper``)-DP."""
        epsilon = check_epsilon(epsilon)
        groups = self._groups()
        if not groups:
            return DeltaBounds(0.0, 0.0, 0.0, "none")
        delta_error = self.delta_error if self.delta_error is not None else DEFAULT_DELTA_ERROR_FOR_DELTA
        key = ("delta", groups, epsilon, delta_error, self.eps_error)
        hit = self._recall(key)
        if hit is not None:
            return hit
        try:
            res = self._prv_delta(groups, epsilon, delta_error)
            fine = _default_delta_error(res.estimate)
            if self.delta_error is None and fine < delta_error:
                # an error of 1e-10 on a δ of 1e-9 is 10 %: ε(δ) then maps back to a δ above the target
                # (review, round 36); the PRV again with an error relative to the answer
                try:
                    res = self._prv_delta(groups, epsilon, fine)
                except Exception:  # noqa: BLE001  (the coarser answer is a valid bound too)
                    pass
            self.last_fallback_reason = None
        except Exception as exc:  # noqa: BLE001
            if not self.fallback:
                if isinstance(exc, PRVFailure):
                    raise
                raise PRVFailure(f"PRV accounting failed: {exc}") from exc
            self._on_failure(f"{type(exc).__name__}: {exc}")
            # (the PLD's mesh follows the history's ε scale, not the queried ε: at ε = 0 the mesh was
            # as fine as for a history of ε ~ 1, 107 s for σ = 0.0126; review, round 38)
            scale, _ = epsilon_from_rdp(_RDP_ORDERS, self._total_rdp(groups), DELTA_SCALE_AT)
            res = pld_delta(groups, epsilon, eps_error=self.eps_error, scale=max(epsilon, scale))
        return self._remember(key, res)

    def _prv_delta(self, groups: Groups, epsilon: float, delta_error: float) -> DeltaBounds:
        comp = self._compose(groups, delta_error)
        derr = delta_error + comp.roundoff  # the round-off bound is folded into the δ error
        raw = (comp.delta(epsilon + self.eps_error), comp.delta(epsilon), comp.delta(epsilon - self.eps_error))
        if not all(math.isfinite(v) for v in raw):  # before clamping: max(0.0, nan) is 0.0
            raise PRVFailure(f"non-finite PRV δ {raw}")
        est = min(1.0, max(0.0, raw[1]))
        upper = min(1.0, max(0.0, raw[2]) + derr)
        lower = max(0.0, raw[0] - derr)
        if not (lower <= est <= upper):
            raise PRVFailure(f"inconsistent PRV bounds ({lower}, {est}, {upper})")
        rdp_delta, _ = delta_from_rdp(_RDP_ORDERS, self._total_rdp(groups), epsilon)
        if lower > rdp_delta * (1 + 1e-6) + 1e-12:
            raise PRVFailure(f"PRV lower bound {lower:.6g} exceeds the RDP upper bound {rdp_delta:.6g}")
        if rdp_delta < upper:
            # RDP's bound is the tighter valid one: at a large ε, where the PRV's upper is at least
            # its δ error (1e-10 by default) and RDP's far below (σ=1, q=0.01, 1000 steps, ε=5: 8.4e-15)
            r = float(rdp_delta)
            return DeltaBounds(min(float(lower), r), min(float(est), r), r, "rdp")
        return DeltaBounds(float(lower), float(est), float(upper), "prv")
