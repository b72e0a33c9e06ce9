"""``make_dp_step``: the one module that wires the pillars together.

engine (vmap per-example grads, or book-keeping) -> clipping weights -> clipped sum ->
Gaussian noise -> divide by the expected batch size.
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
import math
import numbers
import os
import secrets
import threading
from typing import Any, Dict, Iterator, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from ._types import Batch, LossFn, Params, StepOutput
from ._warn import warn
from .clipping import MIN_THRESHOLD, Clipping, as_spec, make_groups, make_weights_fn, sum_sq_norms
from .functional import (BATCH_EDITS, LossModule, ParamIndex, _spectral_norms, advance_spectral_norms,
                         check_no_batch_mixing, model_constants, model_settings, model_structure, no_rope_mixing,
                         no_writes_to, spectral_norms_held, trainable_params)
from .fused import CPU_RNGS, RNGS, TORCH_CPU_WARNING, noise_and_scale, resolve_rng
from .noise import entropy_generator
from .per_sample import acc_dtype, batch_chunks, batch_size, vmap_engine

__all__ = ["make_dp_step", "DPStep", "ClippedSum", "StepOutput"]

METHODS = ("vmap", "bk", "auto")


class ClippedSum(NamedTuple):
    """Noise-free partial result of one physical batch; add them up, then ``finalize`` once."""

    sums: Dict[str, Tensor]  # name -> Σ_i c_i g_i over the real examples
    per_sample_norms: Tensor  # (b,) unclipped norms over all trained params
    losses: Tensor  # (b,)
    kept: Tensor  # (b,) bool: real and finite
    clipped: Tensor  # (b,) bool: clip factor < 1 on some group
    mask: Tensor  # (b,) bool: real examples
    routes: Dict[str, str]
    clipping: Optional[Tuple[Any, ...]] = None  # the clipping it was made with (``DPStep.clipping_key``)
    # which ``clipped_sum`` calls it holds (one id each: a part added twice is refused), and the
    # parameters it was computed at (name -> (storage, version counter): a part from before an
    # optimizer step and one from after are refused)
    ids: Tuple[int, ...] = ()
    at: Optional[Mapping[str, Tuple[int, int]]] = None

    def __add__(self, other: "ClippedSum") -> "ClippedSum":  # type: ignore[override]
        if not isinstance(other, ClippedSum):
            return NotImplemented
        if self.sums.keys() != other.sums.keys():
            raise ValueError("cannot add clipped sums of different parameter sets")
        if self.clipping != other.clipping:
            raise ValueError(f"cannot add clipped sums clipped by another step's clipping ({self.clipping} and "
                             f"{other.clipping}): their sum's sensitivity is neither's")
        # (review, round 39: p + p counted each example twice in a sum noised for one, and parts computed
        # before and after an optimizer step were added into one step)
        if set(self.ids) & set(other.ids):
            raise ValueError("a physical batch's ClippedSum is added twice: its examples would count twice in a "
                             "sum whose noise covers one contribution each. Add each clipped_sum result once")
        if self.at is not None and other.at is not None:
            moved = [n for n, (ptr, ver) in self.at.items() if n in other.at and other.at[n][0] == ptr
                     and other.at[n][1] != ver]
            if moved:
                raise ValueError(f"cannot add clipped sums computed at different parameter values ({moved[0]} was "
                                 "modified in place between them, e.g. by an optimizer step): accumulate the "
                                 "physical batches of one step, then finalize, then step the optimizer")
        return ClippedSum(
            {n: self.sums[n] + other.sums[n] for n in self.sums},
            torch.cat([self.per_sample_norms, other.per_sample_norms]),
            torch.cat([self.losses, other.losses]),
            torch.cat([self.kept, other.kept]),
            torch.cat([self.clipped, other.clipped]),
            torch.cat([self.mask, other.mask]),
            # (an empty batch's "skipped" does not hide the route another batch took)
            {**self.routes, **{n: r for n, r in other.routes.items() if r != "skipped" or n not in self.routes}},
            self.clipping,
            self.ids + other.ids,
            self.at if self.at is not None else other.at,
        )

    def __radd__(self, other: Any) -> "ClippedSum":
        """``0 + part``, so ``sum(parts)`` works (its start value is 0); anything else is not a part."""
        if isinstance(other, int) and not isinstance(other, bool) and other == 0:
            return self
        return NotImplemented


def _check_loss_signature(loss_fn: Any) -> None:
    """A clear error now for a loss_fn that cannot be called as ``loss_fn(model, batch)`` (review of
    round 40: ``loss_fn(batch)`` / ``loss_fn(model, x, y)`` failed at the first step with Python's bare
    'takes 1 positional argument but 2 were given', from inside torch.func)."""
    # (round 43, a user's walkthrough: Opacus's habits gave torch's and Python's bare errors)
    if isinstance(loss_fn, torch.optim.Optimizer):
        raise TypeError("loss_fn is a torch.optim optimizer: make_dp_step(model, loss_fn, *, max_grad_norm=..., "
                        "noise_multiplier=..., ...) wraps no optimizer or data loader (unlike Opacus's make_private). "
                        "Pass a loss function loss_fn(model, batch) -> Tensor[B], then set p.grad = out.grads[name] "
                        "and call your optimizer's step() yourself")
    if isinstance(loss_fn, nn.modules.loss._Loss) and type(loss_fn).__module__.startswith("torch."):  # (torch's own)
        raise TypeError(f"loss_fn is a torch loss module ({type(loss_fn).__name__}), called as loss(input, target); "
                        "pdpsgd calls loss_fn(model, batch) and needs one loss per example, e.g. def loss_fn(model, "
                        "b): return F.cross_entropy(model(b['x']), b['y'], reduction='none')")
    try:
        # (not followed into a functools.wraps wrapper's function: the wrapper is what is called, and a
        # decorator that fills in arguments takes fewer than its function; review of round 40)
        sig = inspect.signature(loss_fn, follow_wrapped=False)
    except (TypeError, ValueError):  # (a builtin or C callable without a signature: tried at the step)
        return
    try:
        sig.bind(None, None)
    except TypeError as e:
        name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
        raise TypeError(f"loss_fn is called as loss_fn(model, batch) -> Tensor[B] (one loss per example), but "
                        f"{name}{sig} cannot be called so ({e}). Take the batch as one argument (a tensor, "
                        "tuple or dict) and unpack it inside, e.g. lambda model, b: F.cross_entropy(model(b[0]), "
                        "b[1], reduction='none')") from None


# Part ids: one per clipped_sum result, (this process's token << 40) + a count; the token is random,
# drawn again in a forked child, so parts made in other processes (workers whose parts the main process
# adds up) do not collide with this one's (round 46: every process counted 1, 2, ...). Finalized ids (a
# second finalize is refused) as bit (id mod 2^40) of a bit set per token: one bit per part ever made,
# 125 kB a million (round 46: before, the last 4096 ids only). A forked child keeps its parent's bit
# sets (a part finalized there is refused here too). Ids no process made (negative) go in a set.
_PART_IDS = itertools.count(1)
_PART_BITS = 40
_FINALIZED: Dict[int, bytearray] = {}  # token -> bit set
_FINALIZED_ODD: set = set()  # ids no process made (negative, or far past the counts seen for their token)


def _new_part_token() -> None:
    global _PART_TOKEN, _FINALIZED_LOCK
    _PART_TOKEN = secrets.randbits(62) | 1
    _FINALIZED_LOCK = threading.Lock()  # (a forked child: a lock held by another thread at the fork stays held)


_new_part_token()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_part_token)


def _next_part_id() -> int:
    return (_PART_TOKEN << _PART_BITS) + next(_PART_IDS) % (1 << _PART_BITS)


def _finalized(i: int) -> bool:
    if i in _FINALIZED_ODD:
        return True
    bits, k = _FINALIZED.get(i >> _PART_BITS), i & ((1 << _PART_BITS) - 1)
    return i >= 0 and bits is not None and (k >> 3) < len(bits) and bool(bits[k >> 3] >> (k & 7) & 1)


def _mark_finalized(i: int, on: bool) -> None:
    bits, k = _FINALIZED.get(i >> _PART_BITS, bytearray()), i & ((1 << _PART_BITS) - 1)
    if not on:
        _FINALIZED_ODD.discard(i)
        if i >= 0 and (k >> 3) < len(bits):
            bits[k >> 3] &= ~(1 << (k & 7)) & 0xFF
        return
    if i < 0 or (k >> 3) >= len(bits) + (1 << 20):  # (no count jumps so far at once: a made-up id, in the set)
        _FINALIZED_ODD.add(i)
        return
    if (k >> 3) >= len(bits):
        bits.extend(bytes((k >> 3) + 1 - len(bits)))
    _FINALIZED.setdefault(i >> _PART_BITS, bits)
    bits[k >> 3] |= 1 << (k & 7)


def _param_stamp(params: Mapping[str, Tensor]) -> Dict[str, Tuple[int, int]]:
    """name -> (storage address, in-place version counter): what changes when an optimizer steps
    (an inference tensor has no version counter: left out)."""
    out: Dict[str, Tuple[int, int]] = {}
    for n, p in params.items():
        try:
            out[n] = (p.data_ptr(), p._version)
        except RuntimeError:
            pass
    return out


_STANCE_LOCK = threading.Lock()
_STANCE: Dict[str, Any] = {"depth": 0, "set": None}  # steps running now (any thread); the stance they set


@contextlib.contextmanager
def _eager_stance() -> Iterator[None]:
    """``torch.compiler.set_stance("force_eager")`` (torch ≥ 2.6) while any step runs, else nothing.
    The stance is one for the process: set by the first step to enter, restored (to what it was
    before) by the last to leave, so steps that overlap in several threads cannot leave it set
    (each saving and restoring its own, they would: A saves "default", B saves A's "force_eager",
    A restores "default", B restores "force_eager" for good)."""
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:
        yield
        return
    with _STANCE_LOCK:
        if _STANCE["depth"] == 0:
            _STANCE["set"] = set_stance("force_eager")  # set now; its __exit__ restores the stance before
        _STANCE["depth"] += 1
    try:
        yield
    finally:
        with _STANCE_LOCK:
            _STANCE["depth"] -= 1
            if _STANCE["depth"] == 0:
                done, _STANCE["set"] = _STANCE["set"], None
                done.__exit__(None, None, None)


def _run_eagerly(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with gradients on (also under a caller's no_grad), not traced by dynamo
    (``torch.compiler.disable``: a step called inside the user's own compiled function is a graph
    break there, run as it is), and with code compiled by ``torch.compile`` (a compiled model, or a
    compiled function in ``loss_fn``) running as the eager code it wraps (``_eager_stance``): the
    engine wraps the layers' forwards and hooks their outputs, which dynamo would trace, guard on and
    recompile for every layer (minutes of compiling, then eager anyway at its recompile limit). The
    results are the eager model's either way. The stance is process-wide while ``fn`` runs (torch's):
    compiled code that another thread runs meanwhile runs eagerly too."""
    def run():
        with torch.enable_grad(), _eager_stance():
            return fn(*args, **kwargs)

    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(run)() if disable is not None else run()


