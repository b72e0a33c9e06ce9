"""Noise std = σC within statistical tolerance (KS test on ≥ 10^6 draws), and the test has power."""
import ctypes
import math
import os
import warnings

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

import pdpsgd
from pdpsgd import mkl_rng as _mkl
from pdpsgd.fused import noise_and_scale


def add_noise(sums, std, generator):
    """The step's noise path with denom 1 and float32 (or wider) outputs."""
    dtypes = {n: torch.promote_types(s.dtype, torch.float32) for n, s in sums.items()}
    return noise_and_scale(sums, std, generator, 1.0, dtypes, compile=False)


def _noise_from_step(sigma, C, seed, noise_rng="torch"):
    torch.manual_seed(0)
    m = nn.Linear(2000, 1000)  # ~2M coordinates
    b = {"x": torch.randn(3, 2000), "y": torch.randint(0, 1000, (3,))}
    loss = lambda mod, bb: nn.functional.cross_entropy(mod(bb["x"]), bb["y"], reduction="none")
    params = pdpsgd.trainable_params(m)
    step = pdpsgd.make_dp_step(m, loss, max_grad_norm=C, noise_multiplier=sigma, expected_batch_size=1,
                               generator=torch.Generator().manual_seed(seed), noise_rng=noise_rng)
    part = step.clipped_sum(params, b)
    out = step.finalize(part)
    return torch.cat([(out.grads[n] - part.sums[n]).flatten() for n in params]).double().numpy()


def _mkl_available():
    from pdpsgd import mkl_rng

    return mkl_rng.available()


needs_mkl = pytest.mark.skipif(not _mkl_available(), reason="oneMKL runtime not installed (pip install mkl)")


def _native_available():
    from pdpsgd import native_rng

    return native_rng.available()


needs_native = pytest.mark.skipif(not _native_available(), reason="no C compiler to build pdpsgd's native noise kernel")
FAST_RNGS = [pytest.param("mkl", marks=needs_mkl), pytest.param("native", marks=needs_native), "numpy"]


@pytest.mark.parametrize("policy,rng", [("cpu_chunks", "torch"), ("one_draw", "torch"),
                                        pytest.param("cpu_chunks", "mkl", marks=needs_mkl),
                                        pytest.param("one_draw", "mkl", marks=needs_mkl),
                                        pytest.param("cpu_chunks", "native", marks=needs_native),
                                        pytest.param("one_draw", "native", marks=needs_native),
                                        ("cpu_chunks", "numpy"), ("one_draw", "numpy")])
def test_step_noise_is_gaussian_with_std_sigma_C(policy, rng, monkeypatch):
    """KS test of the step's noise on both streams: CPU chunks, and the accelerators' single draw
    (forced here on CPU); from torch's generator, oneMKL's Philox stream and pdpsgd's native one."""
    if policy == "one_draw":
        from pdpsgd import fused

        monkeypatch.setattr(fused, "noise_chunk", lambda gdev: None)
    sigma, C = 1.3, 0.7
    z = _noise_from_step(sigma, C, seed=11, noise_rng=rng)
    assert z.size >= 1_000_000
    res = stats.kstest(z, "norm", args=(0.0, sigma * C))
    assert res.pvalue > 1e-3, res
    assert abs(z.mean()) < 5 * sigma * C / math.sqrt(z.size)


def test_ks_test_catches_a_one_percent_error_in_sigma():
    """The same test, run on noise whose std is 1% off, rejects: it has the power we claim."""
    sigma, C = 1.3, 0.7
    z = _noise_from_step(sigma, C, seed=12)
    assert stats.kstest(z * 1.01, "norm", args=(0.0, sigma * C)).pvalue < 1e-3
    assert stats.kstest(z * 0.99, "norm", args=(0.0, sigma * C)).pvalue < 1e-3


def test_noise_is_float32_for_low_precision_sums():
    s = {"w": torch.zeros(1_000_000, dtype=torch.bfloat16)}
    out = add_noise(s, 1.0, torch.Generator().manual_seed(0))
    assert out["w"].dtype == torch.float32
    assert torch.unique(out["w"]).numel() > 900_000  # bf16 would give only a few thousand values


def test_independent_across_calls_and_coordinates():
    g = torch.Generator().manual_seed(3)
    a = add_noise({"w": torch.zeros(200_000)}, 1.0, g)["w"].double().numpy()
    b = add_noise({"w": torch.zeros(200_000)}, 1.0, g)["w"].double().numpy()
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.02
    assert abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < 0.02


