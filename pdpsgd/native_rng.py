"""Optional CPU noise source: pdpsgd's own vectorised Philox4x32-10 + Box–Muller, in C.

On CPU the noise draw is a fixed cost of every DP step (one Gaussian per trained coordinate):
torch's ``normal_`` (one scalar mt19937 stream, then a vectorised Box–Muller) takes 4–8 ns per
coordinate on the 2-core machines we measure on, 0.07–0.14× of a small model's non-private step;
oneMKL (``noise_rng="mkl"``) is 2.8× faster on Intel but 1.8× *slower* on AMD. This module's kernel
(``pdpsgd/_native/philox_normal.c``: counter-based Philox4x32-10 four counters per AVX2 vector,
branch-free float32 log/sincos polynomials, the add of the scaled clipped sum fused into the same
pass) is built once per machine with the system C compiler, on first use, and loaded with ctypes
(plain C, no torch headers: about a second to build). Philox4x32-10 is the generator torch itself
uses on CUDA; like torch's mt19937 it is a statistical, not a cryptographic, PRNG.

Use: the default of ``make_dp_step`` (``noise_rng="auto"``) for float32 and float64 noise on the
CPU, whenever this kernel builds (else numpy's Philox, ``noise_rng="numpy"``; before round 37 torch's
``normal_``, whose mt19937 words released noise gives back), or ``noise_rng="native"`` to require it. Needs a C
compiler (``cc``/``gcc``/``clang``, or ``$CC``) the first time on each machine; the library goes
to ``$PDPSGD_CACHE_DIR`` (default ``$XDG_CACHE_HOME/pdpsgd`` or ``~/.cache/pdpsgd``), named by a
hash of the source, the flags, the compiler and the CPU's flags, written to a temporary file and
renamed into place (atomic: a concurrent or interrupted build never leaves a partial library under
the final name).

Threads: where torch runs its parallel work on GNU OpenMP (its Linux wheels) the kernel is built
with -fopenmp and binds to that same, already loaded runtime (torch loads it into the global
symbol scope; the loader also matches ``libgomp.so.1`` by its soname), so the step's noise runs on
torch's own ``torch.get_num_threads()`` threads (called from the main thread, the ones still
spinning from the step's last matrix product): on several cores a one-thread noise pass would
otherwise grow against a step whose matrix products all scale. The draws do not depend on the
thread count (each piece's first counter is fixed before the pieces are shared). A compiler
without OpenMP, or a load that maps a second OpenMP runtime (a renamed torch libgomp, LLVM's or
Intel's): the plain build, one thread (``threaded()`` says which).

Keying: every call to ``noise_and_scale`` opens a new stream whose 64-bit key and 64-bit nonce are
drawn from the step's ``torch.Generator`` (four 32-bit words), so the generator stays the one
source of entropy and of reproducibility (same generator state, same noise; checkpoints that save
the generator resume the same noise); within a stream the 64-bit counter runs over whole blocks
of 16 counters (64 float32 or 32 float64 normals per block; see the C file's header).

Formal guarantee: each coordinate is an independent N(0, std²) draw up to floating point:
Box–Muller on uniforms from Philox words (float32: a 40-bit radius uniform, 64-bit in the tail
beyond 5.77σ, so tails reach 9.42σ; the transform agrees with float64 Box–Muller on the same
float32 uniform to < 1e-6 absolute, checked over every quadrant and exponent class. The uniform is
rounded to float32 before the log, so next to r = 0 (u1 within 2⁻²⁵ of 1: one pair in 2²⁵) the
radius snaps to a grid √(2k·2⁻²⁴)σ, 0 included: up to 2.5e-4·σ from float64 Box–Muller on the
exact 40-bit uniform there, < 3e-6·σ where r > 0.01 (review, round 39: the claim read "on the same
words"); float64: 53-bit uniforms and libm, 8.57σ). Before round 33 the float32 radius took 24-bit uniforms (as torch's float32
``normal_``): tails ended at 5.77σ, and an output coordinate beyond one dataset's reach but within
its neighbour's (probability up to ~φ(5.77)·‖Δ‖₁/(σC) per step, Δ the shift) told the two apart, a δ the
accountant does not count (review, round 33). At 9.42σ that is φ(9.42) ≈ 2e-20 times ‖Δ‖₁/(σC) ≤
√d/σ: negligible for any model size.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import operator
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["available", "require", "NativeStream", "philox4x32_10", "box_muller_f32", "SOURCE"]

SOURCE = Path(__file__).with_name("_native") / "philox_normal.c"
BLOCK = 16  # Philox counters per block (BLK in the C source)
_PER_BLOCK = {torch.float32: 64, torch.float64: 32}

_LIB: Optional[ctypes.CDLL] = None
_THREADED = False  # the loaded kernel shares torch's OpenMP threads (see threaded())
_ERR: Optional[Tuple] = None  # (the failure's circumstances, its message)
_LOCK = threading.Lock()


def cache_dir() -> Path:
    d = os.environ.get("PDPSGD_CACHE_DIR")
    if d:
        return Path(d)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdpsgd"


def _compiler() -> List[str]:
    """The compiler command: ``$CC`` split like a shell would (``ccache gcc``, ``gcc -m64``), else
    the first of cc, gcc, clang on PATH."""
    cc = os.environ.get("CC")
    if cc:
        words = shlex.split(cc)
        found = shutil.which(words[0]) if words else None
        if found is None:
            raise RuntimeError(f"noise_rng='native': $CC={cc!r} is not an executable on PATH; set $CC to a C "
                               "compiler (or unset it to use cc/gcc/clang), or use noise_rng='numpy'")
        return [found, *words[1:]]
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    raise RuntimeError("noise_rng='native' compiles a small C kernel on first use and needs a C compiler "
                       "(cc, gcc or clang on PATH, or $CC): install one, or use noise_rng='auto' (the default: "
                       "numpy's Philox where the kernel cannot build)")


def _cpu_flags() -> Optional[str]:
    """The CPU's feature flags (Linux), or None where they cannot be read: then the kernel is built
    without -march=native, so a cache shared with another CPU cannot hold an unusable build."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() in ("flags", "Features", "isa", "features"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _run(cmd) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)