def _is_compiled(model: nn.Module) -> bool:
    """Whether the model or one of its modules is compiled (``torch.compile(module)``, an
    OptimizedModule, or ``module.compile()`` in place)."""
    eval_frame = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    cls = getattr(eval_frame, "OptimizedModule", None)
    return any((cls is not None and isinstance(m, cls)) or getattr(m, "_compiled_call_impl", None) is not None
               for m in model.modules())


class _BatchEdits:
    """In-place edits of the batch's tensors during a book-keeping step (``x /= 255`` in the forward): the step runs
    the forward more than once (its checks, the exact fallback; six times on a batch shape's first step), so an edit
    that changes values again at each forward is applied again each time and the step trains on other data (round
    49: the batch divided by 255⁶, and the example-order check blamed mixing). Watched on the first step of a batch
    signature (the tensors copied first; ``functional.BATCH_EDITS`` tells it after each forward): where the batch
    after the step is not as the first forward that edited it left it, the edits are undone and refused with an
    error; an edit that a second forward repeats to the same values (a padding label set to -100) is fine, as in
    an ordinary training loop. Later steps: nothing read."""

    def __init__(self, batch: Batch, seen: set):
        self.leaves = [x for x in tree_flatten(batch)[0] if isinstance(x, Tensor)]
        sig = tuple((tuple(x.shape), x.dtype, x.device) for x in self.leaves)
        self.copies = self.first = self.token = None
        if sig not in seen:
            seen.add(sig)
            self.versions = [x._version for x in self.leaves]
            self.copies = [x.detach().clone() for x in self.leaves]
            self.token = BATCH_EDITS.set(self)

    def after_forward(self) -> None:
        if self.first is None and any(x._version != v for x, v in zip(self.leaves, self.versions)):
            self.first = [x.detach().clone() for x in self.leaves]  # (as the first forward that edited it left it)

    def check(self) -> None:
        if self.token is None:
            return
        BATCH_EDITS.reset(self.token)
        self.token = None
        if self.first is None or all(_same_values(x, f) for x, f in zip(self.leaves, self.first)):
            return
        i = next(i for i, (x, f) in enumerate(zip(self.leaves, self.first)) if not _same_values(x, f))
        with torch.no_grad():
            for y, c in zip(self.leaves, self.copies):
                y.copy_(c)
        raise ValueError(
            f"the model (or loss_fn) edited tensor {i} of the batch (shape {tuple(self.leaves[i].shape)}) in place, "
            "to other values at each forward (x /= 255, x.clamp_(...) after a shift, x += noise): book-keeping runs "
            "the forward more than once a step (its checks, the exact fallback), so the edit was applied again each "
            "time. The batch is put back as it was passed. Edit a copy inside the forward (x = x / 255), or edit the "
            "batch before the step.")