def test_zero_sigma_adds_nothing():
    s = {"w": torch.randn(10)}
    assert torch.equal(add_noise(s, 0.0, None)["w"], s["w"])
    assert torch.equal(noise_and_scale(s, 0.0, None, 4.0, {"w": torch.float32})["w"], s["w"] / 4)


def test_consumed_sums_give_the_same_result_as_copied_ones_and_follow_draw_noise():
    from pdpsgd.fused import NOISE_CHUNK, draw_noise

    torch.manual_seed(0)
    shapes = {"big": (NOISE_CHUNK * 2 + 17,), "m": (7, 5), "tiny": (3,)}
    sums = {n: torch.randn(s) for n, s in shapes.items()}
    dtypes = {n: torch.float32 for n in sums}
    ref = noise_and_scale(sums, 0.3, torch.Generator().manual_seed(5), 4.0, dtypes, compile=False)
    z = draw_noise({n: s.shape for n, s in sums.items()}, torch.Generator().manual_seed(5), torch.float32,
                   torch.device("cpu"))
    owned = {n: s.clone() for n, s in sums.items()}
    got = noise_and_scale(owned, 0.3, torch.Generator().manual_seed(5), 4.0, dtypes, compile=False, consume=True)
    for n in sums:
        torch.testing.assert_close(ref[n], (sums[n] + 0.3 * z[n]) / 4.0)
        assert torch.equal(got[n], ref[n])
    assert got["big"].data_ptr() == owned["big"].data_ptr()  # written in place, not copied


def test_consume_never_writes_one_tensor_twice():
    s = torch.zeros(100)
    out = noise_and_scale({"a": s, "b": s}, 1.0, torch.Generator().manual_seed(0), 1.0,
                          {"a": torch.float32, "b": torch.float32}, compile=False, consume=True)
    assert not torch.equal(out["a"], out["b"])
    assert out["a"].std() < 1.2 and out["b"].std() < 1.2  # neither got two draws of noise


def test_accelerator_stream_draws_all_parameters_at_once(monkeypatch):
    """Generators off the CPU draw every parameter's noise in one normal_ call (one launch, not one
    per 64k coordinates); exercised here on CPU by forcing that policy."""
    from pdpsgd import fused

    monkeypatch.setattr(fused, "noise_chunk", lambda gdev: None)
    calls = []
    real = torch.Tensor.normal_

    def spy(self, *a, **k):
        calls.append(self.numel())
        return real(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "normal_", spy)
    shapes = {"big": (fused.NOISE_CHUNK * 3 + 5,), "m": (70, 50), "tiny": (3,)}
    total = sum(int(np.prod(s)) for s in shapes.values())
    sums = {n: torch.randn(s, dtype=torch.float64) for n, s in shapes.items()}
    dtypes = {n: torch.float32 for n in sums}
    out = noise_and_scale(sums, 0.7, torch.Generator().manual_seed(9), 5.0, dtypes, compile=False, rng="torch")
    assert calls == [total]  # one draw for all parameters
    # the stream: one standard-normal draw of all coordinates, cut in order
    z = torch.empty(total, dtype=torch.float64).normal_(generator=torch.Generator().manual_seed(9))
    off = 0
    for n, s in sums.items():
        k = s.numel()
        assert out[n].dtype == torch.float32
        torch.testing.assert_close(out[n], ((s + 0.7 * z[off:off + k].view(s.shape)) / 5.0).float())
        off += k
    zs = fused.draw_noise({n: s.shape for n, s in sums.items()}, torch.Generator().manual_seed(9), torch.float64,
                          torch.device("cpu"), rng="torch")
    assert torch.equal(torch.cat([v.reshape(-1) for v in zs.values()]), z)
    noise = (out["big"].double() * 5.0 - sums["big"]) / 0.7
    assert abs(float(noise.mean())) < 0.01 and abs(float(noise.std()) - 1) < 0.01