# -std=c99 and -ffp-contract=off: no fused multiply-adds (gcc's ISO mode default, clang's is on),
# so builds for different instruction sets draw bit-identical normals
BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-fno-math-errno", "-std=c99", "-ffp-contract=off"]
NATIVE_VARIANTS = (["-march=native"], [])
OPENMP_FLAGS = ["-fopenmp"]


_OMP_RUNTIMES = ("libgomp", "libomp", "libiomp")  # GNU, LLVM, Intel OpenMP runtimes (file name prefixes)


def _omp_mapped(prefixes=_OMP_RUNTIMES) -> frozenset:
    """The OpenMP runtime files mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return frozenset()
    return frozenset(p for p in paths if os.path.basename(p).startswith(prefixes))


def _gomp_mapped() -> frozenset:
    """The GNU OpenMP runtimes mapped into this process (Linux; empty elsewhere)."""
    return _omp_mapped(("libgomp",))


def _openmp_possible() -> bool:
    """torch runs its parallel work on GNU OpenMP here, already loaded: a kernel built with -fopenmp
    may then bind to that same runtime (torch loads it into the global symbol scope, and a
    ``libgomp.so.1`` is matched by its soname) and share torch's threads. Whether it did is known
    only after the load (``_load``: no new OpenMP runtime mapped)."""
    return bool(getattr(torch._C, "has_openmp", False)) and bool(_gomp_mapped())


def _build(variants=None, openmp: bool = False) -> Path:
    """The compiled library for this machine: from the cache, else built and renamed into place
    (``variants``: extra flags to try in order, the first that compiles is taken; by default
    -march=native, where the CPU's flags are known, then none; ``openmp``: each with -fopenmp)."""
    if os.name == "nt":
        raise RuntimeError("noise_rng='native' builds with a Unix C compiler; on Windows use noise_rng='numpy' "
                           "or 'mkl'")
    cc = _compiler()
    cpu = _cpu_flags()
    if variants is None:
        variants = NATIVE_VARIANTS if cpu is not None else ([],)
    src = SOURCE.read_bytes()
    try:
        version = _run([*cc, "--version"]).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(f"noise_rng='native': the C compiler {' '.join(cc)!r} does not run ({err}); set $CC to "
                           "a working one, or use noise_rng='numpy'") from err
    errors = []
    for extra in variants:
        flags = BASE_FLAGS + list(extra) + (OPENMP_FLAGS if openmp else [])
        key = hashlib.sha256(b"\0".join([src, " ".join(cc[1:] + flags).encode(), " ".join(version).encode(),
                                         (cpu or "").encode(), platform.machine().encode()])).hexdigest()[:20]
        out = cache_dir() / f"philox_normal-{key}.so"
        if out.exists():
            return out
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out.parent)
        except OSError as err:
            raise RuntimeError(f"noise_rng='native': cannot write the compiled kernel to {out.parent} ({err}); "
                               "set PDPSGD_CACHE_DIR to a writable directory, or use noise_rng='numpy'") from err
        os.close(fd)
        try:
            res = _run([*cc, *flags, str(SOURCE), "-o", tmp, "-lm"])
            if res.returncode == 0:
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(tmp, 0o755 & ~umask)  # mkstemp made it 0600: readable by all who share the cache
                os.replace(tmp, out)  # atomic: never a partial library under the final name
                return out
            errors.append(f"{' '.join([*cc, *flags])}: {res.stderr.strip()[-500:]}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError("noise_rng='native': building the C kernel failed; use noise_rng='numpy'. "
                       + " | ".join(errors))