def _same_values(a: Tensor, b: Tensor) -> bool:
    """Bitwise the same (NaN where the other has NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        na, nb = torch.isnan(a), torch.isnan(b)
        return bool(torch.equal(na, nb)) and bool(torch.equal(a.masked_fill(na, 0), b.masked_fill(nb, 0)))
    return bool(torch.equal(a, b))


@contextlib.contextmanager
def _guards(model: nn.Module, trained: Mapping[str, Tensor], seen: Optional[dict] = None,
            spectral: Optional[list] = None):
    """What runs around every forward of a step on a batch: no write to the model
    (``no_writes_to``), no rotary table chosen by one example for the others (``no_rope_mixing``;
    ``seen``: the step's record of the tables taken with shared positions), spectral normalisation's
    power iteration held (``spectral_norms_held``: it advances once per step, in ``finalize``)."""
    with no_writes_to(model, trained), no_rope_mixing(model, seen=seen), spectral_norms_held(model, spectral):
        yield


def _check_grad_mode(params: Mapping[str, Tensor], batch: Batch, *, tensors: bool = True) -> None:
    """The step computes gradients: refuse inference mode and (``tensors``: book-keeping, whose
    capture records them with autograd) inference tensors, with what to do; a caller's no_grad is
    fine (the step turns grad mode on)."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError("the DP step computes gradients: call it outside torch.inference_mode() "
                           "(under torch.no_grad() it runs: it turns grad mode on for itself)")
    if not tensors:
        return
    leaves, _ = tree_flatten(batch)
    bad = [n for n, p in params.items() if p.is_inference()][:3]
    if bad or any(isinstance(x, Tensor) and x.is_inference() for x in leaves):
        what = f"parameter(s) {bad}" if bad else "a batch tensor"
        raise RuntimeError(f"{what} {'were' if bad else 'was'} created under torch.inference_mode(), and autograd cannot use "
                           "inference tensors: create them outside it, or pass a .clone() made outside it")


def _is_bool(v: Any) -> bool:
    """A Python, NumPy or torch bool (which ``float()`` would read as 0 or 1)."""
    return isinstance(v, bool) or getattr(v, "dtype", None) is torch.bool or (
        type(v).__module__ == "numpy" and type(v).__name__ in ("bool_", "bool"))


def _real(name: str, v: Any) -> float:
    """A real number option as a float: a Python or NumPy number, or a one-element tensor; not a bool
    (mutation review, round 44: ``noise_multiplier=False`` was read as σ = 0, a step without noise)."""
    if _is_bool(v):
        raise TypeError(f"{name} must be a real number, got the bool {v!r}")
    if isinstance(v, Tensor) and v.numel() == 1 and not v.is_complex():
        return float(v)
    if isinstance(v, numbers.Real):
        return float(v)
    raise TypeError(f"{name} must be a real number, got {type(v).__module__}.{type(v).__name__}")


def _budget_key(budget: Any) -> Any:
    """A clip budget as it shares C: relative weights (w / max w), None for equal ones (the default)."""
    if budget is None:
        return None
    try:
        w = [float(x) for x in budget]
        top = max(w)
        rel = tuple(x / top for x in w)
    except (TypeError, ValueError, ZeroDivisionError):
        return ("unchecked", repr(budget))
    return None if all(x == 1.0 for x in rel) else rel


# no Gaussian sampler here draws |z| beyond this (a float64 uniform's smallest value, 2^-1074, gives
# sqrt(2·744.4) = 38.6 in Box-Muller)
_Z_MAX = 40.0


def _check_noise_range(sums: Mapping[str, Tensor], std: float, denom: float) -> None:
    """A noise std whose draws could pass the largest value of the dtype the noise is drawn in (the
    sums' accumulation dtype; drawn at σC / divisor, ``noise_and_scale``): an error, not ±inf noise handed
    to the optimizer (round 46: σC = 1e38 in float32 was accepted)."""
    for n, s in sums.items():
        if s.is_floating_point() and std / denom * _Z_MAX > torch.finfo(s.dtype).max:
            raise OverflowError(
                f"the noise std σ·C / divisor = {std:.4g} / {denom:g} is too large for {s.dtype} (the mean gradient of "
                f"{n!r} and its noise are kept in it; draws up to {_Z_MAX:g} std would pass its largest value "
                f"{torch.finfo(s.dtype).max:.4g}): scale the loss and max_grad_norm down together, or train in float64")


def _check_narrow_overflow(grads: Mapping[str, Tensor], zstd: float) -> None:
    """A float16 gradient that the cast of its float32 (noisy, scaled) value overflowed: an error,
    not ±inf handed to the optimizer (review, round 38: fp16 loss scaling with C scaled alike, σC/E[B]
    ~ 1e4, gave inf in 9 of 27 coordinates, silently). The sums are finite (non-finite examples are
    dropped), so a non-finite float16 gradient is the cast's. One check for all (one device sync)."""
    narrow = [n for n, g in grads.items() if g.dtype == torch.float16]
    if not narrow:
        return
    bad = torch.stack([~torch.isfinite(grads[n]).all() for n in narrow])
    if not bool(bad.any()):
        return
    first = narrow[int(bad.nonzero()[0, 0])]
    big = float(torch.finfo(torch.float16).max)
    raise OverflowError(
        f"the step's gradient of float16 parameter {first!r} overflows float16 (|g| > {big:g}) when cast from "
        f"the float32 noisy mean (noise std per coordinate σC/divisor = {zstd:.4g}): scale the loss and "
        "max_grad_norm down together, or pass float32 copies of the parameters as params= with float32 inputs "
        "(the step then runs, and returns its gradients, in float32)")


