"""Poisson sampling for DP-SGD, and fixed-shape physical batches.

The privacy accountants (:mod:`pdpsgd.accounting`) assume **Poisson sampling**:
at every step each of the N examples is included independently with probability
q, so the logical batch size is Binomial(N, q) — random. Shuffling the data and
cutting fixed-size batches is *not* Poisson sampling and does not carry the
accounted guarantee.

* :class:`PoissonSampler` yields one LongTensor of example indices per step.
* :func:`to_physical_batches` turns one such (variable-size) logical batch into a
  list of :class:`PhysicalBatch` of a fixed shape ``max_batch_size`` with a
  ``mask`` marking real rows (padding rows hold index 0 and mask False), so
  compiled code sees a single shape. A logical batch larger than
  ``max_batch_size`` is split across several physical batches — never truncated
  (dropping examples would change the sampling distribution and void the
  guarantee). An empty logical batch gives one all-padding physical batch: the
  noisy update of that step must still happen.
* :func:`collate` gathers the rows of a dict of tensors for a physical batch.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Dict, Iterator, List, NamedTuple, Tuple, Union

import torch

from ._seeding import keyed_generator, seed_key

__all__ = ["PoissonSampler", "PhysicalBatch", "to_physical_batches", "collate"]


class PhysicalBatch(NamedTuple):
    """One fixed-shape slice of a logical batch.

    ``indices``: LongTensor[max_batch_size], example indices (0 in padding rows).
    ``mask``: BoolTensor[max_batch_size], True for real rows, False for padding.
    """

    indices: torch.Tensor
    mask: torch.Tensor


def _check_int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}.")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")
    return value


def _grid_rate(q: float) -> float:
    """floor(q·2^53)·2^-53 (exact in float64): the largest inclusion probability ≤ q that uniform
    variates on the 2^-53 grid give exactly."""
    return math.floor(q * 2.0 ** 53) * 2.0 ** -53


def _check_rate(sample_rate: Any) -> float:
    if isinstance(sample_rate, bool):
        raise TypeError(f"sample_rate must be a real number, got {sample_rate!r}.")
    try:
        q = float(sample_rate)
    except (TypeError, ValueError):
        raise TypeError(f"sample_rate must be a real number, got {sample_rate!r}.") from None
    if not (math.isfinite(q) and 0.0 < q <= 1.0):
        raise ValueError(
            f"sample_rate must be in (0, 1], got {sample_rate!r}. It is the Poisson inclusion "
            "probability of each example, e.g. expected_batch_size / num_examples."
        )
    return q


def _make_generator(generator: Union[None, int, torch.Generator]) -> torch.Generator:
    if generator is None:  # OS entropy into the whole state: not reproducible, not predictable
        return keyed_generator(None)
    if isinstance(generator, torch.Generator):
        if generator.device.type != "cpu":
            raise ValueError("PoissonSampler needs a CPU torch.Generator (draws are made on the CPU).")
        return generator
    if isinstance(generator, int) and not isinstance(generator, bool):
        # (the seed's every bit keys the whole state: manual_seed would keep its low 32 bits)
        return keyed_generator(seed_key(generator, "PoissonSampler"))
    raise TypeError(f"generator must be None, an int seed or a torch.Generator, got {type(generator).__name__}.")


class PoissonSampler:
    """Poisson sampler: ``steps`` logical batches, each example included w.p. ``sample_rate``.

    ::

        sampler = PoissonSampler(num_examples=50_000, sample_rate=0.01, steps=5000, generator=0)
        for indices in sampler:                      # LongTensor, sorted, variable length
            for pb in to_physical_batches(indices, max_batch_size=1024):
                batch, mask = collate(data, pb)      # fixed shape [1024, ...]

    Each step draws N independent uniform float64 variates (multiples of 2^-53) and
    keeps ``u < floor(q·2^53)·2^-53``, so inclusions are independent across examples
    and across steps, with probability floor(q·2^53)/2^53: q up to 2^-53, and never
    above it (``u < q`` includes ceil(q·2^53) of the 2^53 values: at q = 1e-17, 11 q).
    ``len(sampler) == steps``. Iteration resumes from the current position
    (``sampler.position``); :meth:`state_dict` / :meth:`load_state_dict` save and
    restore the position and the generator state for an exact resume.

    ``generator``: a CPU ``torch.Generator`` (used and advanced in place), an int
    seed, or ``None`` (default) for a generator seeded from OS entropy
    (``secrets``) — use that for real private training: batches that someone can
    recompute from a known seed void the amplification by subsampling that the
    accountant's ε counts on (review, round 33; this said the opposite before).

    Formal guarantee: the index sets are exactly the Poisson subsampling assumed by
    :class:`pdpsgd.accounting.PRVAccountant` / ``RDPAccountant`` with the same
    ``sample_rate`` and ``steps``.
    """

    def __init__(
        self,
        num_examples: int,
        sample_rate: float,
        steps: int,
        *,
        generator: Union[None, int, torch.Generator] = None,
    ) -> None:
        self.num_examples = _check_int(num_examples, "num_examples", 1)
        self.sample_rate = _check_rate(sample_rate)
        self.steps = _check_int(steps, "steps", 0)
        self.generator = _make_generator(generator)
        self.position = 0

    @classmethod
    def from_plan(cls, plan: Any, *, generator: Union[None, int, torch.Generator] = None) -> "PoissonSampler":
        """Sampler for a :class:`pdpsgd.accounting.PrivacyPlan` (uses its num_examples, sample_rate, steps)."""
        return cls(plan.num_examples, plan.sample_rate, plan.steps, generator=generator)

    def __len__(self) -> int:
        return self.steps

    @property
    def remaining(self) -> int:
        """Steps not drawn yet."""
        return self.steps - self.position

    @property
    def expected_batch_size(self) -> float:
        return self.num_examples * self.sample_rate

    def sample(self) -> torch.Tensor:
        """Draw the next step's indices (sorted LongTensor) and advance the position."""
        if self.position >= self.steps:
            raise RuntimeError(
                f"PoissonSampler is exhausted: all {self.steps} steps were drawn (position={self.position})."
            )
        u = torch.rand(self.num_examples, generator=self.generator, dtype=torch.float64)
        self.position += 1
        return torch.nonzero(u < _grid_rate(self.sample_rate), as_tuple=False).reshape(-1)

    def __iter__(self) -> Iterator[torch.Tensor]:
        while self.position < self.steps:
            yield self.sample()

    def iter_physical(self, max_batch_size: int) -> Iterator[List[PhysicalBatch]]:
        """Like iteration, but yields each step's list of fixed-shape physical batches."""
        max_batch_size = _check_int(max_batch_size, "max_batch_size", 1)
        for indices in self:
            yield to_physical_batches(indices, max_batch_size)

    def state_dict(self) -> Dict[str, Any]:
        """Position and generator state (restore with :meth:`load_state_dict`). The generator state
        recomputes every batch (it holds the seed), so it is as secret as a seed: an exhausted
        sampler's state leaves it out (None; review, round 34), having no draw left."""
        return {
            "num_examples": self.num_examples,
            "sample_rate": self.sample_rate,
            "steps": self.steps,
            "position": self.position,
            "generator_state": None if self.position >= self.steps else self.generator.get_state(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict`; the next draws are identical."""
        for key in ("num_examples", "sample_rate", "steps"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"state_dict was saved with {key}={state[key]!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}; build the sampler with the same settings."
                )
        position = _check_int(state["position"], "position", 0)
        if position > self.steps:
            raise ValueError(f"position {position} exceeds steps={self.steps}.")
        gen_state = state.get("generator_state")
        if gen_state is None:  # (an exhausted sampler's state: nothing left to draw)
            if position < self.steps:
                raise ValueError(f"the state has no generator state but {self.steps - position} step(s) left to draw")
            self.position = position
            return
        if not isinstance(gen_state, torch.Tensor):
            gen_state = torch.as_tensor(gen_state, dtype=torch.uint8)
        self.generator.set_state(gen_state.to(dtype=torch.uint8, device="cpu"))
        self.position = position

    def __repr__(self) -> str:
        return (
            f"PoissonSampler(num_examples={self.num_examples}, sample_rate={self.sample_rate:g}, "
            f"steps={self.steps}, position={self.position})"
        )


def to_physical_batches(indices: torch.Tensor, max_batch_size: int) -> List[PhysicalBatch]:
    """Split one logical batch into fixed-shape physical batches with padding masks.

    Returns ``max(1, ceil(len(indices) / max_batch_size))`` batches; every index
    appears exactly once, in order; padding rows have index 0 and mask False.
    """
    max_batch_size = _check_int(max_batch_size, "max_batch_size", 1)
    if not isinstance(indices, torch.Tensor):
        indices = torch.as_tensor(indices)
    if indices.dim() != 1:
        raise ValueError(f"indices must be a 1-D tensor, got shape {tuple(indices.shape)}.")
    if indices.is_floating_point() or indices.dtype == torch.bool:
        raise TypeError(f"indices must be an integer tensor, got dtype {indices.dtype}.")
    indices = indices.to(torch.long)
    k = int(indices.numel())
    num = max(1, -(-k // max_batch_size))
    padded = torch.zeros(num * max_batch_size, dtype=torch.long, device=indices.device)
    padded[:k] = indices
    mask = torch.zeros(num * max_batch_size, dtype=torch.bool, device=indices.device)
    mask[:k] = True
    return [
        PhysicalBatch(idx, m)
        for idx, m in zip(padded.view(num, max_batch_size), mask.view(num, max_batch_size))
    ]


def collate(
    dataset_tensors: Dict[str, torch.Tensor], physical_batch: PhysicalBatch
) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
    """Gather rows ``physical_batch.indices`` of each tensor (leading dim N).

    Returns ``(batch, mask)``: ``batch[k]`` has shape ``[max_batch_size, ...]``
    (padding rows are copies of row 0 — valid data that must be ignored via
    ``mask``), and ``mask`` is on the device of the first tensor.
    """
    if not isinstance(dataset_tensors, dict) or not dataset_tensors:
        raise ValueError("dataset_tensors must be a non-empty dict of tensors with a common leading dim N.")
    sizes = {k: int(v.shape[0]) for k, v in dataset_tensors.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if len(sizes) != len(dataset_tensors):
        bad = [k for k in dataset_tensors if k not in sizes]
        raise TypeError(f"dataset_tensors values must be tensors with a leading dim; bad keys: {bad}.")
    if len(set(sizes.values())) != 1:
        raise ValueError(f"all tensors must share the leading dim N, got {sizes}.")
    n = next(iter(sizes.values()))
    idx, mask = physical_batch
    if idx.numel() and int(idx.max()) >= n:
        raise IndexError(f"physical batch index {int(idx.max())} out of range for N={n}.")
    batch = {k: v.index_select(0, idx.to(v.device)) for k, v in dataset_tensors.items()}
    first = next(iter(dataset_tensors.values()))
    return batch, mask.to(first.device)