def _dlopen_fresh(path: Path) -> ctypes.CDLL:
    """dlopen a rebuilt library under a new name: the dynamic loader matches an already-loaded
    object by its name, so reopening the damaged one's path would hand back the old mapping."""
    fd, tmp = tempfile.mkstemp(prefix=".load-", suffix=".so", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(path.read_bytes())
        return ctypes.CDLL(tmp)
    finally:
        os.unlink(tmp)  # the mapping stays


def _open_library(path: Path, openmp: bool = False) -> ctypes.CDLL:
    """Load and bind a built library; a cached one that does not load (truncated, damaged) is
    removed and built again, once."""
    try:
        return _bind(ctypes.CDLL(str(path)))
    except (OSError, AttributeError) as err:
        try:
            path.unlink()
        except OSError as rm:
            raise RuntimeError(f"noise_rng='native': the cached kernel {path} does not load ({err}) and cannot be "
                               f"removed ({rm}); delete it or set PDPSGD_CACHE_DIR elsewhere") from err
        try:
            return _bind(_dlopen_fresh(_build(openmp=openmp)))
        except (OSError, AttributeError) as err2:
            raise RuntimeError(f"noise_rng='native': the rebuilt kernel {path} does not load ({err2}); "
                               "use noise_rng='numpy'") from err2


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    u32, i64, u64 = ctypes.c_uint32, ctypes.c_int64, ctypes.c_uint64
    for fn, ft in (("pdpsgd_normal_f32", ctypes.c_float), ("pdpsgd_normal_f64", ctypes.c_double)):
        f = getattr(lib, fn)
        f.argtypes = [ctypes.c_void_p, i64, u64, u32, u32, u32, u32, ft, ctypes.c_int, ft]
        f.restype = i64
    for fn, ft in (("pdpsgd_normal_f32_many", ctypes.c_float), ("pdpsgd_normal_f64_many", ctypes.c_double)):
        f = getattr(lib, fn)
        f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, i64, u64, u32, u32, u32, u32, ft, ctypes.c_int, ft,
                      ctypes.c_int]
        f.restype = i64
    lib.pdpsgd_philox_raw.argtypes = [ctypes.c_void_p, i64, u64, u32, u32, u32, u32]
    lib.pdpsgd_philox_raw.restype = None
    lib.pdpsgd_box_muller_f32.argtypes = [ctypes.c_void_p] * 5 + [i64, ctypes.c_float]
    lib.pdpsgd_box_muller_f32.restype = None
    return lib