def test_noise_policy_by_generator_device_and_consume_on_the_one_draw_path(monkeypatch):
    from pdpsgd import fused

    assert fused.noise_chunk(torch.device("cpu")) == fused.NOISE_CHUNK
    assert fused.noise_chunk(torch.device("cuda")) is None and fused.noise_chunk(torch.device("mps")) is None
    monkeypatch.setattr(fused, "noise_chunk", lambda gdev: None)
    s = torch.zeros(100)
    out = noise_and_scale({"a": s, "b": s}, 1.0, torch.Generator().manual_seed(0), 1.0,
                          {"a": torch.float32, "b": torch.float32}, compile=False, consume=True)
    assert torch.equal(s, torch.zeros(100))  # a storage shared by two names is never written
    assert not torch.equal(out["a"], out["b"])
    own = {"w": torch.ones(50), "h": torch.ones(3, dtype=torch.bfloat16)}
    got = noise_and_scale(own, 0.5, torch.Generator().manual_seed(1), 2.0,
                          {"w": torch.float32, "h": torch.bfloat16}, compile=False, consume=True)
    assert got["w"].data_ptr() == own["w"].data_ptr()  # a float32 sum handed over is updated in place
    assert got["h"].dtype == torch.bfloat16


@pytest.mark.parametrize("rng", FAST_RNGS)
def test_philox_noise_is_keyed_by_the_generator_and_follows_draw_noise(rng):
    """Same generator seed: same noise (reproducible, resumable from the generator's state);
    another seed or the next call: different noise; ``draw_noise`` reproduces the stream; float64
    sums get float64 draws; consecutive calls are uncorrelated."""
    from pdpsgd.fused import NOISE_CHUNK, draw_noise

    shapes = {"big": (NOISE_CHUNK * 2 + 17,), "m": (7, 5), "tiny": (3,)}
    sums = {n: torch.randn(s) for n, s in shapes.items()}
    dtypes = {n: torch.float32 for n in sums}

    def run(seed, **kw):
        return noise_and_scale(sums, 0.3, torch.Generator().manual_seed(seed), 4.0, dtypes, compile=False, rng=rng, **kw)

    a, b, c = run(5), run(5), run(6)
    z = draw_noise(shapes, torch.Generator().manual_seed(5), torch.float32, torch.device("cpu"), 0.3 / 4.0, rng)
    for n in sums:
        assert torch.equal(a[n], b[n]) and not torch.equal(a[n], c[n])
        torch.testing.assert_close(a[n], sums[n] / 4.0 + z[n])
    g = torch.Generator().manual_seed(3)
    x = noise_and_scale({"w": torch.zeros(200_000)}, 1.0, g, 1.0, {"w": torch.float32}, compile=False, rng=rng)["w"]
    y = noise_and_scale({"w": torch.zeros(200_000)}, 1.0, g, 1.0, {"w": torch.float32}, compile=False, rng=rng)["w"]
    assert abs(np.corrcoef(x.double().numpy(), y.double().numpy())[0, 1]) < 0.02
    d = noise_and_scale({"w": torch.zeros(100_000, dtype=torch.float64)}, 1.0, g, 1.0, {"w": torch.float64},
                        compile=False, rng=rng)["w"]
    assert d.dtype == torch.float64 and abs(float(d.std()) - 1) < 0.02
    # the torch stream is a different one
    t = noise_and_scale(sums, 0.3, torch.Generator().manual_seed(5), 4.0, dtypes, compile=False, rng="torch")
    assert not torch.equal(t["big"], a["big"])


@pytest.mark.parametrize("rng", FAST_RNGS)
def test_philox_noise_compiled_equals_eager(rng):
    sums = {"a": torch.randn(1000), "b": torch.randn(30, 7)}
    dtypes = {n: torch.float32 for n in sums}
    e = noise_and_scale(sums, 0.5, torch.Generator().manual_seed(2), 3.0, dtypes, compile=False, rng=rng)
    c = noise_and_scale(sums, 0.5, torch.Generator().manual_seed(2), 3.0, dtypes, compile=True, rng=rng)
    for n in sums:
        torch.testing.assert_close(c[n], e[n], rtol=1e-6, atol=1e-7)


def test_noise_rng_is_checked():
    m = nn.Linear(2, 2)
    loss = lambda mod, bb: mod(bb["x"]).sum(1)
    with pytest.raises(ValueError, match="noise_rng"):
        pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=1.0, noise_rng="cupy")
    with pytest.raises(ValueError, match="noise_rng"):
        noise_and_scale({"w": torch.zeros(3)}, 1.0, None, 1.0, {"w": torch.float32}, compile=False, rng="nope")


def test_missing_mkl_runtime_gives_a_clear_error(monkeypatch):
    from pdpsgd import mkl_rng

    monkeypatch.setattr(mkl_rng, "_LIB", None)
    monkeypatch.setattr(mkl_rng, "_ERR", "libmkl_rt not found")
    m = nn.Linear(2, 2)
    loss = lambda mod, bb: mod(bb["x"]).sum(1)
    with pytest.raises(RuntimeError, match="pip install mkl"):
        pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=1.0, noise_rng="mkl")
    with pytest.raises(RuntimeError, match="pip install mkl"):
        noise_and_scale({"w": torch.zeros(3)}, 1.0, torch.Generator(), 1.0, {"w": torch.float32}, compile=False,
                        rng="mkl")


