"""Noise + scale for all parameters in one (optionally ``torch.compile``-fused) function.

The clip is already inside the clipped sums (Σ_i c_i g_i, computed by the engines); what is left
per step is, for every parameter, ``sum / denom + (std / denom) · z`` cast to the parameter's dtype,
with z ~ N(0, I) drawn in float32 or wider: the noise is drawn with standard deviation std/denom
directly (``normal_(0, std / denom)``), so one more elementwise pass adds the scaled sum to it.
Eager PyTorch runs 2 kernels per parameter (hundreds of small launches for a transformer); the
compiled version fuses them.

Noise stream (``draw_noise`` is its reference; compiled and eager use the very same z and agree to
float rounding). With a CPU generator: per parameter, in order, in chunks of ``NOISE_CHUNK``
coordinates, from a Philox stream keyed per call with 128 bits drawn from the generator (``rng="native"``,
the default where it builds: pdpsgd's kernel, its add fused in; ``"numpy"``: numpy's Philox4x64-10,
float64 draws cast) or 64 (``"mkl"``: one oneMKL ``vsRngGaussian`` call a chunk, ``pdpsgd.mkl_rng``), or
(``"torch"``, experiments only: ``TORCH_CPU_WARNING``) one ``normal_`` call a chunk (float64 draws,
cast: ``_wide_normal_``); eager (the CPU default) draws each chunk into a small scratch buffer that stays in cache and writes
scratch + sum/denom into its output slice in one pass (no buffer of all parameters' size, whose
page faults cost as much as the draw); the inputs are copied first unless the caller hands them over (``consume=True``,
what ``DPStep.__call__`` does with its own clipped sums). With a generator on an accelerator: all
parameters' noise in ONE ``normal_`` call over one buffer, cut into per-parameter views in order
(chunks there were one launch per 64k coordinates: ~1,900 launches and 56 ms of host time per step
for GPT-2 small on an H200, more than the whole non-private step's GPU work).

Formal guarantee: each coordinate of the output is s/denom + (std/denom)·z with z an independent
standard normal drawn in float32 or wider (never in bf16/fp16) from ``generator``, i.e.
(s + N(0, std²))/denom; with std = σC and sums of L2 sensitivity C this is the Gaussian mechanism.
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from ._warn import warn
from .noise import entropy_generator

__all__ = ["noise_and_scale", "draw_noise", "noise_chunk", "default_compile", "NOISE_CHUNK"]

_COMPILED = None


def _apply(sums, zs, inv_denom: float, dtypes):
    # per tensor: s · (1/denom) + z, z ~ N(0, (std/denom)²) drawn already -> param dtype; one fused
    # kernel per tensor group when compiled
    return {n: (s * inv_denom + zs[n]).to(dtypes[n]) for n, s in sums.items()}


def _compiled():
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(_apply, dynamic=False, fullgraph=True)
    return _COMPILED


_OOM = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), MemoryError)
_COMPILE_FAILED: Optional[str] = None  # why the compiled function could not run (then eager from there on)


def _run(sums, zs, inv_denom: float, dtypes):
    """``_apply`` compiled, or eagerly (the same ops on the same z) once the backend has failed: a
    missing C++ compiler or triton shows only at the first call (review, round 36)."""
    global _COMPILE_FAILED
    if _COMPILE_FAILED is None:
        try:
            return _compiled()(sums, zs, inv_denom, dtypes)
        except _OOM:
            raise  # (memory, not the backend: eager would need it too, and compile stays on)
        except Exception as e:  # (the backend's own errors have no common base class)
            _COMPILE_FAILED = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            warn(f"torch.compile could not build the fused noise function ({_COMPILE_FAILED}); the noise is "
                 "added eagerly from now on (the same values; pass fused=False to skip the attempt)")
    return _apply(sums, zs, inv_denom, dtypes)


def default_compile(device: torch.device) -> bool:
    """Compiled by default on CUDA with triton only (compile time is not worth it on CPU)."""
    if device.type != "cuda":
        return False
    try:
        from torch.utils._triton import has_triton
    except ImportError:  # (an older torch: let the first call tell)
        return True
    return bool(has_triton())


# Noise is drawn per parameter in chunks of this many coordinates into a small scratch buffer that
# stays in cache (CPU eager path), instead of one fresh buffer of all parameters' size: the fresh
# buffer's page faults cost about as much as the draw itself (5.4M parameters: ~36 -> ~19 ms).
NOISE_CHUNK = 1 << 16


def _chunks(numel: int):
    for a in range(0, numel, NOISE_CHUNK):
        yield a, min(numel, a + NOISE_CHUNK)


def noise_chunk(gdev: torch.device) -> Optional[int]:
    """Coordinates per ``normal_`` call for a generator on ``gdev``: ``NOISE_CHUNK`` on CPU; None
    elsewhere, meaning one call for all parameters (see the module docstring)."""
    return NOISE_CHUNK if gdev.type == "cpu" else None


RNGS = ("auto", "torch", "mkl", "native", "numpy")
CPU_RNGS = ("mkl", "native", "numpy")  # the sources keyed from a CPU generator, drawing on the CPU

# torch's CPU ``normal_`` is Box–Muller on the generator's own mt19937 words, and mt19937 is linear
# over GF(2): every coordinate released as noise alone (an embedding row no example of the batch
# used: its clipped sum is exactly 0) gives back ~25 leading bits of two uniforms, each bit a linear
# equation on the 19,937-bit state, so one step's update pins the state down and with it every
# step's noise, before and after (review, round 37). The CPU sources that "auto" takes instead
# release no generator word: each call keys a Philox4x32-10 stream with 128 bits drawn from the
# generator ("native": pdpsgd's kernel; "numpy": numpy's Philox4x64-10 bit generator, where the
# kernel cannot build), so recovering the generator would take breaking Philox's key.
TORCH_CPU_WARNING = (
    "noise_rng='torch' on the CPU draws the noise with torch's normal_, Box-Muller on the generator's own "
    "mt19937 words: mt19937 is linear over GF(2), so the coordinates a released update holds as noise "
    "alone (e.g. embedding rows no example used) give back its state, and then every step's noise can be "
    "subtracted. For experiments only; noise_rng='auto' (the default) keys a Philox stream per step instead")


def resolve_rng(rng: str, gdev: torch.device, dtype: torch.dtype) -> str:
    """The noise source that ``rng`` means for a generator on ``gdev`` drawing ``dtype``: "auto" is
    "native" (pdpsgd's vectorised Philox + Box–Muller, ~2× torch's ``normal_`` on the CPU for
    float32) for noise on the CPU where its kernel builds, else "numpy" (numpy's Philox, keyed the
    same way; never torch's CPU ``normal_``, see ``TORCH_CPU_WARNING``); "torch" off the CPU (CUDA's
    Philox, seeded with 64 bits); the others are themselves."""
    if rng != "auto":
        return rng
    if gdev.type == "cpu":
        from . import native_rng

        if dtype in (torch.float32, torch.float64) and native_rng.available():
            return "native"
        return "numpy"
    return "torch"


class NumpyStream:
    """numpy's Philox (4x64-10) bit generator keyed with 128 bits drawn from ``generator`` (one stream per
    call of the noise step, as ``NativeStream``); normals from numpy's float64 ziggurat (53-bit
    uniforms: tails past 8σ, as torch's float64 ones), scaled and cast to the buffer's dtype.
    ``fill_(out, std)`` writes N(0, std²) into a CPU tensor; successive calls continue the stream."""

    def __init__(self, generator: Optional[torch.Generator]):
        import numpy as np

        words = torch.randint(0, 1 << 32, (4,), generator=generator, dtype=torch.int64)
        key = sum(int(w) << (32 * i) for i, w in enumerate(words.tolist()))
        self._gen = np.random.Generator(np.random.Philox(key=key))

    def fill_(self, out: Tensor, std: float) -> Tensor:
        if out.device.type != "cpu":
            raise ValueError("noise_rng='numpy' draws on the CPU")
        return _fill_wide(out, lambda n: torch.from_numpy(self._gen.standard_normal(n)).mul_(std))

    def close(self) -> None:
        pass


def _check_rng(rng: str, gdev: torch.device) -> None:
    if rng not in RNGS:
        raise ValueError(f"noise_rng={rng!r} is unknown: use one of {RNGS}")
    if rng == "auto":
        return
    if rng != "torch" and gdev.type != "cpu":
        raise ValueError(f"noise_rng={rng!r} draws on the CPU, but the noise is drawn on {gdev.type}: "
                         "use noise_rng='torch' there")


def _open(rng: str, generator: Optional[torch.Generator]):
    """The chunk filler ``fill(buffer, std)``, its closer, and (native only, else None) the fused
    ``add(xs, std, scale, chunk)`` writing x·scale + N(0, std²) in one pass over each tensor x of
    ``xs`` in turn, chunk by chunk (``NativeStream.add_many``: one foreign call) (torch: ``normal_``; mkl and
    native: one Philox stream keyed from ``generator``, see ``pdpsgd.mkl_rng``, ``pdpsgd.native_rng``)."""
    if rng == "mkl":
        from .mkl_rng import MKLStream

        stream = MKLStream(generator)
        return stream.fill_, stream.close, None
    if rng == "native":
        from .native_rng import NativeStream

        stream = NativeStream(generator)
        return stream.fill_, stream.close, stream.add_many
    if rng == "numpy":
        stream = NumpyStream(generator)
        return stream.fill_, stream.close, None
    return (lambda buf, std: _wide_normal_(buf, std, generator)), (lambda: None), None


# torch's float32 ``normal_`` takes 24-bit uniforms (CPU; CUDA's curand 32-bit ones), so its tails
# end at 5.77σ (6.66σ): an output coordinate beyond one dataset's reach but within its neighbour's
# tells them apart (review, round 33). Narrower noise buffers are therefore filled from float64
# draws (53-bit uniforms, 8.57σ), in pieces of this many coordinates (bounded extra memory).
WIDE_PIECE = 1 << 22


def _fill_wide(buf: Tensor, draw) -> Tensor:
    """``buf`` filled with ``draw(n)`` (n float64 normals) piece by piece, cast to its dtype."""
    flat = buf.view(-1)
    for a in range(0, flat.numel(), WIDE_PIECE):
        part = flat[a:a + WIDE_PIECE]
        part.copy_(draw(part.numel()))
    return buf


def _wide_normal_(buf: Tensor, std: float, generator: Optional[torch.Generator]) -> Tensor:
    if buf.dtype == torch.float64:
        return buf.normal_(0.0, std, generator=generator)
    return _fill_wide(buf, lambda n: torch.empty(n, dtype=torch.float64, device=buf.device).normal_(
        0.0, std, generator=generator))


def _keyed(generator: Optional[torch.Generator], rng: str, device: torch.device) -> torch.Generator:
    """``generator``, or (None) a fresh one keyed from OS entropy: never torch's global generator, whose
    seed keeps 32 bits (review, round 37); on the CPU for the CPU sources."""
    if generator is not None:
        return generator
    return entropy_generator(torch.device("cpu") if rng in CPU_RNGS else device)


def draw_noise(shapes: Mapping[str, torch.Size], generator: Optional[torch.Generator], dtype: torch.dtype,
               device: torch.device, std: float = 1.0, rng: str = "auto") -> Dict[str, Tensor]:
    """Normals N(0, std²) for each shape, in the order given, drawn exactly as ``noise_and_scale``
    draws them (``noise_chunk`` of the generator's device; it passes std/denom; ``rng`` the noise
    source, one of ``RNGS``; "auto" resolved by ``resolve_rng``): the reference for its stream.
    Its default is the step's, "auto" (round 37: "torch", whose CPU stream the released noise gives
    back; ``DPStep.noise_source`` says which). ``generator=None``: a fresh one keyed from OS entropy
    (not torch's global generator)."""
    generator = _keyed(generator, rng, device)
    gdev = generator.device
    _check_rng(rng, gdev)
    rng = resolve_rng(rng, gdev, dtype)
    out = {}
    fill, close, _ = _open(rng, generator)
    if noise_chunk(gdev) is None:  # one draw for all, cut into views in order
        sizes = [int(math.prod(shape)) for shape in shapes.values()]
        try:
            flat = fill(torch.empty(sum(sizes), dtype=dtype, device=gdev), std)
        finally:
            close()
        for (n, shape), z in zip(shapes.items(), flat.split(sizes)):
            out[n] = z.to(device).view(shape)
        return out
    try:
        for n, shape in shapes.items():
            z = torch.empty(int(math.prod(shape)), dtype=dtype, device=gdev)
            for a, b in _chunks(z.numel()):
                fill(z[a:b], std)
            out[n] = z.to(device).view(shape)
    finally:
        close()
    return out


def noise_and_scale(
    sums: Mapping[str, Tensor],
    std: float,
    generator: Optional[torch.Generator],
    denom: float,
    dtypes: Mapping[str, torch.dtype],
    *,
    compile: Optional[bool] = None,
    consume: bool = False,
    rng: str = "auto",
) -> Dict[str, Tensor]:
    """``{n: (sums[n] / denom + N(0, (std/denom)²)).to(dtypes[n])}``, noise in float32 or wider.

    ``consume=True``: the caller hands the sums over (they are not used again), so a float32 (or
    wider) sum is overwritten in place and returned instead of copied. ``rng``: the noise source
    for a CPU generator, "torch" (``normal_``; for experiments, ``TORCH_CPU_WARNING``), "mkl" (oneMKL's
    Philox4x32-10 keyed from ``generator``; see ``pdpsgd.mkl_rng``), "native" (pdpsgd's own
    Philox4x32-10; ``pdpsgd.native_rng``), "numpy" (numpy's Philox4x64-10, ``NumpyStream``) or "auto"
    (``resolve_rng``: native on the CPU where it builds, else numpy; torch off the CPU; the default
    here and of ``make_dp_step``; before round 37 this function's was "torch"). ``generator=None``: a
    fresh one keyed from OS entropy.
    """
    if not sums:
        return {}
    first = next(iter(sums.values()))
    if compile is None:
        compile = default_compile(first.device)
    acc = {n: torch.promote_types(s.dtype, torch.float32) for n, s in sums.items()}
    inv = 1.0 / float(denom)
    if std == 0:
        if compile:
            sums = {n: s.to(acc[n]) for n, s in sums.items()}
            zs = {n: torch.zeros((), dtype=acc[n], device=s.device) for n, s in sums.items()}
            return _run(sums, zs, inv, dict(dtypes))
        return {n: (s * inv).to(dtypes[n]) for n, s in sums.items()}
    ndt = max(acc.values(), key=lambda d: torch.finfo(d).bits)
    zstd = float(std) * inv  # the noise is drawn already divided by denom
    generator = _keyed(generator, rng, first.device)
    gdev = generator.device
    _check_rng(rng, gdev)
    rng = resolve_rng(rng, gdev, ndt)
    if compile:
        zs = draw_noise({n: s.shape for n, s in sums.items()}, generator, ndt, first.device, zstd, rng)
        sums = {n: s.to(acc[n]) for n, s in sums.items()}
        zs = {n: z.to(device=sums[n].device, dtype=acc[n]) for n, z in zs.items()}  # each on its sum's device
        return _run(sums, zs, inv, dict(dtypes))
    shared = _overlapping(sums) if consume else set()  # (only an owned sum is overwritten)
    # one draw for all off the CPU; per-chunk draws into a cache-sized scratch buffer on CPU
    whole = noise_chunk(gdev) is None
    zs = draw_noise({n: s.shape for n, s in sums.items()}, generator, ndt, first.device, zstd, rng) if whole else None
    scratch = None if whole else torch.empty(min(NOISE_CHUNK, max(s.numel() for s in sums.values())),
                                              dtype=ndt, device=gdev)
    out: Dict[str, Tensor] = {}
    fill, close, add = (None, lambda: None, None) if whole else _open(rng, generator)
    pending: List[Tuple[str, Tensor]] = []  # sums for the stream's fused pass, drawn together in order

    def flush() -> None:
        if pending:
            # s/denom + N(0, (std/denom)²), in place, chunk by chunk: the same draws as draw_noise
            add([o.view(-1) for _, o in pending], zstd, inv, NOISE_CHUNK)
            for n, o in pending:
                out[n] = o.to(dtypes[n])
            pending.clear()

    try:
        for n, s in sums.items():
            # overwrite only a sum whose memory no other sum shares (never one tensor under two names)
            owned = consume and s.dtype == acc[n] and s.is_contiguous() and n not in shared
            o = s if owned else s.to(acc[n], memory_format=torch.contiguous_format, copy=True)
            if whole:
                torch.add(zs[n].to(device=o.device, dtype=o.dtype), o, alpha=inv, out=o)  # z + s/denom, in place
                out[n] = o.to(dtypes[n])
                continue
            # the stream's own fused pass (CPU sums in the draw dtype), one call for a run of them
            if add is not None and o.dtype == ndt and o.device.type == "cpu":
                out[n] = o  # (its place in the order; converted once drawn)
                pending.append((n, o))
                continue
            flush()  # (the draws stay in the order of the sums)
            flat = o.view(-1)
            for a, b in _chunks(flat.numel()):
                z = fill(scratch[: b - a], zstd)  # (b - a,) N(0, (std/denom)²), in cache
                # z + s/denom on this chunk while it is in cache, one pass (same ops and order as unchunked)
                torch.add(z.to(device=flat.device, dtype=flat.dtype), flat[a:b], alpha=inv, out=flat[a:b])
            out[n] = o.to(dtypes[n])
        flush()
    finally:
        close()
    return out


def _overlapping(sums: Mapping[str, Tensor]) -> set:
    """Names of the sums whose memory another sum's overlaps (the same tensor under two names, or
    views of one region); distinct regions of one storage (e.g. rows of a stacked sum) do not."""
    spans = []
    for n, s in sums.items():
        if s.numel() == 0:
            continue
        lo = s.untyped_storage().data_ptr() + s.storage_offset() * s.element_size()
        if s.is_contiguous():
            hi = lo + s.numel() * s.element_size()
        else:  # (a strided sum: all of its storage, conservatively)
            lo = s.untyped_storage().data_ptr()
            hi = lo + s.untyped_storage().nbytes()
        spans.append((lo, hi, n))
    spans.sort()
    bad = set()
    end, last = None, None
    for lo, hi, n in spans:
        if end is not None and lo < end:
            bad.update((n, last))
        if end is None or hi > end:
            end, last = hi, n
    return bad
