"""Shared pieces of the accountants: result types, input checks, history.

numpy/scipy only; no torch import anywhere in ``pdpsgd.accounting``.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

__all__ = [
    "EpsilonBounds",
    "DeltaBounds",
    "Run",
    "check_noise_multiplier",
    "MIN_NOISE_MULTIPLIER",
    "check_sample_rate",
    "check_delta",
    "check_epsilon",
    "check_num_steps",
]


class EpsilonBounds(NamedTuple):
    """Bounds on the ε of an (ε, δ)-DP guarantee, for a fixed δ.

    ``lower <= true ε <= upper`` holds up to the stated numerical method
    (``method``): ``"prv"`` (Gopi et al. 2021 error bounds, rigorous),
    ``"pld"`` (dp-accounting PLD fallback: ``upper``/``estimate`` are the
    pessimistic PLD value, ``lower`` the optimistic one, each with the PLD's
    float64 round-off folded into δ), ``"rdp"`` (RDP gives
    only an upper bound, so ``lower`` is 0 or, from the PRV accountant where RDP's bound
    is the tighter one, the PRV's or optimistic PLD's lower bound), ``"none"`` (empty history).

    Quote ``upper`` as the privacy guarantee.
    """

    lower: float
    estimate: float
    upper: float
    method: str = "prv"


class DeltaBounds(NamedTuple):
    """Bounds on the δ of an (ε, δ)-DP guarantee, for a fixed ε.

    Same conventions as :class:`EpsilonBounds`; quote ``upper``.
    """

    lower: float
    estimate: float
    upper: float
    method: str = "prv"


class Run(NamedTuple):
    """One entry of an accountant's run-length history."""

    noise_multiplier: float
    sample_rate: float
    num_steps: int


def _as_real(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({value!r}).")
    return float(value)


#: the smallest σ the accountants take: below it ε is in the thousands (one step at q = 0.01 and
#: σ = 0.01: ε ≈ 15,000), and the grids that resolve it grow as 1/σ² (σ = 0.001 took over 24 GB
#: and was killed by the OS, with no Python error: review, round 35)
MIN_NOISE_MULTIPLIER = 0.01


def check_noise_multiplier(noise_multiplier: Any) -> float:
    sigma = _as_real(noise_multiplier, "noise_multiplier")
    if not (math.isfinite(sigma) and sigma > 0):
        raise ValueError(
            f"noise_multiplier must be a finite number > 0, got {noise_multiplier!r}. It is the "
            "ratio σ = (noise std) / (clipping norm); σ = 0 means no privacy at all."
        )
    if sigma < MIN_NOISE_MULTIPLIER:
        raise ValueError(
            f"noise_multiplier {noise_multiplier!r} is below {MIN_NOISE_MULTIPLIER}: ε would be in the thousands "
            "(no meaningful guarantee), and accounting it would need gigabytes of memory. Use a larger σ, or "
            "train without DP and say so."
        )
    return sigma


def check_sample_rate(sample_rate: Any) -> float:
    q = _as_real(sample_rate, "sample_rate")
    if not (math.isfinite(q) and 0.0 < q <= 1.0):
        raise ValueError(
            f"sample_rate must be in (0, 1], got {sample_rate!r}. It is the Poisson inclusion "
            "probability of each example, e.g. expected_batch_size / num_examples."
        )
    return q


def check_delta(delta: Any) -> float:
    d = _as_real(delta, "delta")
    if not (0.0 < d < 1.0):
        raise ValueError(
            f"delta must be in the open interval (0, 1), got {delta!r}. A common choice is "
            "delta < 1 / num_examples (e.g. 1e-5)."
        )
    return d


def check_epsilon(epsilon: Any, name: str = "epsilon") -> float:
    e = _as_real(epsilon, name)
    if not (math.isfinite(e) and e >= 0.0):
        raise ValueError(f"{name} must be a finite number >= 0, got {epsilon!r}.")
    return e


def check_num_steps(num_steps: Any, name: str = "num_steps") -> int:
    if isinstance(num_steps, bool):
        raise TypeError(f"{name} must be an integer, got a bool ({num_steps!r}).")
    if isinstance(num_steps, numbers.Integral):
        n = int(num_steps)
    elif isinstance(num_steps, numbers.Real) and float(num_steps).is_integer():
        n = int(num_steps)
    else:
        raise TypeError(f"{name} must be an integer, got {num_steps!r}.")
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}.")
    if n > MAX_STEPS:  # (review, round 39: 10**400 was taken, and ε(δ) then raised a bare OverflowError)
        raise ValueError(f"{name} = {n} is beyond what an accountant composes ({MAX_STEPS} = 2^53 steps, where "
                         "step counts stop being exact floats).")
    return n