@needs_mkl
def test_mkl_noise_when_the_process_already_loaded_mkl():
    """numpy/scipy on MKL (conda) load libmkl_rt before pdpsgd does: the stream must still work, with
    the same values, and that MKL's threading layer is left alone (fresh processes)."""
    import subprocess
    import sys

    code = (
        "import ctypes, os, sys\n"
        "{pre}"
        "import torch, pdpsgd.mkl_rng as m\n"
        "assert m.available()\n"
        "with m.MKLStream(torch.Generator().manual_seed(4)) as s:\n"
        "    print(repr(s.fill_(torch.empty(9), 1.0).tolist()))\n"
    )
    from pdpsgd import mkl_rng

    path = next(p for p in mkl_rng._candidates() if os.path.exists(p))
    pre = f"ctypes.CDLL({path!r})\n"
    outs = [subprocess.run([sys.executable, "-c", code.format(pre=p)], capture_output=True, text=True, timeout=120)
            for p in ("", pre)]
    for r in outs:
        assert r.returncode == 0, r.stderr[-500:]
    assert outs[0].stdout == outs[1].stdout and len(eval(outs[0].stdout)) == 9


def _tiny_step(dtype=torch.float32, **kw):
    torch.manual_seed(0)
    m = nn.Linear(40, 30).to(dtype)
    b = {"x": torch.randn(3, 40, dtype=dtype)}
    loss = lambda mod, bb: mod(bb["x"]).pow(2).sum(1)
    step = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=3,
                               generator=torch.Generator().manual_seed(5), **kw)
    return step, pdpsgd.trainable_params(m), b