class DPStep:
    """A DP-SGD step for one model and loss: ``dp_step(params, batch, mask=None) -> StepOutput``.

    ``grads[n] = (Σ_i c_i g_i[n] + N(0, σ²C² I)) / expected_batch_size`` where g_i is example i's
    gradient (summed over every use of a tied parameter) and c_i its clip factor.

    Formal guarantee: the clipped sum Σ_i c_i g_i has L2 sensitivity ``sensitivity`` = C under
    adding/removing one example (padding and non-finite examples contribute exactly 0); the step
    adds N(0, ``noise_std``²) with noise_std = σC to every coordinate once, so each call is the
    Gaussian mechanism with noise multiplier σ. With Poisson sampling at rate q (see
    ``pdpsgd.PoissonSampler``), T calls compose to the (ε, δ) the accountant reports for (σ, q, T).
    Outputs other than ``grads`` (loss, norms, clip fraction, counts) are NOT privatised: use them
    for monitoring, do not release them.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        *,
        max_grad_norm: float,
        noise_multiplier: float,
        expected_batch_size: Optional[float] = None,
        method: str = "vmap",
        chunk_size: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
        clipping: Clipping = "flat",
        clip_budget: Optional[Sequence[float]] = None,
        clip_fn: str = "abadi",
        gamma: float = 0.01,
        on_nonfinite: str = "drop",
        bk_options: Optional[Mapping[str, Any]] = None,
        fused: Optional[bool] = None,
        noise_rng: str = "auto",
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        _check_loss_signature(loss_fn)  # (first: it names an optimizer passed as loss_fn)
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable: loss_fn(model, batch) -> Tensor[B]")
        max_grad_norm = _real("max_grad_norm", max_grad_norm)
        noise_multiplier = _real("noise_multiplier", noise_multiplier)
        if not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 (the clipping bound C), got {max_grad_norm}")
        if max_grad_norm < MIN_THRESHOLD:
            raise ValueError(
                f"max_grad_norm={max_grad_norm:g} is below {MIN_THRESHOLD:g}: per-example squared norms are "
                "sums of squares in float32, which underflow near there, so an example's norm could be "
                "under-stated and escape its clip; scale the loss up (and C with it) instead")
        if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
            raise ValueError(f"noise_multiplier must be a finite number ≥ 0 (σ), got {noise_multiplier}")
        if math.isinf(max_grad_norm) and noise_multiplier > 0:
            raise ValueError("max_grad_norm=inf (no clipping) has unbounded sensitivity; use noise_multiplier=0 for it")
        if noise_multiplier > 0 and not math.isfinite(noise_multiplier * max_grad_norm):
            raise ValueError(f"the noise std σ·C = {noise_multiplier:g}·{max_grad_norm:g} overflows float64; scale the "
                             "loss down (and C with it)")
        if expected_batch_size is not None:
            expected_batch_size = _real("expected_batch_size", expected_batch_size)
            if not (expected_batch_size > 0 and math.isfinite(expected_batch_size)):
                raise ValueError(f"expected_batch_size must be a finite number > 0 (q·N), got {expected_batch_size}")
        if method not in METHODS:
            raise ValueError(f"method={method!r} is unknown: use one of {METHODS}")
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral)
                                       or chunk_size <= 0):
            raise ValueError(f"chunk_size must be a positive int (examples per vmap chunk), got {chunk_size!r}")
        chunk_size = int(chunk_size) if chunk_size is not None else None
        if on_nonfinite not in ("drop", "raise"):
            raise ValueError(f"on_nonfinite={on_nonfinite!r}: use 'drop' (default) or 'raise'")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError("generator must be a torch.Generator (or None for OS entropy)")
        if noise_rng not in RNGS:
            raise ValueError(f"noise_rng={noise_rng!r} is unknown: use one of {RNGS}")
        if noise_rng in ("mkl", "native") and float(noise_multiplier) > 0:  # (σ = 0 draws nothing: no library needed)
            if noise_rng == "mkl":
                from . import mkl_rng as lib

                warn("noise_rng='mkl': oneMKL's Gaussian takes 32-bit uniforms, so its tails end at 6.66σ; an "
                     "output beyond one dataset's reach but within a neighbour's tells them apart, a δ of up to "
                     "~φ(6.66)·√d/σ ≈ 9e-11·√d/σ per step that the accountant does not count (d: trained "
                     "coordinates); and its Philox key is 64 bits per step (a search of 2^64 keys against a "
                     "released update finds that step's noise). noise_rng='native' (the CPU default) reaches "
                     "9.42σ with 128-bit keys (review, rounds 33 and 37)")
            else:
                from . import native_rng as lib
            lib.require()  # a clear error now (and the native build done), not at the first step
        elif noise_rng == "auto" and float(noise_multiplier) > 0 and (generator is None or generator.device.type == "cpu"):
            from . import native_rng

            if not native_rng.available():  # build (or find) the kernel now, not inside the first step's timing
                why = native_rng._ERR[1] if native_rng._ERR else "it did not build"
                warn(f"noise_rng='auto': pdpsgd's native noise kernel is not available ({why.splitlines()[0][:200]}), "
                     "so the noise is drawn from numpy's Philox, keyed per step as the kernel is (float64 normals: "
                     "the same distribution, another stream, ~5x the kernel's time on the CPU); a C compiler "
                     "($CC or cc) enables it")
        if noise_rng in CPU_RNGS and generator is not None and generator.device.type != "cpu":
            raise ValueError(f"noise_rng={noise_rng!r} draws on the CPU: pass a CPU torch.Generator (its draws key "
                             "the stream), or use noise_rng='torch'")
        if noise_rng == "torch" and float(noise_multiplier) > 0:
            gdev = generator.device if generator is not None else next(
                (p.device for p in model.parameters()), torch.device("cpu"))
            if gdev.type == "cpu":
                warn(TORCH_CPU_WARNING)
        check_no_batch_mixing(model)
        if _is_compiled(model):
            warn(
                "the model is torch.compile'd: the DP step runs its forward and backward eagerly (the engine "
                "captures each layer's input and output gradient, which compiled code would not expose), so "
                "compiling the model speeds up only what runs outside the step. Pass the uncompiled model to "
                "silence this; the step's noise can be compiled with fused=True.")
        self.model = model
        self.loss_fn = loss_fn
        self.max_grad_norm = float(max_grad_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.expected_batch_size = expected_batch_size
        self._first_divisor: Optional[int] = None  # (without expected_batch_size: the first batch's size)
        self._divisor_warned = False
        self._padding_warned = False
        self._zero_checked = False  # (the first batch with a real example: are all its gradients 0?)
        self.method = method
        self.chunk_size = chunk_size
        # book-keeping's batch-dimension probe, per batch shape signature (a function of the model's
        # code and the shapes; see bookkeeping.PROBE_B)
        self._probe_memo: dict = {}
        self._rope_seen: dict = {}  # (no_rope_mixing: tables taken with shared positions, for its warning)
        self._edits_seen: set = set()  # (batch signatures whose first step looked for in-place edits: ``_BatchEdits``)
        self.generator = generator
        self.clipping = as_spec(clipping)  # (read once: a generator is not used up by the first step; round 38)
        if clip_budget is not None and not isinstance(clip_budget, (str, bytes, Mapping)):
            try:
                clip_budget = list(clip_budget)  # (read once, as the groups)
            except TypeError:
                pass  # (make_groups names the problem)
        self.clip_budget = clip_budget
        self.clip_fn = clip_fn
        if clip_fn == "automatic":
            if _is_bool(gamma):
                # (review, round 39: True was read as γ = 1)
                raise ValueError(f"gamma must be a number (γ of automatic clipping), got {gamma!r}")
            gamma = _real("gamma", gamma)
        self.gamma = gamma
        self.on_nonfinite = on_nonfinite
        self.bk_options = dict(bk_options or {})
        self.fused = fused
        self.noise_rng = noise_rng
        self._index = ParamIndex(model)
        self._structure = model_structure(model)
        self._settings = model_settings(model)  # (as the last step ended: ``_resolve``)
        self._spectral = _spectral_norms(model)  # (per model structure: no walk per step)
        self._loss_module = LossModule(model, loss_fn)
        if clip_fn not in ("abadi", "automatic"):
            raise ValueError(f"clip_fn={clip_fn!r} is unknown: use 'abadi' or 'automatic'")
        if clip_fn == "automatic" and math.isinf(self.max_grad_norm):
            raise ValueError("clip_fn='automatic' scales each gradient by C/(‖g‖+γ), which is inf for "
                             "max_grad_norm=inf: give a finite C (automatic clipping always rescales), or use "
                             "clip_fn='abadi' for no clipping")
        # the spec checked now against the model's parameters (names, repeats, budget, γ), not at the first
        # step; that every trained parameter is in a group is checked per step, against the params passed
        canon = self._index.canonical_clipping(self.clipping)
        checked = make_groups(list(self._index.params), canon, self.max_grad_norm, budget=None if isinstance(
            canon, str) else self.clip_budget, complete=False)
        if canon in ("flat", "per_layer") and self.clip_budget is not None:
            # (review, round 39: checked only at the first step) "flat": one weight; "per_layer": one per
            # tensor the step is given, known then; its weights are checked now
            try:
                k = 1 if canon == "flat" else len(self.clip_budget)
            except TypeError:
                k = len(self._index.params)
            make_groups([f"#{i}" for i in range(k)], canon, self.max_grad_norm, budget=self.clip_budget)
        make_weights_fn(checked, clip_fn=clip_fn, gamma=self.gamma)
        # (the clipping as it bounds the sensitivity: groups in order, each a set of canonical names; a dict's
        # labels, an alias's spelling and the order within a group do not change it)
        self._clipping_key = canon if isinstance(canon, str) else tuple(tuple(sorted(g)) for g in canon)

    # -- self-description -------------------------------------------------------------------
    @property
    def clipping_key(self) -> Tuple[Any, ...]:
        """What the clipped sums' sensitivity rests on (C, clip function, γ, groups, budget); a
        ``ClippedSum`` carries its step's and ``finalize`` checks it."""
        return (self.max_grad_norm, self.clip_fn, self.gamma if self.clip_fn == "automatic" else None,
                self._clipping_key, _budget_key(self.clip_budget))

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the clipped sum under add/remove of one example (= C)."""
        return self.max_grad_norm

    @property
    def noise_std(self) -> float:
        """Std of the Gaussian noise added to each coordinate of the clipped sum (= σC)."""
        return 0.0 if self.noise_multiplier == 0 else self.noise_multiplier * self.max_grad_norm

    def __repr__(self) -> str:
        return (
            f"DPStep(method={self.method!r}, max_grad_norm={self.max_grad_norm}, noise_multiplier="
            f"{self.noise_multiplier}, clipping={self.clipping!r}, clip_fn={self.clip_fn!r})"
        )

    def _generator_device(self, device: torch.device) -> torch.device:
        """Where the noise generator is (or will be made) for parameters on ``device``: the CPU noise
        sources ("mkl", "native", "numpy") are keyed from a CPU generator."""
        if self.generator is not None:
            return self.generator.device
        on_cpu = device.type == "cpu" or self.noise_rng in CPU_RNGS
        return torch.device("cpu") if on_cpu else device

    def _generator(self, device: torch.device) -> torch.Generator:
        if self.generator is None:
            self.generator = entropy_generator(self._generator_device(device))
        return self.generator

    def noise_source(self, device: Any = "cpu", dtype: torch.dtype = torch.float32) -> str:
        """The Gaussian source this step draws its noise from for parameters on ``device`` with
        noise in ``dtype`` (float32 for float32 / bf16 / fp16 models): ``noise_rng`` with "auto"
        resolved ("native" or "numpy" on the CPU, "torch" off it; see ``make_dp_step``)."""
        return resolve_rng(self.noise_rng, self._generator_device(torch.device(device)), dtype)

    def plan(self, batch: Batch, params: Optional[Mapping[str, Tensor]] = None) -> Dict[str, str]:
        """Which route each trained parameter takes for this batch's shapes (a pure function of
        them; for method="auto" on the CPU they include each example's non-padded rows; see
        ``pdpsgd.bookkeeping.plan``), with what this step's checks have found so far (a verdict
        memoised by an earlier step; the step's memo is read, not written). With ``chunk_size``,
        per chunk as the step runs them: a parameter whose chunks differ is "mixed"."""
        params = self._resolve(params if params is not None else trainable_params(self.model))
        if self.method == "vmap":
            return {n: "vmap" for n in params}
        from .bookkeeping import plan as bk_plan

        _check_grad_mode(params, batch)
        routes: Dict[str, str] = {}
        with self._guarded(params):
            for sub in self._chunks(batch):
                r = _run_eagerly(bk_plan, self.model, self.loss_fn, params, sub, method=self.method,
                                 clip_groups=self._clip_groups(params), probe_memo=dict(self._probe_memo),
                                 **self.bk_options)
                for n, v in r.items():
                    routes[n] = v if routes.get(n, v) == v else "mixed"
        return routes

    def _resolve(self, params: Mapping[str, Tensor]):
        """``params`` keyed by canonical names, checked against the model as it is now. A model whose
        modules changed since the step was built or last ran (a module added, replaced or given a
        hook; a weight tied or swapped for a new Parameter) gets a fresh parameter index, and the
        memos found for the old one (batch-dimension probe, example-order verdicts) are dropped, so
        its next batch is checked as a first one is; Parameters swapped for new ones of the same
        shapes, dtypes and tying (``load_state_dict(assign=True)``) keep the memos. (The rotary tables taken so far stay: they are
        what a later padded length is compared with, whatever hook was added.)"""
        now = model_structure(self.model)
        if now[0] != self._structure[0]:
            self._index = ParamIndex(self.model)
            self._spectral = _spectral_norms(self.model)
            if now[0][0] != self._structure[0][0]:  # not only new Parameter objects of the same layout
                self._probe_memo.clear()
            self._structure = now
        if self.method != "vmap":
            # the modules' plain attributes, changed since the last step ended (by the training loop: a
            # path the memos were not found on may be taken): checked again as a first batch is
            settings = model_settings(self.model)
            if settings != self._settings:
                self._probe_memo.clear()
                self._settings = settings
        out = self._index.resolve(params)
        for n, p in out.items():
            if p.is_complex():  # (review, round 33)
                raise TypeError(
                    f"parameter {n!r} is complex ({p.dtype}): DP-SGD here clips and noises real coordinates "
                    "(a complex per-example norm came out complex, the clipped sum exceeded C, and complex "
                    "Gaussian noise has σC/√2 per real part). Keep it as a real tensor (torch.view_as_real) "
                    "or freeze it (requires_grad=False)")
        return out

    def _guarded(self, params: Mapping[str, Tensor]):
        """What a step checks around running the forward on a batch (``plan`` and
        ``fallback_reasons`` run it too): no batch-mixing layer, no write to the model."""
        check_no_batch_mixing(self.model)
        return _guards(self.model, {n: p.detach() for n, p in params.items()}, self._rope_seen, self._spectral)

    def _chunks(self, batch: Batch):
        """The batch as the step splits it (``chunk_size`` examples per pass)."""
        B = batch_size(batch)
        for _, _, sub in batch_chunks(batch, B, self.chunk_size or B):
            yield sub

    def fallback_reasons(self, batch: Batch, params: Optional[Mapping[str, Tensor]] = None) -> Dict[str, str]:
        """{parameter name: why it takes the exact vmap fallback} for the parameters whose route in
        ``plan(batch)`` is "vmap" or, with ``chunk_size``, "mixed" (then the reason of the first
        chunk that takes it, marked so) (method="vmap": all of them)."""
        params = self._resolve(params if params is not None else trainable_params(self.model))
        if self.method == "vmap":
            return {n: "method='vmap'" for n in params}
        from .bookkeeping import fallback_reasons

        _check_grad_mode(params, batch)
        why: Dict[str, str] = {}
        chunks = list(self._chunks(batch))
        count: Dict[str, int] = {}
        with self._guarded(params):
            for sub in chunks:
                r = _run_eagerly(fallback_reasons, self.model, self.loss_fn, params, sub, method=self.method,
                                 clip_groups=self._clip_groups(params), probe_memo=dict(self._probe_memo),
                                 **self.bk_options)
                for n, v in r.items():
                    why.setdefault(n, v)
                    count[n] = count.get(n, 0) + 1
        return {n: (v if count[n] == len(chunks) else f"in {count[n]} of {len(chunks)} chunks: {v}")
                for n, v in why.items()}

    def _clip_groups(self, params: Mapping[str, Tensor]):
        return make_groups(self._index.in_model_order(params), self._index.canonical_clipping(self.clipping),
                           self.max_grad_norm, budget=self.clip_budget).names

    # -- the step ---------------------------------------------------------------------------
    def clipped_sum(self, params: Mapping[str, Tensor], batch: Batch, mask: Optional[Tensor] = None) -> ClippedSum:
        """The noise-free clipped sum of one physical batch (for logical-batch accumulation)."""
        return self._clipped(self._resolve(params), batch, mask)

    def _clipped(self, params: Params, batch: Batch, mask: Optional[Tensor]) -> ClippedSum:
        stamp = _param_stamp(params)  # (as the call begins)
        B = batch_size(batch)
        device = next(iter(params.values())).device
        if mask is None:
            mask = torch.ones(B, dtype=torch.bool, device=device)
        else:
            if not isinstance(mask, Tensor) or mask.shape != (B,) or mask.dtype != torch.bool:
                # (review, round 37: a float or index mask was cast to bool: [0.5, 2.0, 0.0] -> [T, T, F])
                raise ValueError(f"mask must be a bool tensor of shape [{B}] (the batch size), got "
                                 f"{getattr(mask, 'dtype', type(mask).__name__)} {getattr(mask, 'shape', mask)}")
            if self.expected_batch_size is None and self.noise_std > 0 and not self._padding_warned \
                    and mask.device.type == "cpu" and not bool(mask.all()):  # (a CPU mask: no device sync; round 37)
                self._padding_warned = True
                # (review, round 45: parts added into one sum are divided by all their rows, not this batch's B)
                warn(f"the batch has padding rows (mask False) and no expected_batch_size was given: the step "
                     f"divides by the number of rows it finalizes, padding rows included (this batch's {B}; parts "
                     "added into one sum: all of their rows); pass expected_batch_size (q·N under Poisson "
                     "sampling) to divide by a fixed number")
            mask = mask.to(device=device, dtype=torch.bool)
        check_no_batch_mixing(self.model)
        if B == 0:  # an empty (Poisson-sampled) batch: every sum is 0, the step is noise alone
            return self._empty_sum(params, device)
        detached = {n: p.detach() for n, p in params.items()}
        constants = model_constants(self.model, detached)
        groups = make_groups(self._index.in_model_order(detached), self._index.canonical_clipping(self.clipping),
                             self.max_grad_norm, budget=self.clip_budget)
        weights_fn = make_weights_fn(groups, clip_fn=self.clip_fn, gamma=self.gamma)
        _check_grad_mode(params, batch, tensors=self.method != "vmap")
        edits = _BatchEdits(batch, self._edits_seen) if self.method != "vmap" else None
        try:
            with _guards(self.model, detached, self._rope_seen, self._spectral):
                if self.method == "vmap":
                    res = _run_eagerly(vmap_engine, self._loss_module, detached, constants, batch, mask, weights_fn,
                                       chunk_size=self.chunk_size)
                else:
                    from .bookkeeping import bk_engine

                    res = _run_eagerly(
                        bk_engine, self._loss_module, detached, constants, batch, mask, weights_fn,
                        chunk_size=self.chunk_size, method=self.method, probe_memo=self._probe_memo,
                        **self.bk_options,
                    )
        finally:
            if self.method != "vmap":
                # as this step leaves them, once the guards put back what they hold during it (spectral
                # norms' power iterations, rotary tables; review of round 47: read inside, every step
                # dropped the memos): ``_resolve``
                self._settings = model_settings(self.model)
            if edits is not None:
                edits.check()  # (also where the engine raised: the watch is taken off)
        total_sq = sum_sq_norms(res.sq_norms)
        norms = total_sq.sqrt()
        kept = mask & torch.isfinite(total_sq) & torch.isfinite(res.losses)
        if self.on_nonfinite == "raise" and bool((mask & ~kept).any()):
            bad = torch.nonzero(mask & ~kept).flatten().tolist()
            fp16 = [n for n, p in detached.items() if p.dtype == torch.float16]
            raise FloatingPointError(
                f"examples {bad[:10]} have a non-finite loss or gradient (or a gradient whose squared norm "
                f"overflows {str(total_sq.dtype).replace('torch.', '')}: a norm above ~1.8e19 in float32); "
                + (f"the model has float16 parameters ({fp16[0]}, ...), whose gradients overflow to inf past "
                   "65504 (review, round 37): scale the loss down, or train in bfloat16 / float32; " if fp16 else "")
                + "fix the data/model, or use on_nonfinite='drop' to drop them from the step (they then contribute 0)"
            )
        if not self._zero_checked and bool(kept.any()):  # (one host read, on the first such batch only)
            self._zero_checked = True
            if not bool((norms[kept] != 0).any()):
                # (review of round 40: an in-batch contrastive loss trained nothing, silently, under every method)
                warn("every example's gradient is exactly 0 in this first batch (per-example norms all 0): the step "
                     "releases noise alone and trains nothing. Per-example gradients are each example's loss run "
                     "alone (method='vmap', and book-keeping where the model or loss mixes examples): a loss that "
                     "couples the batch's examples (in-batch negatives, a contrastive loss) has no gradient then. "
                     "Per-example DP-SGD needs one loss per example that depends on that example alone; also check "
                     "that the trained parameters reach the loss")
        clipped = torch.zeros_like(mask)
        for names, thr in zip(groups.names, groups.thresholds):
            sq = total_sq if len(groups.names) == 1 and len(names) == len(res.sq_norms) \
                else sum_sq_norms(res.sq_norms, names)
            if self.clip_fn == "abadi":
                clipped = clipped | (sq.sqrt() > thr)
            else:
                clipped = torch.ones_like(mask)
        return ClippedSum(res.clipped_sum, norms, res.losses, kept, clipped & kept, mask, res.routes, self.clipping_key,
                          (_next_part_id(),), stamp)

    def _empty_sum(self, params: Mapping[str, Tensor], device: torch.device) -> ClippedSum:
        sums = {n: torch.zeros(p.shape, dtype=acc_dtype(p.dtype), device=p.device) for n, p in params.items()}
        none = torch.zeros(0, dtype=torch.bool, device=device)
        empty = torch.zeros(0, device=device)
        return ClippedSum(sums, empty, empty, none, none, none, {n: "skipped" for n in params}, self.clipping_key,
                          (_next_part_id(),), _param_stamp(params))

    def _divisor_seen(self, size: int) -> None:
        """Without ``expected_batch_size`` the divisor is the batch's size: public for fixed-size
        batches, not for Poisson ones (the released gradient's scale then tells the size, which the
        accountant does not count). Warn once when the size changes between steps."""
        if self._first_divisor is None:
            self._first_divisor = size
        first = self._first_divisor
        if size != first and not self._divisor_warned:
            self._divisor_warned = True
            warn(f"expected_batch_size is not set and the batch size changed between steps ({first} -> {size}): "
                          "the step divides by each batch's own size, which its output then reveals; under Poisson "
                          "sampling that size is private and the accountant's ε does not cover it. Pass "
                          "expected_batch_size=q·N to make_dp_step (fixed-size batches: their size)")

    def finalize(self, partial: ClippedSum, *, params: Optional[Mapping[str, Tensor]] = None) -> StepOutput:
        """Add the noise once and scale: turns an (accumulated) ``ClippedSum`` into a step output
        (``partial`` is not modified)."""
        return self._finalize(partial, params, consume=False)

    def _finalize(self, partial: ClippedSum, params: Optional[Mapping[str, Tensor]], consume: bool) -> StepOutput:
        if partial.clipping != self.clipping_key:
            # (review, round 37: parts clipped at C = 10 were noised for this step's C = 0.1, silently)
            raise ValueError(f"this ClippedSum was clipped by another step ({partial.clipping}), not with this "
                             f"step's clipping ({self.clipping_key}): its noise, σ·C for this step's C, would not "
                             "match the sum's sensitivity. Finalize it with the step that made it")
        marked = not consume and bool(partial.ids)
        if marked:
            # (review, round 39: a part finalized twice is two noisy releases of one sum, which the
            # accountant counts as one step); by any step object of this process (review of round 39)
            with _FINALIZED_LOCK:
                if any(_finalized(i) for i in partial.ids):
                    raise ValueError("this ClippedSum (or a part of it) was finalized already: a second noisy "
                                     "release of the same clipped sum is a second step for the accountant. "
                                     "Compute the next step's clipped sums")
                for i in partial.ids:
                    _mark_finalized(i, True)
        try:
            return self._noised(partial, params, consume)
        except BaseException:
            if marked:  # (nothing was released: the part may be finalized again, e.g. by a step fixed
                with _FINALIZED_LOCK:  # after this one's error; review of round 40)
                    for i in partial.ids:
                        _mark_finalized(i, False)
            raise

    def _noised(self, partial: ClippedSum, params: Optional[Mapping[str, Tensor]], consume: bool) -> StepOutput:
        sums = partial.sums
        first = next(iter(sums.values()))
        n_real = partial.mask.sum()
        if self.expected_batch_size is None and partial.mask.numel() == 0:
            raise ValueError("an empty batch has no size to divide by: pass expected_batch_size (q·N under Poisson "
                             "sampling) to make_dp_step, and the step is the noise alone divided by it")
        denom = float(self.expected_batch_size) if self.expected_batch_size is not None else float(partial.mask.numel())
        if self.expected_batch_size is None and self.noise_std > 0:
            self._divisor_seen(int(partial.mask.numel()))
        own = self._index.params  # (without params=: the model's own dtypes; review, round 35: float32 grads
        #  for a bf16 model, which p.grad refuses)
        dtypes = {n: (params[n].dtype if params is not None and n in params
                      else own[n].dtype if n in own and own[n].is_floating_point() else s.dtype) for n, s in sums.items()}
        gen = self._generator(first.device) if self.noise_std > 0 else None
        _check_noise_range(sums, self.noise_std, denom)
        grads = noise_and_scale(sums, self.noise_std, gen, denom, dtypes, compile=self.fused, consume=consume,
                                rng=self.noise_rng)
        _check_narrow_overflow(grads, self.noise_std / denom)
        if self._spectral:  # once per step, whatever the batch size (held during its forwards)
            advance_spectral_norms(self.model, params, self._spectral)
        kept = partial.kept
        n_kept = kept.sum()
        losses = torch.where(kept, partial.losses, torch.zeros_like(partial.losses))
        loss = losses.sum() / n_kept.clamp_min(1)
        clip_fraction = partial.clipped.sum() / n_kept.clamp_min(1)
        return StepOutput(
            grads=grads,
            per_sample_norms=partial.per_sample_norms,
            loss=loss,
            clip_fraction=clip_fraction,
            num_examples=n_real,
            num_nonfinite=(partial.mask & ~kept).sum(),
            noise_std=self.noise_std,
            routes=partial.routes,
            mask=partial.mask,
            kept=kept,
        )

    def __call__(self, params: Mapping[str, Tensor], batch: Batch, mask: Optional[Tensor] = None) -> StepOutput:
        """One DP-SGD step's gradients for ``params`` on ``batch`` (see the class docstring)."""
        resolved = self._resolve(params)
        out = self._finalize(self._clipped(resolved, batch, mask), resolved, consume=True)  # its own sums
        # Return grads under the names the user passed (aliases of tied weights included).
        if set(params) != set(out.grads):
            back = {self._index.canonical[k]: k for k in params}
            out = out._replace(grads={back[n]: g for n, g in out.grads.items()})
        return out


