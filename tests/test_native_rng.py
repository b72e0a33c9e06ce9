"""pdpsgd's native noise kernel (``pdpsgd.native_rng``): its Philox4x32-10 against the published
known-answer vectors and an independent numpy implementation, its Box–Muller against float64 on
the same words over every input class, its stream layout, keying, and its build's error and cache."""
import math
import subprocess

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from scipy import stats

from pdpsgd import native_rng

pytestmark = pytest.mark.skipif(not native_rng.available(), reason="no C compiler to build the native kernel")

M32 = np.uint64(0xFFFFFFFF)


def philox_np(counters: np.ndarray, key, nonce) -> np.ndarray:
    """Philox4x32-10 in numpy uint64 arithmetic (Salmon et al. 2011): (n,) counters -> (n, 4) words."""
    c = counters.astype(np.uint64)
    x = [c & M32, c >> np.uint64(32), np.full_like(c, nonce[0]), np.full_like(c, nonce[1])]
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * x[0]
        p1 = np.uint64(0xCD9E8D57) * x[2]
        x = [(p1 >> np.uint64(32)) ^ x[1] ^ k0, p1 & M32, (p0 >> np.uint64(32)) ^ x[3] ^ k1, p0 & M32]
        k0 = (k0 + np.uint64(0x9E3779B9)) & M32
        k1 = (k1 + np.uint64(0xBB67AE85)) & M32
    return np.stack(x, axis=1).astype(np.int64)


TAIL_NONCE = 0x9E3779B9


def box_muller_ref(x: np.ndarray, y: np.ndarray, e=None):
    """float64 Box–Muller on the float32 path's uniforms: 40-bit, 64-bit where x >> 8 is 0 (``e``:
    the tail words, default 0)."""
    e = np.zeros_like(x) if e is None else e
    k, low = x >> 8, ((x & 0xFF) << 8) | (y & 0xFF)
    f32 = np.float32  # the uniform as the kernel forms it: two exact float32 terms, their sum rounded once
    u1 = np.where(k > 0, f32(k * 2.0 ** -24) + f32((low + 1) * 2.0 ** -40),
                  f32(low * 2.0 ** -40) + f32(((e >> 8) + 1) * 2.0 ** -64)).astype(np.float64)
    t = 2 * np.pi * (y >> 8) / 2.0 ** 24
    r = np.sqrt(-2 * np.log(u1))
    return r * np.cos(t), r * np.sin(t)



class _ThreadsSeen:
    """The kernel library, with the thread count of each ``*_many`` call (its last argument) appended to ``seen``."""

    def __init__(self, lib, seen):
        self._lib, self._seen = lib, seen

    def __getattr__(self, name):
        f = getattr(self._lib, name)
        if not name.endswith("_many"):
            return f
        return lambda *a: (self._seen.append(a[-1]), f(*a))[1]

def stream_ref(nblocks, key, nonce, dtype, first=0):
    """The documented stream layout, from raw words, in float64 (blocks first .. first + nblocks - 1)."""
    ctr = np.arange(first * 16, (first + nblocks) * 16, dtype=np.uint64)
    w = philox_np(ctr, key, nonce).reshape(nblocks, 16, 4)
    if dtype == torch.float32:
        e = philox_np(ctr, key, (nonce[0], nonce[1] ^ TAIL_NONCE))
        e = e.reshape(nblocks, 16, 4)
        c0, s0 = box_muller_ref(w[..., 0], w[..., 1], e[..., 0])
        c1, s1 = box_muller_ref(w[..., 2], w[..., 3], e[..., 1])
        return np.concatenate([c0, s0, c1, s1], axis=1).reshape(-1)
    a = (w[..., 0] << 21) ^ (w[..., 1] >> 11)
    b = (w[..., 2] << 21) ^ (w[..., 3] >> 11)
    r = np.sqrt(-2 * np.log((a + 1) / 2.0 ** 53))
    t = 2 * np.pi * (b / 2.0 ** 53)
    return np.concatenate([r * np.cos(t), r * np.sin(t)], axis=1).reshape(-1)


