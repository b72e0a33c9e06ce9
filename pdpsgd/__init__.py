"""pdpsgd: differentially private training (DP-SGD) of NLP models at near non-private cost."""
from ._types import EngineResult, StepOutput
from .functional import trainable_params
from .step import ClippedSum, DPStep, make_dp_step

__version__ = "0.1.0"

__all__ = [
    "make_dp_step",
    "trainable_params",
    "DPStep",
    "StepOutput",
    "ClippedSum",
    "EngineResult",
]