@needs_native
def test_auto_is_native_on_cpu_and_torch_elsewhere():
    """The default noise source: the native stream for float32 and float64 noise on the CPU (the same
    draws as noise_rng='native'; float64 was torch's normal_ before round 37, whose mt19937 words a
    released update gives back), torch's off the CPU."""
    step, params, b = _tiny_step()
    assert step.noise_rng == "auto" and step.noise_source() == "native"
    assert step.noise_source("cpu", torch.float64) == "native"
    assert pdpsgd.make_dp_step(nn.Linear(2, 2), lambda m, bb: m(bb).sum(1), max_grad_norm=1.0,
                               noise_multiplier=1.0).noise_source("cuda") == "torch"
    for dtype in (torch.float32, torch.float64):
        auto = _tiny_step(dtype)
        named = _tiny_step(dtype, noise_rng="native")
        with pytest.warns(UserWarning, match="mt19937"):
            other = _tiny_step(dtype, noise_rng="torch")
        ga, gn, go = (s(p, bb).grads for s, p, bb in (auto, named, other))
        for n in ga:
            assert torch.equal(ga[n], gn[n]), (dtype, n)
            assert not torch.equal(ga[n], go[n]), (dtype, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_auto_falls_back_to_numpys_philox_when_the_kernel_cannot_build(monkeypatch, dtype):
    """Without the kernel, "auto" draws from numpy's Philox keyed per step from the generator (review,
    round 37: it fell back to torch's CPU normal_, whose mt19937 state the released noise gives back):
    the same draws as noise_rng='numpy', not torch's, and every step a new key."""
    from pdpsgd import native_rng

    monkeypatch.setattr(native_rng, "available", lambda: False)
    with pytest.warns(UserWarning, match="native noise kernel is not available.*numpy's Philox"):
        auto = _tiny_step(dtype)
    named = _tiny_step(dtype, noise_rng="numpy")
    with pytest.warns(UserWarning, match="mt19937"):
        torch_ = _tiny_step(dtype, noise_rng="torch")
    assert auto[0].noise_source() == "numpy"
    ga, gn, gt = (s(p, bb).grads for s, p, bb in (auto, named, torch_))
    ga2 = auto[0](auto[1], auto[2]).grads  # the next step: another key
    for n in ga:
        assert ga[n].dtype == dtype
        assert torch.equal(ga[n], gn[n])
        assert not torch.equal(ga[n], gt[n])
        assert not torch.equal(ga[n], ga2[n])


def test_numpy_stream_is_numpys_philox_keyed_with_128_bits_from_the_generator():
    """The "numpy" source against numpy itself: Philox4x32-10 under the key of four 32-bit words the
    generator gives (low word first), float64 standard normals times std."""
    from pdpsgd.fused import draw_noise

    g = torch.Generator().manual_seed(3)
    words = torch.randint(0, 1 << 32, (4,), generator=torch.Generator().manual_seed(3), dtype=torch.int64).tolist()
    key = words[0] | words[1] << 32 | words[2] << 64 | words[3] << 96
    z = draw_noise({"a": torch.Size([70_000]), "b": torch.Size([5, 3])}, g, torch.float64, torch.device("cpu"),
                   std=2.5, rng="numpy")
    ref = np.random.Generator(np.random.Philox(key=key))
    want = np.concatenate([ref.standard_normal(65536), ref.standard_normal(70_000 - 65536), ref.standard_normal(15)])
    got = torch.cat([z["a"], z["b"].flatten()]).numpy()
    np.testing.assert_array_equal(got, want * 2.5)


def test_explicit_torch_noise_on_the_cpu_warns():
    """noise_rng='torch' on a CPU generator is for experiments: a warning says why (mt19937's state
    comes back from the released noise); σ = 0 draws nothing and does not warn."""
    with pytest.warns(UserWarning, match="mt19937 is linear over GF"):
        _tiny_step(noise_rng="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pdpsgd.make_dp_step(nn.Linear(2, 2), lambda m, bb: m(bb).sum(1), max_grad_norm=1.0, noise_multiplier=0.0,
                            noise_rng="torch")


@pytest.mark.parametrize("rng", ["torch", "auto"])
def test_noise_without_a_generator_never_uses_torchs_global_one(rng):
    """noise_and_scale / draw_noise with generator=None key a fresh generator from OS entropy (review,
    round 37: they drew from torch's global generator, whose seed keeps 32 bits): reseeding the
    global generator does not repeat the noise, and its state is not advanced."""
    from pdpsgd.fused import draw_noise

    sums = {"w": torch.zeros(500)}
    outs, states = [], []
    for _ in range(2):
        torch.manual_seed(0)
        before = torch.get_rng_state()
        outs.append(noise_and_scale(dict(sums), 1.0, None, 1.0, {"w": torch.float32}, compile=False, rng=rng)["w"])
        outs.append(draw_noise({"w": torch.Size([500])}, None, torch.float32, torch.device("cpu"), rng=rng)["w"])
        assert torch.equal(torch.get_rng_state(), before)
    assert not torch.equal(outs[0], outs[2]) and not torch.equal(outs[1], outs[3])


@needs_native
def test_default_step_noise_is_gaussian_with_std_sigma_C():
    """The KS test above, on the default source (what a user who sets nothing gets)."""
    sigma, C = 0.9, 1.1
    z = _noise_from_step(sigma, C, seed=13, noise_rng="auto")
    res = stats.kstest(z, "norm", args=(0.0, sigma * C))
    assert res.pvalue > 1e-3, res


@pytest.mark.parametrize("rng", ["torch"] + FAST_RNGS)
def test_a_tiny_noise_std_is_still_drawn(rng):
    """Mutation review, round 41: no test had a small σC, so treating a std below 1e-3 as zero
    (noise silently dropped) passed. σ = 0.5, C = 1e-4: std 5e-5."""
    sigma, C = 0.5, 1e-4
    z = _noise_from_step(sigma, C, seed=3, noise_rng=rng)
    res = stats.kstest(z, "norm", args=(0.0, sigma * C))
    assert res.pvalue > 1e-3, res
    out = noise_and_scale({"w": torch.zeros(100_000)}, 1e-7, torch.Generator().manual_seed(0), 1.0,
                          {"w": torch.float32}, compile=False, rng=rng)
    assert abs(float(out["w"].double().std()) / 1e-7 - 1) < 0.02

@pytest.mark.parametrize("rng", ["torch"] + FAST_RNGS)
def test_consume_writes_disjoint_views_of_one_storage_in_place_and_copies_overlapping_ones(rng):
    """Rows of one stacked sum (disjoint regions of a storage) are overwritten in place like any
    owned sum; a sum whose memory another sum's overlaps is copied (neither gets two draws); the
    noise is what the copying path draws, in the order of the sums."""
    from pdpsgd.fused import _overlapping

    stack = torch.randn(3, 50)
    base = torch.randn(40)
    def make():
        torch.manual_seed(1)
        st2, b2 = stack.clone(), base.clone()
        return st2, b2, {"r0": st2[0], "x": torch.randn(0), "r1": st2[1], "r2": st2[2], "o1": b2[:30], "o2": b2[20:],
                         "f64": torch.randn(9, dtype=torch.float64), "w": torch.randn(6, 7)}
    _, _, sums = make()
    assert _overlapping(sums) == {"o1", "o2"}
    assert _overlapping({"a": base, "b": base}) == {"a", "b"}
    assert _overlapping({"a": stack[:, 0], "b": stack[1]}) == {"a", "b"}  # a strided sum: all its storage
    dtypes = {n: s.dtype for n, s in sums.items()}
    _, _, ref_in = make()
    ref = noise_and_scale(ref_in, 0.3, torch.Generator().manual_seed(5), 4.0, dtypes, compile=False, rng=rng)
    st2, b2, owned = make()
    b2_before = b2.clone()
    got = noise_and_scale(owned, 0.3, torch.Generator().manual_seed(5), 4.0, dtypes, compile=False, consume=True,
                          rng=rng)
    from pdpsgd.fused import draw_noise

    z = draw_noise({n: t.shape for n, t in sums.items()}, torch.Generator().manual_seed(5), torch.float64,
                   torch.device("cpu"), 0.3 / 4.0, rng)  # (float64 draws: one sum is float64)
    for n in sums:
        assert torch.equal(got[n], ref[n]), n
        torch.testing.assert_close(got[n], (ref_in[n].double() / 4.0 + z[n]).to(dtypes[n]))
    for j in range(3):
        assert got[f"r{j}"].data_ptr() == st2[j].data_ptr()  # in place
    assert torch.equal(b2, b2_before)  # the overlapping ones were copied, their storage left as it was
    assert float((got["o1"][20:] - got["o2"][:10]).abs().min()) > 0  # two independent draws on the overlap


@pytest.mark.parametrize("n", [5, 70_000])
def test_torch_path_draws_float32_noise_from_float64_normals(n, monkeypatch):
    """Review, round 33: torch's float32 ``normal_`` takes 24-bit uniforms (CPU), so its tails end at
    5.77σ and an output beyond one dataset's reach but within a neighbour's tells them apart. The
    torch path now draws float64 normals (53-bit uniforms, 8.57σ) and casts them: the same values as
    a float64 draw from the same generator, in pieces of ``WIDE_PIECE``."""
    from pdpsgd import fused

    monkeypatch.setattr(fused, "WIDE_PIECE", 4096)  # several pieces
    got = fused.draw_noise({"w": torch.Size([n])}, torch.Generator().manual_seed(5), torch.float32,
                           torch.device("cpu"), std=2.0, rng="torch")["w"]
    g = torch.Generator().manual_seed(5)
    want = []
    for a, b in fused._chunks(n):  # the CPU path's 64k chunks, each filled in 4096-coordinate pieces
        for c in range(a, b, 4096):
            want.append(torch.empty(min(b, c + 4096) - c, dtype=torch.float64).normal_(0.0, 2.0, generator=g))
    assert got.dtype == torch.float32 and torch.equal(got, torch.cat(want).float())


@pytest.mark.parametrize("std", [0.0, 0.7])
def test_a_compile_backend_that_cannot_run_falls_back_to_eager(monkeypatch, std):
    """torch.compile's backend can fail at the first call (no C++ compiler for inductor, a CUDA wheel
    without triton; review, round 36: the step raised from finalize): the same noise is added eagerly,
    with one warning, and later calls do not try again."""
    from pdpsgd import fused

    calls = []

    def broken():
        def run(*a, **k):
            calls.append(1)
            raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")
        return run

    monkeypatch.setattr(fused, "_compiled", broken)
    monkeypatch.setattr(fused, "_COMPILE_FAILED", None)
    sums = {"w": torch.randn(5, 3), "b": torch.randn(3, dtype=torch.float64)}
    dtypes = {"w": torch.float32, "b": torch.float64}
    want = noise_and_scale(sums, std, torch.Generator().manual_seed(3), 4.0, dtypes, compile=False, rng="torch")
    with pytest.warns(UserWarning, match="InvalidCxxCompiler.*eager"):
        got = noise_and_scale(sums, std, torch.Generator().manual_seed(3), 4.0, dtypes, compile=True, rng="torch")
    for n in want:
        assert got[n].dtype == want[n].dtype
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = noise_and_scale(sums, std, torch.Generator().manual_seed(3), 4.0, dtypes, compile=True, rng="torch")
    assert len(calls) == 1
    for n in want:
        torch.testing.assert_close(again[n], want[n], rtol=1e-6, atol=1e-7)


def test_out_of_memory_in_the_compiled_noise_is_not_taken_for_a_backend_failure(monkeypatch):
    """An out-of-memory raised by the compiled function is raised as it is: not reported as a backend
    that cannot build, and compile is not turned off for the process (review, round 36)."""
    from pdpsgd import fused

    def oom():
        def run(*a, **k):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return run

    monkeypatch.setattr(fused, "_compiled", oom)
    monkeypatch.setattr(fused, "_COMPILE_FAILED", None)
    sums = {"w": torch.randn(5, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(torch.cuda.OutOfMemoryError):
            noise_and_scale(sums, 0.5, torch.Generator().manual_seed(3), 4.0, {"w": torch.float32}, compile=True,
                            rng="torch")
    assert fused._COMPILE_FAILED is None


class _WithScalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(300, 200)
        self.gain = nn.Parameter(torch.ones(()))  # one coordinate
        self.bias1 = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return self.lin(x) * self.gain + self.bias1


@pytest.mark.parametrize("clipping", ["flat", "per_layer", "groups"])
def test_every_parameter_gets_noise_of_std_sigma_C_under_every_clipping(clipping):
    """Mutation review, round 40: noise 10 % low under per-layer / group clipping, or no noise for a
    one-element parameter, went unnoticed (the KS test pooled one flat-clipped Linear's coordinates).
    The step's own noise on a zero sum (an empty batch: noise alone), per parameter: the sensitivity
    of the whole sum is max_grad_norm however it is split, so every coordinate's std is σ·C."""
    torch.manual_seed(0)
    m = _WithScalar()
    params = pdpsgd.trainable_params(m)
    spec = {"flat": "flat", "per_layer": "per_layer",
            "groups": [["lin.weight"], ["lin.bias", "gain", "bias1"]]}[clipping]
    sigma, C = 1.3, 0.7
    loss = lambda mod, b: mod(b["x"]).pow(2).sum(1)
    step = pdpsgd.make_dp_step(m, loss, max_grad_norm=C, noise_multiplier=sigma, expected_batch_size=1,
                               clipping=spec, generator=torch.Generator().manual_seed(5))
    assert step.noise_std == pytest.approx(sigma * C)
    empty = {"x": torch.zeros(0, 300)}
    draws = {n: [] for n in params}
    for _ in range(400):
        out = step(params, empty)
        for n in params:
            draws[n].append(out.grads[n].flatten()[:50].double())
    for n, d in draws.items():
        z = torch.cat(d).numpy()
        # (400 draws of a one-element parameter: its std within ~5 standard errors of σC)
        tol = 5 / math.sqrt(2 * z.size)
        assert abs(z.std() / (sigma * C) - 1) < tol, (n, z.std(), sigma * C, z.size)
    z = np.concatenate([torch.cat(d).numpy() for d in draws.values()])
    assert stats.kstest(z, "norm", args=(0.0, sigma * C)).pvalue > 1e-3


# -- mutation review, round 41 -----------------------------------------------------------------------

def test_compiled_noise_on_low_precision_parameters_equals_eager():
    """bf16 / fp16 parameters: float32 sum + float32 noise, cast once, compiled as eager (a compiled
    path that cast the noise to bf16 before the add differed in ~2 % of the coordinates)."""
    torch.manual_seed(0)
    for pdt in (torch.bfloat16, torch.float16):
        sums = {"w": torch.randn(20000) * 3, "b": torch.randn(300)}
        dt = {n: pdt for n in sums}
        e = noise_and_scale(sums, 0.05, torch.Generator().manual_seed(3), 2.0, dt, compile=False, rng="numpy")
        c = noise_and_scale(sums, 0.05, torch.Generator().manual_seed(3), 2.0, dt, compile=True, rng="numpy")
        for n in sums:
            assert e[n].dtype == c[n].dtype == pdt and torch.equal(e[n], c[n]), (pdt, n)


@pytest.mark.parametrize("rng", ["torch"] + FAST_RNGS)
def test_consume_leaves_a_low_precision_sum_to_the_copying_path(rng):
    """A bf16 sum is not overwritten in place by consume=True (its noise would be added in bf16):
    the release is bitwise that of consume=False."""
    base = (torch.randn(50000, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    dt = {"w": torch.bfloat16}
    kw = dict(compile=False, rng=rng)
    ref = noise_and_scale({"w": base.clone()}, 0.05, torch.Generator().manual_seed(1), 3.0, dt, **kw)
    got = noise_and_scale({"w": base.clone()}, 0.05, torch.Generator().manual_seed(1), 3.0, dt, consume=True, **kw)
    assert torch.equal(ref["w"], got["w"])


def test_overlap_scan_sees_a_span_inside_a_long_one_after_a_short_one():
    from pdpsgd.fused import _overlapping

    st = torch.zeros(100)
    sums = {"C": st[30:40], "B": st[10:20], "A": st[0:100]}
    assert _overlapping(sums) == {"A", "B", "C"}
    assert _overlapping({"x": st[0:10], "y": st[10:20], "z": st[20:30]}) == set()
    orig = {n: s.clone() for n, s in sums.items()}
    f32 = {n: torch.float32 for n in sums}
    out = noise_and_scale(sums, 1.0, torch.Generator().manual_seed(0), 1.0, f32, compile=False, consume=True,
                          rng="numpy")
    ref = noise_and_scale(orig, 1.0, torch.Generator().manual_seed(0), 1.0, f32, compile=False, rng="numpy")
    for n in sums:
        assert torch.equal(out[n], ref[n]), n


# ---- mutation review, round 45: the oneMKL stream's keying and its refusals


@needs_mkl
@pytest.mark.parametrize("seed", [0, 12345])
def test_rng45_mkl_stream_is_philox_keyed_by_two_full_generator_words(seed):
    """The oneMKL stream is VSL_BRNG_PHILOX4X32X10 (16 << 20) keyed by the generator's next two 32-bit
    words (both taken: a 64-bit key) and drawn with VSL_RNG_METHOD_GAUSSIAN_BOXMULLER2 (1): the same
    values as that stream opened here by hand, and the generator advances by exactly those words."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(0, 1 << 32, (2,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)
    assert int(words.max()) >= 1 << 16
    lib = _mkl.require()
    ref = {}
    for dtype, fn in ((torch.float32, "vsRngGaussian"), (torch.float64, "vdRngGaussian")):
        stream = ctypes.c_void_p()
        assert lib.vslNewStreamEx(ctypes.byref(stream), 16 << 20, 2, (ctypes.c_uint32 * 2)(*words.tolist())) == 0
        out = torch.empty(1001, dtype=dtype)
        assert getattr(lib, fn)(1, stream, out.numel(), out.data_ptr(), 0.0, 0.7) == 0
        lib.vslDeleteStream(ctypes.byref(stream))
        ref[dtype] = out
    with _mkl.MKLStream(g) as s:
        got32 = s.fill_(torch.empty(1001), 0.7)
    after = torch.Generator().manual_seed(seed)
    torch.randint(0, 1 << 32, (2,), generator=after, dtype=torch.int64)
    assert torch.equal(g.get_state(), after.get_state())
    assert torch.equal(got32, ref[torch.float32])
    with _mkl.MKLStream(torch.Generator().manual_seed(seed)) as s:
        assert torch.equal(s.fill_(torch.empty(1001, dtype=torch.float64), 0.7), ref[torch.float64])


@needs_mkl
def test_rng45_mkl_fill_refuses_what_it_cannot_fill_in_place():
    """oneMKL writes n consecutive values from the data pointer: a strided view would get noise on
    other elements than its own (half of them never drawn), so it is refused, as are other dtypes
    and a σ that is not > 0."""
    with _mkl.MKLStream(torch.Generator().manual_seed(0)) as s:
        with pytest.raises(ValueError, match="contiguous"):
            s.fill_(torch.zeros(10, 2)[:, 0], 1.0)
        with pytest.raises(ValueError, match="contiguous"):
            s.fill_(torch.zeros(4, dtype=torch.float16), 1.0)
        with pytest.raises(ValueError, match="std must be a finite number > 0"):
            s.fill_(torch.zeros(4), 0.0)
        for std in (float("inf"), 1e39):  # (round 45 review: inf passed, and float32 cannot hold 1e39)
            with pytest.raises(ValueError, match="std must be a finite number > 0 that torch.float32 can hold"):
                s.fill_(torch.zeros(4), std)
        with pytest.raises(ValueError, match="std must be a finite number > 0 that torch.float32 can hold"):
            s.fill_(torch.zeros(4), 1e-50)  # (0 in float32: no noise)
        assert bool(torch.isfinite(s.fill_(torch.zeros(4, dtype=torch.float64), 1e39)).all())