def make_dp_step(
    model: nn.Module,
    loss_fn: LossFn,
    *,
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: Optional[float] = None,
    method: str = "vmap",
    chunk_size: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    clipping: Clipping = "flat",
    clip_budget: Optional[Sequence[float]] = None,
    clip_fn: str = "abadi",
    gamma: float = 0.01,
    on_nonfinite: str = "drop",
    bk_options: Optional[Mapping[str, Any]] = None,
    fused: Optional[bool] = None,
    noise_rng: str = "auto",
) -> DPStep:
    """Build a DP-SGD step: ``dp_step(params, batch, mask=None) -> StepOutput``.

    Args:
        model: any ``nn.Module``; it is not modified (parameters are swapped functionally).
        loss_fn: ``loss_fn(model, batch) -> Tensor[B]``, one loss per example (reduction='none').
        max_grad_norm: C, the clipping bound (= the step's L2 sensitivity).
        noise_multiplier: σ; noise std per coordinate is σC.
        expected_batch_size: the divisor (q·N under Poisson sampling); default: the batch's size, for
            fixed-size batches only (a divisor that follows a random batch size reveals it; a warning
            says so when the size changes between steps), padding rows (mask False) included.
        method: "vmap" (exact per-example gradients, any model), "bk" (book-keeping: one
            forward/backward, per-layer ghost or explicit norms) or "auto" (bk with a per-layer
            cost model; both fall back to exact vmap for layers without a rule).
        chunk_size: examples per vmap chunk (memory ∝ chunk × params); default from a 512 MiB budget.
        generator: ``torch.Generator`` for the noise (reproducible; ``manual_seed`` keeps 32 bits of a
            seed on the CPU: for experiments); None keys one from 256 bits of OS entropy.
        clipping: "flat", "per_layer" (each parameter tensor on its own), or parameter groups
            (dict or list of name lists); ``clip_budget`` weights the groups' share of C².
        clip_fn: "abadi" (min(1, C/‖g‖)) or "automatic" (C/(‖g‖+γ), Bu et al.; ``gamma`` = γ).
        on_nonfinite: "drop" (a non-finite example contributes 0 and is counted) or "raise".
        bk_options: book-keeping options (``routes`` overrides, ``registry``, ``cost_model``, ...;
            see ``pdpsgd.bookkeeping.BK_OPTIONS``). ``routes`` keys are parameter names (any name of
            a tied one), module names or layer type names; a dotted key naming nothing in the model
            is an error, another is warned about and ignored.
        fused: noise + scale + cast through one ``torch.compile``d function; None = on CUDA only.
        noise_rng: the Gaussian source: "auto" (default: on the CPU "native" where its kernel
            builds, else "numpy"; off the CPU "torch"; ``DPStep.noise_source`` says which), "torch"
            (``normal_`` on ``generator``; on the CPU for experiments only: its mt19937 words can be
            recovered from a released update's noise, see ``pdpsgd.fused.TORCH_CPU_WARNING``),
            "numpy" (numpy's Philox4x64-10 keyed by 128 bits drawn from ``generator`` each step,
            float64 normals), "mkl"
            (Intel oneMKL's Philox4x32-10 + Box–Muller, keyed by 64 bits drawn from ``generator``
            each step; ~2.8× faster on Intel, slower on AMD; needs ``pip install mkl``; see
            ``pdpsgd.mkl_rng``) or "native" (pdpsgd's own vectorised Philox4x32-10 + Box–Muller,
            keyed by 128 bits drawn from ``generator`` each step, built once per machine with the
            system C compiler; see ``pdpsgd.native_rng``).

    Formal guarantee: see ``DPStep``; the returned step exposes ``sensitivity`` (C) and
    ``noise_std`` (σC).
    """
    return DPStep(
        model, loss_fn, max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size, method=method, chunk_size=chunk_size,
        generator=generator, clipping=clipping, clip_budget=clip_budget, clip_fn=clip_fn,
        gamma=gamma, on_nonfinite=on_nonfinite, bk_options=bk_options, fused=fused, noise_rng=noise_rng,
    )