def _failure_key():
    return (str(cache_dir()), os.environ.get("CC"), os.environ.get("PATH"))


def _load() -> Optional[ctypes.CDLL]:
    """The library, built and loaded once per process; a failure is remembered only while its
    circumstances (cache directory, $CC, PATH) stay the same, so fixing them lets a retry work."""
    global _LIB, _ERR, _THREADED
    with _LOCK:
        if _LIB is not None:
            return _LIB
        if _ERR is not None and _ERR[0] == _failure_key():
            return None
        # with torch's OpenMP runtime loaded, first the threaded build (a compiler without OpenMP, or a
        # runtime that refuses the library, leaves the plain one)
        for openmp in ((True, False) if _openmp_possible() else (False,)):
            try:
                before = _omp_mapped()
                lib = _open_library(_build(openmp=openmp), openmp=openmp)
            except Exception as err:  # noqa: BLE001 - any build failure (a malformed $CC, undecodable compiler
                # output, ...) means "not available": "auto" then falls back to torch, "native" raises it
                _ERR = (_failure_key(), f"{type(err).__name__}: {err}" if not isinstance(err, RuntimeError)
                        else str(err))
                continue
            if openmp and _omp_mapped() != before:
                # the load mapped a second OpenMP runtime (torch's is renamed, or the compiler links
                # another one), which would start its own threads beside torch's: the plain build
                # instead (the runtime stays mapped, unused: nothing here calls into it)
                continue
            _LIB, _ERR, _THREADED = lib, None, openmp
            break
        return _LIB


def require() -> ctypes.CDLL:
    """The loaded library (built on first use), or a RuntimeError that names the problem and the fix."""
    lib = _load()
    if lib is None:
        raise RuntimeError(_ERR[1])
    return lib


def available() -> bool:
    """True when the native kernel is built (or builds now) and loads."""
    return _load() is not None


def threaded() -> bool:
    """True when the loaded kernel shares torch's OpenMP threads: ``NativeStream.add_many`` (the
    step's noise) then runs on ``torch.get_num_threads()`` threads; else on one. The draws are the
    same bits either way."""
    return _load() is not None and _THREADED


MIN_PER_THREAD = 1 << 17  # coordinates: below this a thread's share costs about what starting it does


def _cpu_contiguous(t: Tensor, dtypes, what: str) -> None:
    if t.device.type != "cpu" or not t.is_contiguous() or t.dtype not in dtypes:
        names = "/".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{what} needs a contiguous {names} CPU tensor, got {t.dtype} on {t.device}"
                         f"{'' if t.is_contiguous() else ' (not contiguous)'}")


def philox4x32_10(nblocks: int, counter: int, key: tuple, nonce: tuple = (0, 0)) -> Tensor:
    """Raw words: (nblocks · 16, 4) uint32-valued int64 tensor, row j = Philox4x32-10 of counter
    ``(lo32(counter + j), hi32(counter + j), nonce[0], nonce[1])`` under ``key`` (for tests and audits)."""
    lib = require()
    out = torch.empty(nblocks * BLOCK * 4, dtype=torch.int32)
    lib.pdpsgd_philox_raw(out.data_ptr(), nblocks, counter, key[0], key[1], nonce[0], nonce[1])
    return out.view(-1, 4).to(torch.int64) & 0xFFFFFFFF


