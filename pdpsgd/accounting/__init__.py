"""Privacy accounting for DP-SGD with Poisson sampling (numpy/scipy only, no torch).

* :class:`PRVAccountant` — numerical composition of privacy random variables
  (Gopi et al. 2021) with rigorous error bounds; falls back to dp-accounting's PLD
  when it detects that the PRV computation is unreliable.
* :class:`RDPAccountant` — Rényi DP (Mironov et al. 2019), a looser cross-check.
* :func:`calibrate_noise` — smallest σ whose upper ε bound meets a target.
* :func:`plan_privacy` — (target ε, δ, dataset size, batch size, epochs) → (σ, q, steps).
"""
from ._common import MIN_NOISE_MULTIPLIER, DeltaBounds, EpsilonBounds, Run
from .calibrate import (
    ACCOUNTANTS,
    PrivacyPlan,
    calibrate_noise,
    make_accountant,
    plan_privacy,
)
from .prv import PRVAccountant, PRVFailure
from .rdp import (
    DEFAULT_RDP_ORDERS,
    RDPAccountant,
    delta_from_rdp,
    epsilon_from_rdp,
    rdp_poisson_subsampled_gaussian,
)

__all__ = [
    "ACCOUNTANTS",
    "DEFAULT_RDP_ORDERS",
    "DeltaBounds",
    "MIN_NOISE_MULTIPLIER",
    "EpsilonBounds",
    "PRVAccountant",
    "PRVFailure",
    "PrivacyPlan",
    "RDPAccountant",
    "Run",
    "calibrate_noise",
    "delta_from_rdp",
    "epsilon_from_rdp",
    "make_accountant",
    "plan_privacy",
    "rdp_poisson_subsampled_gaussian",
]