#: The most steps a history holds (in one call and in all): counts stay exact as floats.
MAX_STEPS = 2 ** 53


class HistoryAccountant:
    """Base class: a run-length history of (σ, q, steps) and its (de)serialisation.

    Subclasses implement :meth:`epsilon` and :meth:`delta`.
    """

    #: short name used by :func:`pdpsgd.accounting.make_accountant`.
    name: str = "base"

    def __init__(self) -> None:
        self._history: List[List[Any]] = []  # [[sigma, q, n], ...]
        self._version = 0  # bumped at every change (cache invalidation)

    # -- history -----------------------------------------------------------
    def step(self, *, noise_multiplier: float, sample_rate: float, num_steps: int = 1):
        """Record ``num_steps`` DP-SGD steps with noise σ and Poisson rate q.

        Consecutive calls with the same (σ, q) are merged (run-length history), so
        calling this once per training step is cheap. Returns ``self``.
        """
        sigma = check_noise_multiplier(noise_multiplier)
        q = check_sample_rate(sample_rate)
        n = check_num_steps(num_steps)
        if n == 0:
            return self
        if self.num_steps + n > MAX_STEPS:
            raise ValueError(f"{self.num_steps} + {n} steps is beyond what an accountant composes ({MAX_STEPS} = "
                             "2^53 steps).")
        if self._history and self._history[-1][0] == sigma and self._history[-1][1] == q:
            self._history[-1][2] += n
        else:
            self._history.append([sigma, q, n])
        self._version += 1
        return self

    @property
    def history(self) -> Tuple[Run, ...]:
        """The run-length history, oldest first, as :class:`Run` tuples."""
        return tuple(Run(float(s), float(q), int(n)) for s, q, n in self._history)

    @property
    def num_steps(self) -> int:
        """Total number of recorded steps."""
        return int(sum(n for _, _, n in self._history))

    def reset(self) -> None:
        """Forget the history (e.g. to reuse the object for a new run)."""
        self._history = []
        self._version += 1

    def _groups(self) -> Tuple[Tuple[float, float, int], ...]:
        """History grouped by distinct (σ, q), sorted: composition is commutative."""
        acc: Dict[Tuple[float, float], int] = {}
        for s, q, n in self._history:
            acc[(s, q)] = acc.get((s, q), 0) + n
        return tuple(sorted((s, q, n) for (s, q), n in acc.items()))

    # -- options / serialisation --------------------------------------------
    def _options(self) -> Dict[str, Any]:
        return {}

    def state_dict(self) -> Dict[str, Any]:
        """A JSON-serialisable snapshot: accountant name, options and history."""
        return {
            "accountant": self.name,
            "version": 1,
            "options": self._options(),
            "history": [[float(s), float(q), int(n)] for s, q, n in self._history],
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Replace the history by the one in ``state`` (options are not changed)."""
        if not isinstance(state, dict) or "history" not in state:
            raise ValueError("state must be a dict produced by state_dict() (it has no 'history' key).")
        history: List[List[Any]] = []
        for entry in state["history"]:
            if len(entry) != 3:
                raise ValueError(f"malformed history entry {entry!r}; expected [sigma, q, steps].")
            s = check_noise_multiplier(entry[0])
            q = check_sample_rate(entry[1])
            n = check_num_steps(entry[2])
            if n:
                history.append([s, q, n])
        self._history = history
        self._version += 1

    @classmethod
    def from_state_dict(cls, state: Dict[str, Any], **options: Any):
        """Rebuild an accountant from :meth:`state_dict` output.

        Options saved in ``state`` are used when it was written by the same kind of
        accountant; keyword ``options`` override them.
        """
        if not isinstance(state, dict):
            raise ValueError("state must be a dict produced by state_dict().")
        opts: Dict[str, Any] = {}
        if state.get("accountant") == cls.name:
            opts.update(state.get("options") or {})
        opts.update(options)
        acct = cls(**opts)
        acct.load_state_dict(state)
        return acct

    def __repr__(self) -> str:
        runs = ", ".join(f"(σ={s:g}, q={q:g}, steps={n})" for s, q, n in self._history)
        return f"{type(self).__name__}([{runs}])"


def optional_delta_error(delta_error: Optional[float]) -> Optional[float]:
    if delta_error is None:
        return None
    d = _as_real(delta_error, "delta_error")
    if not (0.0 < d < 1.0):
        raise ValueError(f"delta_error must be in (0, 1), got {delta_error!r}.")
    return d
