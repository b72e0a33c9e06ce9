"""pdpsgd: differentially private training (DP-SGD) of NLP models at near non-private cost."""
from ._types import EngineResult, StepOutput
from .accounting import (
    DeltaBounds,
    EpsilonBounds,
    PrivacyPlan,
    PRVAccountant,
    RDPAccountant,
    calibrate_noise,
    make_accountant,
    plan_privacy,
)
from .functional import trainable_params
from .sampling import PhysicalBatch, PoissonSampler, collate, to_physical_batches
from .step import ClippedSum, DPStep, make_dp_step

__version__ = "0.1.0"

__all__ = [
    "make_dp_step",
    "trainable_params",
    "DPStep",
    "StepOutput",
    "ClippedSum",
    "EngineResult",
    "PRVAccountant",
    "RDPAccountant",
    "EpsilonBounds",
    "DeltaBounds",
    "calibrate_noise",
    "plan_privacy",
    "PrivacyPlan",
    "make_accountant",
    "PoissonSampler",
    "PhysicalBatch",
    "to_physical_batches",
    "collate",
]