def box_muller_f32(x: Tensor, y: Tensor, std: float = 1.0, e: Optional[Tensor] = None):
    """The float32 transform alone on given 32-bit words (int64 tensors of values < 2³²):
    (r·cos, r·sin), r = std·√(−2 ln u1), angle 2π (y >> 8)/2²⁴, u1 = (k·2¹⁶ + l + 1)/2⁴⁰ with
    k = x >> 8, l = ((x & 255) << 8) | (y & 255); where k = 0, u1 = (l·2²⁴ + (e >> 8) + 1)/2⁶⁴
    (``e``: the tail words, default 0; the stream takes them from its tail nonce)."""
    lib = require()
    x = x.to(torch.int64).to(torch.int32).contiguous()  # the same 32 bits
    y = y.to(torch.int64).to(torch.int32).contiguous()
    e = torch.zeros_like(x) if e is None else e.to(torch.int64).to(torch.int32).contiguous()
    if x.shape != y.shape or e.shape != x.shape:
        raise ValueError(f"box_muller_f32: x, y and e differ in shape ({tuple(x.shape)}, {tuple(y.shape)}, "
                         f"{tuple(e.shape)})")
    c, s = torch.empty(x.shape), torch.empty(x.shape)
    lib.pdpsgd_box_muller_f32(x.data_ptr(), y.data_ptr(), e.data_ptr(), c.data_ptr(), s.data_ptr(), x.numel(), std)
    return c, s