def test_philox_known_answers():
    """Random123's published Philox4x32-10 test vectors (kat_vectors)."""
    cases = [
        (0, (0, 0), (0, 0), [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        ((1 << 64) - 1, (0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        (0x85A308D3_243F6A88, (0xA4093822, 0x299F31D0), (0x13198A2E, 0x03707344),
         [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
    ]
    for counter, key, nonce, want in cases:
        assert native_rng.philox4x32_10(1, counter, key, nonce)[0].tolist() == want


@settings(max_examples=25, deadline=None)
@given(nblocks=st.integers(1, 5), counter=st.one_of(st.integers(0, 2 ** 40), st.integers(2 ** 32 - 40, 2 ** 32 + 40)),
       key=st.tuples(st.integers(0, 2 ** 32 - 1), st.integers(0, 2 ** 32 - 1)),
       nonce=st.tuples(st.integers(0, 2 ** 32 - 1), st.integers(0, 2 ** 32 - 1)))
def test_philox_equals_an_independent_implementation(nblocks, counter, key, nonce):
    """Any key, nonce and counter (including the carry from the counter's low word into its high word)."""
    got = native_rng.philox4x32_10(nblocks, counter, key, nonce).numpy()
    want = philox_np(np.arange(counter, counter + nblocks * 16, dtype=np.uint64), key, nonce)
    assert np.array_equal(got, want)


def test_box_muller_matches_float64_over_every_input_class():
    """Every 97th of the 2^24 angle inputs and of the radius inputs (each quadrant and its rounding
    boundaries, each exponent of u1 down to 2^-24), plus the extremes: < 1e-6 absolute from float64
    Box–Muller on the same words, std scaling exact to float rounding."""
    k = np.unique(np.concatenate([np.arange(0, 1 << 24, 97), [0, 1, (1 << 24) - 1],
                                  [q * (1 << 22) + d for q in range(5) for d in (-(1 << 21) - 1, -(1 << 21), -1, 0, 1,
                                                                                 (1 << 21) - 1, 1 << 21)],
                                  [(1 << e) - 1 for e in range(25)], [1 << e for e in range(24)]]))
    k = k[(k >= 0) & (k < 1 << 24)]
    words = k << 8 | (k & 0xFF)  # the low 8 bits are dropped by the transform
    rng = np.random.default_rng(0)
    for x, y in ((words, rng.permutation(words)), (rng.permutation(words), words)):
        c, s = native_rng.box_muller_f32(torch.from_numpy(x), torch.from_numpy(y))
        rc, rs = box_muller_ref(x, y)
        assert np.abs(c.double().numpy() - rc).max() < 1e-6
        assert np.abs(s.double().numpy() - rs).max() < 1e-6
        c3, _ = native_rng.box_muller_f32(torch.from_numpy(x), torch.from_numpy(y), std=3.0)
        np.testing.assert_allclose(c3.double().numpy(), 3 * c.double().numpy(), rtol=1e-6, atol=1e-7)
    top = native_rng.box_muller_f32(torch.tensor([0]), torch.tensor([0]))[0]  # u1 = 2^-64: the largest radius
    assert abs(float(top) - math.sqrt(128 * math.log(2))) < 1e-5


@settings(max_examples=25, deadline=None)
@given(low=st.integers(0, 2 ** 16 - 1), e=st.integers(0, 2 ** 32 - 1), k=st.integers(0, 3), angle=st.integers(0, 2 ** 24 - 1),
       std=st.floats(0.1, 10.0))
def test_tails_reach_beyond_the_24_bit_uniforms_limit(low, e, k, angle, std):
    """Review, round 33: 24-bit uniforms ended the float32 tails at 5.77σ (an output beyond one
    dataset's reach but within a neighbour's tells them apart). The radius uniform is now 40-bit,
    and 64-bit where it is below 2^-24: every radius up to 9.42σ is reachable, as float64
    Box–Muller on the same words gives it."""
    x = np.array([(k << 8) | (low >> 8)], dtype=np.int64)
    y = np.array([(angle << 8) | (low & 0xFF)], dtype=np.int64)
    ee = np.array([e], dtype=np.int64)
    c, s = native_rng.box_muller_f32(torch.from_numpy(x), torch.from_numpy(y), std=std, e=torch.from_numpy(ee))
    rc, rs = box_muller_ref(x, y, ee)
    r = math.hypot(float(c[0]), float(s[0]))
    assert abs(r - std * math.hypot(rc[0], rs[0])) <= 2e-6 * std * max(1.0, r / std)
    assert np.abs(c.double().numpy() - std * rc).max() <= 2e-6 * std * max(1.0, r / std)
    if k == 0 and low == 0 and e < 2 ** 8:
        assert r > 9.4 * std  # u1 = 2^-64


def test_stream_tail_beyond_5_77_sigma_is_drawn():
    """A stream's draws beyond 5.77σ: in 2^27 pairs ~8 of them (2^-24 each) fall in the tail; each
    equals the reference with its tail word, and their count is what the Gaussian gives."""
    s = native_rng.NativeStream(torch.Generator().manual_seed(11))
    per, piece = 64, 1 << 24  # 2^28 draws in pieces of 2^24 (2^18 blocks each)
    tails = []
    for i in range(16):
        z = s.fill_(torch.empty(piece), 1.0)
        for j in torch.nonzero(z.abs() > 5.77).flatten().tolist():
            b = j // per  # its block, checked against the reference with the tail words
            ref = stream_ref(1, s.key, s.nonce, torch.float32, first=i * (piece // per) + b)
            assert np.abs(z[b * per:(b + 1) * per].double().numpy() - ref).max() <= 1e-5
            tails.append(float(z[j]))
    # P(|z| > 5.77) = 7.9e-9 per draw, ~2.1 expected in 2^28 (this seed: see the assert); none before the fix
    assert len(tails) >= 1, tails


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 700), splits=st.lists(st.integers(1, 300), max_size=4),
       dtype=st.sampled_from([torch.float32, torch.float64]), std=st.floats(0.01, 100.0), seed=st.integers(0, 2 ** 31))
def test_stream_follows_its_documented_layout_across_calls(n, splits, dtype, std, seed):
    """A stream's draws in successive calls of any sizes: call i starts at the first block the
    previous calls did not touch; each equals float64 Box–Muller on the documented words."""
    s = native_rng.NativeStream(torch.Generator().manual_seed(seed))
    sizes = [n] + splits
    per = 64 if dtype == torch.float32 else 32
    blocks = sum(-(-m // per) for m in sizes)
    ref = stream_ref(blocks, s.key, s.nonce, dtype) * std
    at = 0
    tol = 1e-6 * std if dtype == torch.float32 else 1e-12 * std
    for m in sizes:
        z = s.fill_(torch.empty(m, dtype=dtype), std)
        assert np.abs(z.double().numpy() - ref[at * per: at * per + m]).max() <= tol
        at += -(-m // per)
    assert s.counter == blocks * 16


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 500), dtype=st.sampled_from([torch.float32, torch.float64]), scale=st.floats(-4.0, 4.0),
       seed=st.integers(0, 2 ** 31))
def test_fused_add_is_scaled_input_plus_the_same_draws(n, dtype, scale, seed):
    x = torch.randn(n, dtype=dtype)
    z = native_rng.NativeStream(torch.Generator().manual_seed(seed)).fill_(torch.empty(n, dtype=dtype), 0.7)
    y = x.clone()
    native_rng.NativeStream(torch.Generator().manual_seed(seed)).add_(y, 0.7, scale)
    torch.testing.assert_close(y, x * scale + z)


def test_keyed_by_128_bits_of_the_generator():
    """The stream's key and nonce are the generator's next four 32-bit draws: the generator is the
    one source of entropy (same state, same noise) and advances by exactly those draws."""
    g = torch.Generator().manual_seed(9)
    words = torch.randint(0, 1 << 32, (4,), generator=torch.Generator().manual_seed(9), dtype=torch.int64).tolist()
    s = native_rng.NativeStream(g)
    assert (s.key, s.nonce) == (tuple(words[:2]), tuple(words[2:]))
    after = torch.Generator().manual_seed(9)
    torch.randint(0, 1 << 32, (4,), generator=after, dtype=torch.int64)
    assert torch.equal(g.get_state(), after.get_state())


def test_distribution_moments_and_pairs():
    """10^6 draws: KS against N(0, σ²), the fourth moment, and no correlation between the cos and
    sin members of a Box–Muller pair or between neighbouring coordinates."""
    z = native_rng.NativeStream(torch.Generator().manual_seed(1)).fill_(torch.empty(1 << 20), 2.0).double().numpy()
    assert stats.kstest(z, "norm", args=(0.0, 2.0)).pvalue > 1e-3
    assert abs(np.mean(z ** 4) / 16 - 3) < 0.05
    b = z.reshape(-1, 4, 16)  # per block: cos(w0,w1), sin(w0,w1), cos(w2,w3), sin(w2,w3)
    assert abs(np.corrcoef(b[:, 0].ravel(), b[:, 1].ravel())[0, 1]) < 0.01
    assert abs(np.corrcoef(b[:, 0].ravel() ** 2, b[:, 1].ravel() ** 2)[0, 1]) < 0.01  # same radius, but independent
    assert abs(np.corrcoef(z[:-1], z[1:])[0, 1]) < 0.01
    assert abs(np.mean(np.abs(z) > 8.0) - 2 * stats.norm.sf(4.0)) < 2e-4  # 4σ tails


def test_bad_input_is_refused():
    s = native_rng.NativeStream(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="contiguous"):
        s.fill_(torch.empty(10, 2)[:, 0], 1.0)
    with pytest.raises(ValueError, match="float32/float64"):
        s.fill_(torch.empty(4, dtype=torch.bfloat16), 1.0)
    with pytest.raises(ValueError, match="std must be a finite number > 0"):
        s.fill_(torch.empty(4), 0.0)


def test_build_is_cached_and_atomic(tmp_path, monkeypatch):
    """A fresh cache directory gets exactly one library (no temporary left behind); the next load
    takes it from the cache without running the compiler."""
    monkeypatch.setenv("PDPSGD_CACHE_DIR", str(tmp_path))
    path = native_rng._build()
    assert path.parent == tmp_path and [p.name for p in tmp_path.iterdir()] == [path.name]

    real = native_rng._run

    def version_only(cmd):
        if "--version" in cmd:
            return real(cmd)
        raise AssertionError(f"compiled again: {cmd}")

    monkeypatch.setattr(native_rng, "_run", version_only)
    assert native_rng._build() == path


def test_missing_compiler_gives_a_clear_error(tmp_path, monkeypatch):
    """No compiler, a $CC that is not one, a compiler that fails: each a clear error at
    construction (not at the first step) naming the fix; σ = 0 needs no kernel at all."""
    import pdpsgd
    from torch import nn

    make = lambda sigma=1.0: pdpsgd.make_dp_step(nn.Linear(2, 2), lambda m, b: m(b["x"]).sum(1), max_grad_norm=1.0,
                                                 noise_multiplier=sigma, noise_rng="native")
    monkeypatch.setenv("PDPSGD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native_rng, "_LIB", None)
    monkeypatch.setattr(native_rng, "_ERR", None)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="needs a C compiler.*noise_rng='auto'"):
        make()
    make(sigma=0.0)  # no noise is drawn: no library needed
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(RuntimeError, match=r"\$CC='no-such-cc' is not an executable"):
        native_rng.require()
    monkeypatch.undo()
    monkeypatch.setenv("PDPSGD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native_rng, "_LIB", None)
    monkeypatch.setattr(native_rng, "_ERR", None)
    monkeypatch.setenv("CC", "false")  # a "compiler" that runs and fails
    with pytest.raises(RuntimeError, match="building the C kernel failed"):
        native_rng.require()


def test_cc_with_arguments_is_split_like_a_shell(tmp_path, monkeypatch):
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    monkeypatch.setenv("PDPSGD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", f"{cc} -O2")
    lib = native_rng._open_library(native_rng._build())
    out = torch.empty(64)
    lib.pdpsgd_normal_f32(out.data_ptr(), 64, 0, 1, 2, 3, 4, 1.0, 0, 0.0)
    assert torch.isfinite(out).all() and out.std() > 0.3


def test_a_failure_is_not_remembered_once_its_cause_is_fixed(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setattr(native_rng, "_LIB", None)
    monkeypatch.setattr(native_rng, "_ERR", None)
    monkeypatch.setenv("PDPSGD_CACHE_DIR", str(blocker / "cache"))
    assert not native_rng.available()
    monkeypatch.setenv("PDPSGD_CACHE_DIR", str(tmp_path / "cache"))
    assert native_rng.available()


def test_a_damaged_cached_library_is_rebuilt(tmp_path, monkeypatch):
    """A truncated library under the final name (a partial copy of a cache, a full disk) is
    removed and built again; the build is readable by everyone sharing the cache (not mkstemp's 0600)."""
    import stat

    monkeypatch.setenv("PDPSGD_CACHE_DIR", str(tmp_path))
    path = native_rng._build()
    mode = stat.S_IMODE(path.stat().st_mode)
    assert mode & 0o044 == 0o044 & ~_umask()
    path.write_bytes(path.read_bytes()[:100])
    lib = native_rng._open_library(path)
    assert path.stat().st_size > 1000
    # a library that loads but is another one (no such symbols), already loaded under that name
    import ctypes
    import subprocess

    subprocess.run([native_rng._compiler()[0], "-shared", "-fPIC", "-x", "c", "-", "-o", str(path)],
                   input="int foo(void){return 0;}", text=True, check=True)
    ctypes.CDLL(str(path))
    lib = native_rng._open_library(path)
    assert path.stat().st_size > 1000
    w = torch.empty(64, dtype=torch.int32)
    lib.pdpsgd_philox_raw(w.data_ptr(), 1, 0, 0, 0, 0, 0)
    assert (w[0].item() & 0xFFFFFFFF) == 0x6627E8D5


def _umask():
    import os

    m = os.umask(0)
    os.umask(m)
    return m


def test_std_that_the_dtype_cannot_hold_is_refused():
    s = native_rng.NativeStream(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="can hold"):
        s.fill_(torch.empty(8), 1e-50)  # 0 in float32: no noise at all
    assert s.fill_(torch.empty(8, dtype=torch.float64), 1e-50).abs().max() > 0


def test_sums_off_the_cpu_take_the_scratch_path():
    """A CPU generator with sums on another device (``meta`` standing in for CUDA): the noise is
    drawn on the CPU and moved, as for the other CPU sources."""
    from pdpsgd.fused import noise_and_scale

    sums = {"w": torch.empty(100, device="meta"), "b": torch.empty(3, 4, device="meta")}
    out = noise_and_scale(sums, 1.0, torch.Generator().manual_seed(0), 2.0, {n: torch.float32 for n in sums},
                          compile=False, rng="native")
    assert {n: (t.device.type, t.shape) for n, t in out.items()} == {n: ("meta", s.shape) for n, s in sums.items()}


def test_unwritable_cache_gives_a_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("PDPSGD_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(RuntimeError, match="PDPSGD_CACHE_DIR"):
        native_rng._build()


@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"), reason="x86-64 flags")
def test_portable_build_draws_the_same_stream(tmp_path, monkeypatch):
    """The kernel built without AVX2 (its scalar Philox, compiler-chosen vector width) gives the
    same words and, the transform's float ops being the same in the same order (ISO C: no FMA
    contraction), the same normals bit for bit as the build in use."""
    import ctypes

    monkeypatch.setenv("PDPSGD_CACHE_DIR", str(tmp_path))
    plain = native_rng._bind(ctypes.CDLL(str(native_rng._build(variants=(["-mno-avx2", "-mno-fma"],)))))
    fast = native_rng.require()
    for lib in (plain, fast):
        assert lib is not None
    words = [torch.empty(64 * 37, dtype=torch.int32) for _ in range(2)]
    for lib, w in zip((plain, fast), words):
        lib.pdpsgd_philox_raw(w.data_ptr(), 37, 2 ** 32 - 100, 11, 22, 33, 44)
    assert torch.equal(words[0], words[1])
    for dtype, f in ((torch.float32, "pdpsgd_normal_f32"), (torch.float64, "pdpsgd_normal_f64")):
        outs = [torch.ones(5000, dtype=dtype) for _ in range(2)]
        for lib, o in zip((plain, fast), outs):
            getattr(lib, f)(o.data_ptr(), o.numel(), 7, 1, 2, 3, 4, 0.5, 1, 3.0)
        assert torch.equal(outs[0], outs[1])


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(0, 400), min_size=1, max_size=6), chunk=st.one_of(st.none(), st.integers(1, 200)),
       dtype=st.sampled_from([torch.float32, torch.float64]), scale=st.floats(-4.0, 4.0), seed=st.integers(0, 2 ** 31))
def test_add_many_is_successive_adds_chunk_by_chunk(sizes, chunk, dtype, scale, seed):
    """One foreign call over many tensors (and their chunks) draws exactly what one ``add_`` per
    chunk, in turn, draws: bit for bit, and the stream ends at the same counter."""
    xs = [torch.randn(n, dtype=dtype) for n in sizes]
    a, b = [x.clone() for x in xs], [x.clone() for x in xs]
    s1 = native_rng.NativeStream(torch.Generator().manual_seed(seed))
    s2 = native_rng.NativeStream(torch.Generator().manual_seed(seed))
    s1.add_many(a, 0.7, scale, chunk)
    for t in b:
        step = chunk or max(1, t.numel())
        for i in range(0, t.numel(), step):
            s2.add_(t[i:i + step], 0.7, scale)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert s1.counter == s2.counter
    if sum(sizes):
        assert not all(torch.equal(x, y) for x, y in zip(a, xs) if x.numel())  # noise was added


def test_add_many_refuses_bad_input():
    s = native_rng.NativeStream(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="one dtype"):
        s.add_many([torch.zeros(3), torch.zeros(3, dtype=torch.float64)], 1.0, 1.0)
    with pytest.raises(ValueError, match="not contiguous"):
        s.add_many([torch.zeros(4, 4).t()], 1.0, 1.0)
    with pytest.raises(ValueError, match="std must be"):
        s.add_many([torch.zeros(3)], float("nan"), 1.0)
    assert s.counter == 0  # nothing reserved by a refused call
    s.add_many([], 1.0, 1.0)
    s.add_many([torch.zeros(0)], 1.0, 1.0)
    assert s.counter == 0


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=6), chunk=st.one_of(st.none(), st.integers(1, 700)),
       threads=st.integers(2, 5), dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2 ** 31))
def test_add_many_draws_the_same_bits_on_any_number_of_threads(sizes, chunk, threads, dtype, seed):
    """The pieces shared among threads (each piece's first counter fixed before they are shared)
    get exactly the draws of one thread, and the stream ends at the same counter."""
    xs = [torch.randn(n, dtype=dtype) for n in sizes]
    a, b = [x.clone() for x in xs], [x.clone() for x in xs]
    s1 = native_rng.NativeStream(torch.Generator().manual_seed(seed))
    s2 = native_rng.NativeStream(torch.Generator().manual_seed(seed))
    s1.add_many(a, 0.3, 0.5, chunk, threads=1)
    s2.add_many(b, 0.3, 0.5, chunk, threads=threads)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert s1.counter == s2.counter


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_large_pieces_on_several_threads_draw_the_same_bits(threads):
    """Pieces big enough for the threads to overlap in time (a race on shared scratch would show):
    4 M coordinates in the step's 64 K chunks and a ragged tail, against one thread."""
    from pdpsgd.fused import NOISE_CHUNK

    xs = [torch.randn((1 << 22) + 77), torch.randn(300_001)]
    a, b = [x.clone() for x in xs], [x.clone() for x in xs]
    native_rng.NativeStream(torch.Generator().manual_seed(1)).add_many(a, 0.2, 0.5, NOISE_CHUNK, threads=1)
    native_rng.NativeStream(torch.Generator().manual_seed(1)).add_many(b, 0.2, 0.5, NOISE_CHUNK, threads=threads)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_overlapping_tensors_are_taken_in_turn():
    """The same tensor twice (or overlapping views): two draws added in turn, as on one thread."""
    x = torch.randn(1 << 19)
    a, b = x.clone(), x.clone()
    native_rng.NativeStream(torch.Generator().manual_seed(2)).add_many([a, a[1000:]], 1.0, 1.0, 1 << 16, threads=1)
    native_rng.NativeStream(torch.Generator().manual_seed(2)).add_many([b, b[1000:]], 1.0, 1.0, 1 << 16, threads=4)
    assert torch.equal(a, b)
    assert native_rng._overlap([a, a[1000:]]) and not native_rng._overlap([a[:1000], a[1000:]])


def test_the_kernel_shares_torchs_openmp_threads():
    """Where torch runs on GNU OpenMP under its soname (x86-64 Linux wheels), the kernel is built
    with -fopenmp and binds to that same runtime: no second OpenMP runtime is mapped, and the
    step's noise is threaded. Anywhere: threaded only with one OpenMP runtime mapped."""
    import os

    assert not native_rng.threaded() or len(native_rng._omp_mapped()) == 1, native_rng._omp_mapped()
    if not (native_rng._openmp_possible()
            and any(os.path.basename(p) == "libgomp.so.1" for p in native_rng._gomp_mapped())):
        pytest.skip("torch does not run on a loaded libgomp.so.1 here")
    assert native_rng.threaded()
    assert len(native_rng._omp_mapped()) == 1, native_rng._omp_mapped()
    with pytest.raises(ValueError, match="threads must be an int"):
        native_rng.NativeStream(torch.Generator()).add_many([torch.zeros(3)], 1.0, 1.0, threads=0)


def test_openmp_and_plain_builds_draw_the_same_stream(tmp_path, monkeypatch):
    """The -fopenmp build, on 1 and on 3 threads, against the plain build: the same bits."""
    import ctypes

    if not native_rng._openmp_possible():
        pytest.skip("torch does not run on a loaded GNU OpenMP runtime here")
    monkeypatch.setenv("PDPSGD_CACHE_DIR", str(tmp_path))
    libs = [native_rng._open_library(native_rng._build(openmp=o), openmp=o) for o in (False, True)]
    sizes = [5000, 64, 1, 70000, 333]
    for dtype, f in ((torch.float32, "pdpsgd_normal_f32_many"), (torch.float64, "pdpsgd_normal_f64_many")):
        outs = []
        for lib, th in ((libs[0], 1), (libs[1], 1), (libs[1], 3)):
            xs = [torch.ones(n, dtype=dtype) for n in sizes]
            used = getattr(lib, f)((ctypes.c_void_p * 5)(*[x.data_ptr() for x in xs]), (ctypes.c_int64 * 5)(*sizes), 5,
                                   2 ** 32 - 7, 1, 2, 3, 4, 0.5, 1, 3.0, th)
            outs.append((used, xs))
        for used, xs in outs[1:]:
            assert used == outs[0][0] > 0
            assert all(torch.equal(x, y) for x, y in zip(xs, outs[0][1]))


def test_a_compiler_without_openmp_leaves_the_plain_kernel(tmp_path, monkeypatch):
    """-fopenmp refused (a compiler without OpenMP): the plain build is loaded, one thread."""
    if not native_rng._openmp_possible():
        pytest.skip("torch does not run on a loaded GNU OpenMP runtime here")
    monkeypatch.setenv("PDPSGD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native_rng, "_LIB", None)
    monkeypatch.setattr(native_rng, "_ERR", None)
    monkeypatch.setattr(native_rng, "_THREADED", True)
    monkeypatch.setattr(native_rng, "OPENMP_FLAGS", ["-fno-such-openmp-flag"])
    assert native_rng.available() and not native_rng.threaded()
    x = torch.zeros(1 << 18)
    native_rng.NativeStream(torch.Generator().manual_seed(0)).add_many([x], 1.0, 1.0, 1 << 16, threads=4)
    assert 0.9 < float(x.std()) < 1.1


def test_step_noise_follows_torchs_thread_count_with_the_same_bits(monkeypatch):
    """``noise_and_scale`` (the step's noise) on ``torch.get_num_threads()`` threads where the kernel
    is threaded, one below ``MIN_PER_THREAD`` a thread: the same bits as on one thread."""
    from pdpsgd.fused import noise_and_scale

    seen = []
    real_init = native_rng.NativeStream.__init__

    def init(self, generator):
        real_init(self, generator)
        self.lib = _ThreadsSeen(self.lib, seen)

    monkeypatch.setattr(native_rng.NativeStream, "__init__", init)
    sizes = {"w": (700, 1000), "b": (1000,), "tiny": (3,)}
    base = {n: torch.randn(s) for n, s in sizes.items()}
    threads = torch.get_num_threads()
    try:
        outs = []
        for th in (1, 3):
            torch.set_num_threads(th)
            sums = {n: t.clone() for n, t in base.items()}
            outs.append(noise_and_scale(sums, 1.0, torch.Generator().manual_seed(5), 4.0,
                                        {n: torch.float32 for n in sums}, compile=False, rng="native"))
        small = noise_and_scale({"b": base["b"].clone()}, 1.0, torch.Generator().manual_seed(5), 4.0,
                                {"b": torch.float32}, compile=False, rng="native")
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0][n], outs[1][n]) for n in sizes)
    assert seen == [1, 3 if native_rng.threaded() else 1, 1]  # (1000 coordinates: one thread)
    assert small["b"].shape == (1000,)


def test_threaded_draws_equal_the_documented_stream():
    """Shared among threads, the pieces' draws against the independent numpy Philox + float64
    Box–Muller of the documented layout (not only against the kernel on one thread)."""
    sizes = [5000, 70, (1 << 17) + 3, 64]
    outs = [torch.zeros(n) for n in sizes]
    s = native_rng.NativeStream(torch.Generator().manual_seed(9))
    s.add_many(outs, 0.5, 1.0, threads=3)
    blocks = [-(-n // 64) for n in sizes]
    ref = stream_ref(sum(blocks), s.key, s.nonce, torch.float32) * 0.5
    at = 0
    for x, nb in zip(outs, blocks):
        assert np.abs(x.double().numpy() - ref[at * 64: at * 64 + x.numel()]).max() <= 0.5e-6
        at += nb
    assert s.counter == sum(blocks) * 16


@pytest.mark.parametrize("region", ["all", "tail"])
def test_radius_follows_the_gaussian_law_in_the_bulk_and_beyond_5_77_sigma(region):
    """Against scipy as the independent reference: for a standard 2-d Gaussian r²/2 ~ Exp(1), and
    beyond r0 = √(48 ln 2) = 5.77 (the pairs whose top 24 radius bits are 0, 1 in 2^24) r²/2 − r0²/2 ~
    Exp(1) too (memoryless). Words from numpy's generator, 200 k pairs per region; the tail's pairs
    take the 64-bit uniform with its tail word (round 33: before, no radius went past 5.77)."""
    rng = np.random.default_rng(7)
    n = 200_000
    y = rng.integers(0, 2 ** 32, n, dtype=np.int64)
    x = rng.integers(0, 2 ** 32, n, dtype=np.int64) if region == "all" else rng.integers(0, 256, n, dtype=np.int64)
    e = rng.integers(0, 2 ** 32, n, dtype=np.int64)
    c, s = native_rng.box_muller_f32(torch.from_numpy(x), torch.from_numpy(y), e=torch.from_numpy(e))
    half_r2 = (c.double() ** 2 + s.double() ** 2).numpy() / 2
    if region == "tail":
        half_r2 = half_r2 - 24 * math.log(2)
        assert half_r2.min() > -1e-4 and half_r2.max() > 5  # (radii past 6.6σ occur: 1 in e^5 of the tail)
    assert stats.kstest(half_r2, "expon").pvalue > 1e-3


# ---- mutation review, round 45 (the native kernel, its stream and build: 92 mutants over native_rng, the C kernel,
# mkl_rng and _seeding; 25 real survivors; two bugs fixed: add_many with chunk <= 0 added no noise, silently; a std or
# scale past float32's range gave ±inf noise)


def _block_ref(key, nonce, first_counter):
    """The documented 64 float32 normals of the block whose first counter is ``first_counter``, and its words."""
    assert first_counter % 16 == 0
    w = philox_np(np.arange(first_counter, first_counter + 16, dtype=np.uint64), key, nonce)
    return stream_ref(1, key, nonce, torch.float32, first=first_counter // 16), w


# key, nonce and blocks found by search: in block 44264496 counter j = 4 has w2 = 31 (a tail on the
# w2 pair, l = 7988), in block 62140064 counter j = 4 has w0 = 4 (a tail on the w0 pair, l = 1201)
_RNG45_KEY, _RNG45_NONCE = (0x12345678, 0x9ABCDEF0), (0x0BADF00D, 0xDEADBEEF)


@pytest.mark.parametrize("block,word,pos", [(44264496, 2, 2 * 16 + 4), (62140064, 0, 4)])
def test_rng45_tail_pairs_take_their_own_tail_word(block, word, pos):
    """Beyond 5.77σ the radius uniform takes 24 more bits from the tail word of *its own* counter
    under the tail nonce (w0 pair: word 0, w2 pair: word 1). A stream positioned at a block with a
    tail pair on each of the two word pairs, against the independent numpy reference."""
    ref, w = _block_ref(_RNG45_KEY, _RNG45_NONCE, block)
    assert w[4, word] < 256  # the precondition, from the independent Philox
    s = native_rng.NativeStream(torch.Generator().manual_seed(0))
    s.key, s.nonce, s.counter = _RNG45_KEY, _RNG45_NONCE, block
    z = s.fill_(torch.empty(64), 1.0).double().numpy()
    assert math.hypot(ref[pos], ref[pos + 16]) > 5.77 and math.hypot(z[pos], z[pos + 16]) > 5.77  # the tail pair
    assert np.abs(z - ref).max() <= 1e-6 * np.abs(ref).max()
    # the tail pair to the documented bound (< 1e-6 absolute from float64 on the same float32 uniform):
    # another counter's or word's tail word moves it by more (here 1.3e-6 .. 6e-6)
    assert abs(z[pos] - ref[pos]) < 1e-6 and abs(z[pos + 16] - ref[pos + 16]) < 1e-6
    s.counter = block
    z3 = s.fill_(torch.empty(64, dtype=torch.float32), 3.0).double().numpy()
    assert np.abs(z3 - 3 * ref).max() <= 3e-6 * np.abs(ref).max()


def test_rng45_counter_space_is_never_wrapped():
    """A stream never runs past 2^64 counters (a wrap would repeat the noise of its first blocks):
    the last block is drawn (its counter carries into the high word), the next call is refused."""
    s = native_rng.NativeStream(torch.Generator().manual_seed(0))
    s.counter = 2 ** 64 - 16
    z = s.fill_(torch.empty(64), 1.0).double().numpy()
    ref, _ = _block_ref(s.key, s.nonce, 2 ** 64 - 16)
    assert np.abs(z - ref).max() <= 1e-6 * np.abs(ref).max()
    assert s.counter == 2 ** 64
    with pytest.raises(RuntimeError, match="exhausted"):
        s.fill_(torch.empty(1), 1.0)
    t = native_rng.NativeStream(torch.Generator().manual_seed(0))
    t.counter = 2 ** 64 - 16
    with pytest.raises(RuntimeError, match="exhausted"):
        t.add_many([torch.zeros(65)], 1.0, 1.0)
    assert t.counter == 2 ** 64 - 16  # nothing reserved by the refused call


def test_rng45_fill_overwrites_whatever_the_buffer_held():
    """``fill_`` writes N(0, std²): the buffer's old contents (NaN, inf from a scratch buffer) never
    reach the output, and the draws are those of a fresh buffer."""
    for dtype in (torch.float32, torch.float64):
        a = native_rng.NativeStream(torch.Generator().manual_seed(4)).fill_(torch.zeros(100, dtype=dtype), 1.0)
        junk = torch.full((100,), float("nan"), dtype=dtype)
        junk[::3] = float("inf")
        b = native_rng.NativeStream(torch.Generator().manual_seed(4)).fill_(junk, 1.0)
        assert torch.isfinite(b).all() and torch.equal(a, b)


def test_rng45_the_cache_key_covers_the_source_and_the_cpu(tmp_path, monkeypatch):
    """A changed kernel source (an upgrade) or another CPU's flags (a shared cache, -march=native)
    never reuses a cached library: each gets its own file name. (The compiler is faked: no build.)"""
    monkeypatch.setenv("PDPSGD_CACHE_DIR", str(tmp_path))
    real = native_rng._run

    def fake(cmd):
        if "--version" in cmd:
            return real(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(native_rng, "_run", fake)
    first = native_rng._build(variants=([],))
    src = tmp_path / "philox_normal.c"
    src.write_bytes(native_rng.SOURCE.read_bytes() + b"\n/* changed */\n")
    monkeypatch.setattr(native_rng, "SOURCE", src)
    changed = native_rng._build(variants=([],))
    assert changed != first
    monkeypatch.setattr(native_rng, "_cpu_flags", lambda: "fpu sse2 (another cpu)")
    other_cpu = native_rng._build(variants=([],))
    assert other_cpu not in (first, changed)


def test_rng45_native_key_and_nonce_are_four_full_32_bit_words():
    """Key and nonce are the generator's next four draws over the whole 32-bit range (a 31-bit draw
    would agree with seed 9's words, all below 2^31 by chance, but not with these seeds')."""
    big = 0
    for seed in range(8):
        w = torch.randint(0, 1 << 32, (4,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64).tolist()
        s = native_rng.NativeStream(torch.Generator().manual_seed(seed))
        assert (s.key, s.nonce) == (tuple(w[:2]), tuple(w[2:]))
        big += sum(x >= 1 << 31 for x in w)
    assert big >= 8  # (the precondition: high bits do occur in these words)


def test_rng45_overlapping_tensors_never_reach_the_kernel_on_several_threads(monkeypatch):
    """Overlapping tensors are handed to the kernel with one thread (two would read-add-write the
    same elements); disjoint ones with the requested count, where the kernel is threaded."""
    seen = []
    x = torch.zeros(1 << 18)
    s = native_rng.NativeStream(torch.Generator().manual_seed(2))
    s.lib = _ThreadsSeen(s.lib, seen)
    s.add_many([x, x[1000:]], 1.0, 1.0, 1 << 16, threads=4)
    s.add_many([x[:1000], x[1000:]], 1.0, 1.0, 1 << 16, threads=4)
    assert seen == [1, 4 if native_rng.threaded() else 1]


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_rng45_non_finite_scale_is_refused(scale):
    s = native_rng.NativeStream(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="scale must be a finite number"):
        s.add_(torch.zeros(8), 1.0, scale)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        s.add_many([torch.zeros(8)], 1.0, scale)
    assert s.counter == 0


@pytest.mark.parametrize("many", [False, True])
def test_rng45_a_kernel_count_that_disagrees_with_the_reservation_is_an_error(many):
    """The guard against reused counters: a kernel that reports another number of counters than
    were reserved is an error, never silently accepted."""

    class Liar:
        def __init__(self, lib):
            self._lib = lib

        def __getattr__(self, name):
            f = getattr(self._lib, name)
            return (lambda *a: f(*a) - 16) if name.startswith("pdpsgd_normal") else f

    s = native_rng.NativeStream(torch.Generator().manual_seed(0))
    s.lib = Liar(s.lib)
    with pytest.raises(RuntimeError, match="reserved"):
        if many:
            s.add_many([torch.zeros(100), torch.zeros(7)], 1.0, 1.0)
        else:
            s.add_(torch.zeros(100), 1.0, 1.0)


def test_rng45_box_muller_helper_takes_the_tail_for_every_word_below_256():
    """The audit helper's tail branch covers x < 256 exactly (x = 255: the last tail word; 256: the
    first bulk one), against the numpy reference with the tail words."""
    x = np.array([0, 1, 128, 254, 255, 256, 257, 511], dtype=np.int64)
    y = np.array([0x12345678, 0x9ABCDEF0, 0x0F0F0F0F, 0x77777777, 0x00ABCD12, 0x55555555, 0xFFFFFFFF, 0x1], dtype=np.int64)
    e = np.array([0xFFFFFFFF, 0x80000000, 0x12345678, 0xCAFEBABE, 0x0BADC0DE, 0x1, 0x2, 0x3], dtype=np.int64)
    c, s = native_rng.box_muller_f32(torch.from_numpy(x), torch.from_numpy(y), e=torch.from_numpy(e))
    rc, rs = box_muller_ref(x, y, e)
    # the documented bound, < 1e-6 absolute (x = 255 through the bulk formula is 2.6e-6 off)
    assert np.abs(c.double().numpy() - rc).max() < 1e-6
    assert np.abs(s.double().numpy() - rs).max() < 1e-6




def test_add_many_refuses_a_chunk_that_is_not_a_positive_int():
    """Review, round 45: a negative ``chunk`` gave no pieces (``range(0, n, -5)`` is empty), so the tensors were left as
    they were, without noise or scaling, and nothing was raised; 0, a bool or a float is refused too (numpy's ints are
    taken)."""
    for chunk in (0, -5, True, 2.0):
        s = native_rng.NativeStream(torch.Generator().manual_seed(0))
        x = torch.ones(1000)
        with pytest.raises(ValueError, match="chunk must be an int >= 1"):
            s.add_many([x], 1.0, 1.0, chunk=chunk)
        assert s.counter == 0 and bool((x == 1).all())
    for chunk in (300, np.int64(300)):
        s = native_rng.NativeStream(torch.Generator().manual_seed(0))
        x = torch.ones(1000)
        s.add_many([x], 1.0, 1.0, chunk=chunk)
        assert not bool((x == 1).any()) and s.counter == (3 * 5 + 2) * 16  # (pieces 300, 300, 300, 100: whole blocks of 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_std_or_scale_past_the_dtypes_range_is_refused(dtype):
    """Review, round 45: the message promised "a finite number > 0 that float32 can hold", but only underflow was
    checked: std = 1e39 filled a float32 tensor with ±inf, and a scale of 1e39 made every element inf. float64 holds
    both."""
    s = native_rng.NativeStream(torch.Generator().manual_seed(0))
    if dtype == torch.float32:
        with pytest.raises(ValueError, match="std must be a finite number > 0 that torch.float32 can hold"):
            s.fill_(torch.empty(8), 1e39)
        with pytest.raises(ValueError, match="scale must be a finite number that torch.float32 can hold"):
            s.add_(torch.ones(8), 1.0, 1e39)
        with pytest.raises(ValueError, match="scale must be a finite number"):
            s.add_many([torch.ones(8)], 1.0, -1e39)
        assert s.counter == 0
    else:
        assert bool(torch.isfinite(s.fill_(torch.empty(8, dtype=dtype), 1e39)).all())
        assert bool(torch.isfinite(s.add_(torch.ones(8, dtype=dtype), 1.0, 1e39)).all())