def _overlap(ts: Sequence[Tensor]) -> bool:
    """Whether the memory of two of these contiguous tensors overlaps."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in ts)
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


class NativeStream:
    """One Philox4x32-10 stream keyed by 128 bits (key and nonce) drawn from ``generator``.

    ``fill_(out, std)`` writes N(0, std²) into a contiguous float32/float64 CPU tensor;
    ``add_(out, std, scale)`` writes ``out · scale + N(0, std²)`` in the same pass (what the noise
    step needs: the clipped sum divided by the expected batch size, plus noise). Successive calls
    continue the stream (each takes whole blocks of counters). Usable as a context manager.
    """

    def __init__(self, generator: Optional[torch.Generator]):
        self.lib = require()
        words = torch.randint(0, 1 << 32, (4,), generator=generator, dtype=torch.int64)
        self.key = (int(words[0]), int(words[1]))
        self.nonce = (int(words[2]), int(words[3]))
        self.counter = 0
        self._lock = threading.Lock()  # counters are reserved under it: threads sharing a stream never overlap

    @staticmethod
    def _check_args(dtype: torch.dtype, std: float, scale: float) -> None:
        ctype = ctypes.c_float if dtype == torch.float32 else ctypes.c_double
        # (round 45 review: a std or scale finite in Python but past float32's range became inf there: ±inf noise)
        held = ctype(std).value
        if not (std > 0 and math.isfinite(std)) or not (held > 0 and math.isfinite(held)):
            raise ValueError(f"NativeStream: std must be a finite number > 0 that {dtype} can hold, got {std}")
        if not (math.isfinite(scale) and math.isfinite(ctype(scale).value)):
            raise ValueError(f"NativeStream: scale must be a finite number that {dtype} can hold, got {scale}")

    def _reserve(self, need: int) -> int:
        with self._lock:
            start = self.counter
            if start + need > 1 << 64:
                raise RuntimeError("NativeStream: counter space exhausted (2^64 counters); open a new stream")
            self.counter = start + need
        return start

    def _draw(self, out: Tensor, std: float, add: bool, scale: float) -> Tensor:
        _cpu_contiguous(out, (torch.float32, torch.float64), "NativeStream")
        self._check_args(out.dtype, std, scale)
        n = out.numel()
        need = -(-n // _PER_BLOCK[out.dtype]) * BLOCK  # whole blocks of counters
        start = self._reserve(need)
        f = self.lib.pdpsgd_normal_f32 if out.dtype == torch.float32 else self.lib.pdpsgd_normal_f64
        used = f(out.data_ptr(), n, start, *self.key, *self.nonce, std, int(add), scale)
        if used != need:  # the C side's block count disagrees with the reservation: never reuse counters
            raise RuntimeError(f"NativeStream: the kernel used {used} counters for {n} draws, {need} reserved")
        return out

    def add_many(self, outs: Sequence[Tensor], std: float, scale: float, chunk: Optional[int] = None, *,
                 threads: Optional[int] = None) -> None:
        """``add_(piece, std, scale)`` on each piece of each tensor in turn, in one foreign call:
        the pieces are the tensor itself, or (``chunk``) its consecutive ``chunk``-element slices.
        Same draws as those successive calls (each piece takes whole blocks of counters from where
        the previous one ended); all tensors contiguous, on the CPU, of one dtype (float32/float64).

        ``threads``: how many threads share the pieces where the kernel is ``threaded()`` (default
        ``torch.get_num_threads()``, one below ``MIN_PER_THREAD`` coordinates a thread). Each piece's
        first counter is fixed before they are shared, so the draws are the same bits for any
        number of threads: the thread count changes the speed, never the noise. Tensors whose
        memory overlaps are taken on one thread (in turn, as the serial contract says)."""
        outs = [t for t in outs if t.numel() > 0]  # (an empty piece takes no counters)
        if not outs:
            return
        dtype = outs[0].dtype
        for t in outs:
            _cpu_contiguous(t, (torch.float32, torch.float64), "NativeStream")
            if t.dtype != dtype:
                raise ValueError(f"NativeStream.add_many: one dtype for all tensors, got {dtype} and {t.dtype}")
        self._check_args(dtype, std, scale)
        if chunk is not None:  # (round 45 review: a negative chunk gave no pieces: the tensors were left without noise)
            try:
                ok = not isinstance(chunk, bool) and operator.index(chunk) >= 1  # (numpy's ints too)
            except TypeError:
                ok = False
            if not ok:
                raise ValueError(f"NativeStream.add_many: chunk must be an int >= 1 (or None), got {chunk!r}")
            chunk = operator.index(chunk)
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"NativeStream.add_many: threads must be an int >= 1 (or None), got {threads!r}")
        per, es = _PER_BLOCK[dtype], outs[0].element_size()
        ptrs: List[int] = []
        lens: List[int] = []
        for t in outs:
            n, base = t.numel(), t.data_ptr()
            step = chunk or n
            for a in range(0, n, step):
                ptrs.append(base + a * es)
                lens.append(min(step, n - a))
        need = sum(-(-m // per) for m in lens) * BLOCK
        if threads is None:
            threads = min(torch.get_num_threads(), sum(lens) // MIN_PER_THREAD)
        threads = max(1, min(threads, len(lens))) if _THREADED else 1
        if threads > 1 and _overlap(outs):  # (two threads would read-add-write the same elements)
            threads = 1
        start = self._reserve(need)
        k = len(ptrs)
        f = self.lib.pdpsgd_normal_f32_many if dtype == torch.float32 else self.lib.pdpsgd_normal_f64_many
        used = f((ctypes.c_void_p * k)(*ptrs), (ctypes.c_int64 * k)(*lens), k, start, *self.key, *self.nonce,
                 std, 1, scale, threads)
        if used != need:  # the C side's block count disagrees with the reservation: never reuse counters
            raise RuntimeError(f"NativeStream: the kernel used {used} counters for {sum(lens)} draws, {need} reserved")

    def fill_(self, out: Tensor, std: float) -> Tensor:
        return self._draw(out, std, False, 0.0)

    def add_(self, out: Tensor, std: float, scale: float) -> Tensor:
        return self._draw(out, std, True, scale)

    def close(self) -> None:
        pass

    def __enter__(self) -> "NativeStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
