"""The vmap DP step against the naive per-example oracle (float64), and its DP properties."""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st
from torch import nn

import pdpsgd
from pdpsgd.testing import assert_exact, naive_per_sample_grads, to_float64
from models import SharedTwice, TextCNN, TiedLM, cls_loss, lm_loss_fn, mlp, mlp_loss


def mlp_case(seed, B, d_in, hidden, n_out=3):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    m = mlp(d_in, hidden, n_out).double()
    b = {"x": torch.randn(B, d_in, generator=g, dtype=torch.float64) * 3,
         "y": torch.randint(0, n_out, (B,), generator=g)}
    return m, b


@given(
    seed=st.integers(0, 10_000),
    B=st.integers(1, 9),
    d_in=st.integers(1, 6),
    hidden=st.integers(1, 8),
    chunk=st.integers(1, 10),
    C=st.floats(0.01, 10.0),
    clipping=st.sampled_from(["flat", "per_layer"]),
    clip_fn=st.sampled_from(["abadi", "automatic"]),
    mask_bits=st.integers(0, 2**9 - 1),
)
def test_mlp_matches_oracle(seed, B, d_in, hidden, chunk, C, clipping, clip_fn, mask_bits):
    m, b = mlp_case(seed, B, d_in, hidden)
    mask = torch.tensor([(mask_bits >> i) & 1 == 1 for i in range(B)])
    assert_exact(m, mlp_loss, b, chunk_size=chunk, max_grad_norm=C, clipping=clipping, clip_fn=clip_fn,
                 mask=mask, rtol=1e-9, allow_empty=True)  # (an all-padding batch: its sums must be 0)


@given(seed=st.integers(0, 10_000), B=st.integers(2, 9), c1=st.integers(1, 9), c2=st.integers(1, 9))
def test_chunk_size_invariance(seed, B, c1, c2):
    m, b = mlp_case(seed, B, 4, 5)
    params = pdpsgd.trainable_params(m)
    outs = [pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=0.3, noise_multiplier=0.0, chunk_size=c)(params, b)
            for c in (c1, c2)]
    for n in params:
        torch.testing.assert_close(outs[0].grads[n], outs[1].grads[n], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(outs[0].per_sample_norms, outs[1].per_sample_norms, rtol=1e-12, atol=0)


@given(seed=st.integers(0, 10_000), C=st.floats(1e-3, 5.0), clipping=st.sampled_from(["flat", "per_layer"]),
       clip_fn=st.sampled_from(["abadi", "automatic"]))
def test_each_contribution_bounded_by_C(seed, C, clipping, clip_fn):
    """Every example's clipped contribution (σ=0, one example alone) has norm ≤ C."""
    m, b = mlp_case(seed, 6, 4, 5)
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=1,
                               clipping=clipping, clip_fn=clip_fn)
    params = pdpsgd.trainable_params(m)
    for i in range(6):
        one = {k: v[i : i + 1] for k, v in b.items()}
        s = step.clipped_sum(params, one).sums
        norm = math.sqrt(sum(float(v.pow(2).sum()) for v in s.values()))
        assert norm <= C * (1 + 1e-12)


@given(seed=st.integers(0, 10_000), B=st.integers(1, 8), i=st.integers(0, 7), C=st.floats(1e-2, 3.0))
def test_neighbouring_batches_move_sum_by_at_most_C(seed, B, i, C):
    i = i % B
    m, b = mlp_case(seed, B, 4, 5)
    b2 = {k: v.clone() for k, v in b.items()}
    b2["x"][i] = torch.randn(4, dtype=torch.float64) * 100  # replace one example (and drop it below)
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=1)
    params = pdpsgd.trainable_params(m)
    s1 = step.clipped_sum(params, b).sums
    s2 = step.clipped_sum(params, b2).sums
    mask = torch.ones(B, dtype=torch.bool)
    mask[i] = False
    s3 = step.clipped_sum(params, b, mask).sums  # removal of example i
    d_remove = math.sqrt(sum(float((s1[n] - s3[n]).pow(2).sum()) for n in s1))
    d_replace = math.sqrt(sum(float((s1[n] - s2[n]).pow(2).sum()) for n in s1))
    assert d_remove <= C * (1 + 1e-12)
    assert d_replace <= 2 * C * (1 + 1e-12)


@given(seed=st.integers(0, 10_000), B=st.integers(1, 8))
def test_no_clip_no_noise_is_the_ordinary_mean_gradient(seed, B):
    m, b = mlp_case(seed, B, 4, 5)
    out = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=math.inf, noise_multiplier=0.0)(pdpsgd.trainable_params(m), b)
    m.zero_grad()
    mlp_loss(m, b).mean().backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(out.grads[n], p.grad, rtol=1e-10, atol=1e-13)
    assert float(out.clip_fraction) == 0.0


def test_output_fields_and_self_description():
    m, b = mlp_case(0, 8, 4, 5)
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=0.5, noise_multiplier=1.3, expected_batch_size=16,
                               generator=torch.Generator().manual_seed(1))
    assert step.sensitivity == 0.5 and step.noise_std == pytest.approx(0.65)
    out = step(pdpsgd.trainable_params(m), b, mask=torch.tensor([True] * 6 + [False] * 2))
    assert set(out.grads) == {n for n, _ in m.named_parameters()}
    assert out.per_sample_norms.shape == (8,)
    assert int(out.num_examples) == 6 and int(out.num_nonfinite) == 0
    losses = mlp_loss(m, b)[:6]
    torch.testing.assert_close(out.loss, losses.mean().detach())
    assert 0.0 <= float(out.clip_fraction) <= 1.0
    assert "Formal guarantee" in pdpsgd.DPStep.__doc__


def test_numeric_options_take_numpy_and_tensor_scalars_and_refuse_the_rest():
    import numpy as np
    m, b = mlp_case(0, 4, 3, 4)
    for kw in ({"noise_multiplier": np.float32(1.5), "max_grad_norm": np.float64(0.5)},
               {"noise_multiplier": torch.tensor(1.5), "max_grad_norm": torch.tensor(0.5), "expected_batch_size": np.int64(4)}):
        step = pdpsgd.make_dp_step(m, mlp_loss, **kw)
        assert step.sensitivity == 0.5 and step.noise_std == pytest.approx(0.75)
        assert isinstance(step.noise_multiplier, float)
    with pytest.raises(TypeError, match="max_grad_norm must be a real number, got builtins.str"):
        pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm="1", noise_multiplier=1.0)
    for bad in (float("inf"), float("nan"), 0, -2):
        with pytest.raises(ValueError, match="expected_batch_size must be a finite number > 0"):
            pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=bad)


@pytest.mark.parametrize("method", ["vmap", "bk"])
def test_a_divisor_that_follows_a_changing_batch_size_warns(method, recwarn):
    """Without expected_batch_size the step divides by each batch's size: fine for fixed-size
    batches, a leak of the (private) size for Poisson ones: warned once, when the size changes."""
    m, _ = mlp_case(0, 4, 3, 4)
    params = pdpsgd.trainable_params(m)
    batch = lambda B: mlp_case(B, B, 3, 4)[1]  # noqa: E731
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0, method=method)
    for B in (5, 5, 5):
        step(params, batch(B))
    assert not [w for w in recwarn if "expected_batch_size" in str(w.message)]
    with pytest.warns(UserWarning, match=r"batch size changed between steps \(5 -> 6\)") as rec:
        step(params, batch(6))
    assert {w.filename for w in rec} == {__file__}  # (the caller's line, not one inside pdpsgd)
    fixed = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=5,
                                method=method)
    for B in (5, 6, 4):
        fixed(params, batch(B))
    assert not [w for w in recwarn if "expected_batch_size" in str(w.message)]


def test_plan_and_fallback_reasons_default_to_the_trained_parameters():
    m, b = mlp_case(0, 4, 3, 4)
    m[0].requires_grad_(False)
    for method in ("vmap", "bk"):
        step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=0.0, method=method)
        assert set(step.plan(b)) == set(pdpsgd.trainable_params(m)) == set(step(pdpsgd.trainable_params(m), b).grads)
        assert set(step.fallback_reasons(b)) <= set(pdpsgd.trainable_params(m))


def test_same_seed_same_noise_and_different_seed_differs():
    m, b = mlp_case(0, 4, 4, 5)
    params = pdpsgd.trainable_params(m)
    def run(seed):
        return pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0,
                                   generator=torch.Generator().manual_seed(seed))(params, b).grads
    a, a2, c = run(7), run(7), run(8)
    for n in a:
        assert torch.equal(a[n], a2[n])
    assert any(not torch.equal(a[n], c[n]) for n in a)
    # OS-entropy generators never repeat.
    e1 = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0)(params, b).grads
    e2 = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0)(params, b).grads
    assert any(not torch.equal(e1[n], e2[n]) for n in e1)


def test_padding_examples_contribute_exactly_nothing():
    m, b = mlp_case(3, 6, 4, 5)
    params = pdpsgd.trainable_params(m)
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=0.7, noise_multiplier=0.0, expected_batch_size=1)
    mask = torch.tensor([True, False, True, False, False, True])
    garbage = {k: v.clone() for k, v in b.items()}
    garbage["x"][~mask] = float("nan")
    s_masked = step.clipped_sum(params, garbage, mask).sums
    s_sub = step.clipped_sum(params, {k: v[mask] for k, v in b.items()}).sums
    for n in s_sub:
        torch.testing.assert_close(s_masked[n], s_sub[n], rtol=1e-13, atol=0)


@pytest.mark.parametrize("poison", ["nan", "inf", "huge"])
def test_nonfinite_example_is_dropped_and_counted(poison):
    torch.manual_seed(5)
    m = nn.Linear(4, 3)  # float32; a 1e30 input overflows the float32 squared norm
    b = {"x": torch.randn(6, 4), "y": torch.randint(0, 3, (6,))}
    bad = {k: v.clone() for k, v in b.items()}
    bad["x"][2] = {"nan": float("nan"), "inf": float("inf"), "huge": 1e30}[poison]
    bad["y"][2] = int(m(bad["x"][2:3]).argmin()) if poison == "huge" else bad["y"][2]
    params = pdpsgd.trainable_params(m)
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1)
    out = step(params, bad)
    assert int(out.num_nonfinite) == 1
    keep = torch.tensor([True, True, False, True, True, True])
    ref = step(params, {k: v[keep] for k, v in b.items()})
    for n in params:
        assert torch.isfinite(out.grads[n]).all()
        torch.testing.assert_close(out.grads[n], ref.grads[n], rtol=1e-5, atol=1e-6)
    assert math.isfinite(float(out.loss))
    with pytest.raises(FloatingPointError, match="non-finite") as err:
        pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=0.0, on_nonfinite="raise")(params, bad)
    assert "float16" not in str(err.value)


def test_an_fp16_overflow_is_named_in_the_error():
    """An fp16 model's gradient entry past 65504 is inf (eager autograd's too): the example is dropped
    and counted, and on_nonfinite='raise' says it is fp16's range (review, round 37: it read as bad data)."""
    torch.manual_seed(0)
    m = nn.Linear(32, 32).half()
    loss = lambda mod, bb: (mod(bb["x"]).float() * 100).sum((1, 2))
    b = {"x": torch.full((3, 8, 32), 100.0).half()}
    params = pdpsgd.trainable_params(m)
    out = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, method="vmap")(params, b)
    assert int(out.num_nonfinite) == 3
    with pytest.raises(FloatingPointError, match="float16 parameters.*65504"):
        pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, method="vmap",
                            on_nonfinite="raise")(params, b)


@pytest.mark.parametrize("method", ["vmap", "bk"])
def test_an_fp16_gradient_that_the_noise_overflows_is_an_error_not_inf(method):
    """Review, round 38: fp16 loss scaling (loss and C scaled by 2^16 together) put the float32 noisy
    mean past 65504 and its cast to float16 handed ±inf to the optimizer (9 of 27 coordinates),
    silently. It is now an OverflowError that says so and how to fix it; float32 params (with float32
    inputs) give float32 gradients, finite; at a moderate scale fp16 gradients are returned."""
    torch.manual_seed(0)
    m = nn.Linear(8, 3).half()
    S = 2.0 ** 16
    loss = lambda mod, b: S * F.cross_entropy(mod(b[0]).float(), b[1], reduction="none")
    step = pdpsgd.make_dp_step(m, loss, max_grad_norm=S, noise_multiplier=1.0, expected_batch_size=1, method=method,
                               generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 3, (2,))
    with pytest.raises(OverflowError, match="'weight' overflows float16 .*scale the loss and max_grad_norm down"):
        step(pdpsgd.trainable_params(m), (torch.randn(2, 8).half(), y))
    master = {n: p.detach().float() for n, p in m.named_parameters()}
    out = step(master, (torch.randn(2, 8), y))
    assert all(g.dtype == torch.float32 and bool(torch.isfinite(g).all()) for g in out.grads.values())
    calm = pdpsgd.make_dp_step(m, loss, max_grad_norm=S, noise_multiplier=1.0, expected_batch_size=1e3, method=method)
    out = calm(pdpsgd.trainable_params(m), (torch.randn(2, 8).half(), y))
    assert all(g.dtype == torch.float16 and bool(torch.isfinite(g).all()) for g in out.grads.values())


class _Caching(nn.Module):
    """Keeps its last output as a plain attribute, and a table with the length it was made for."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(5, 3)
        self.cache = self.kv = None
        self.hist, self.store = [], {}  # (filled in place: the same objects)
        self.table, self.table_len = torch.zeros(2), 2

    def forward(self, x):
        y = self.l(x)
        self.cache = y.detach()
        self.kv = (y.detach(), {"v": y.detach()})
        self.hist.append(y.detach())
        self.store["k"] = y.detach()
        if x.shape[0] > self.table_len:
            self.table, self.table_len = torch.arange(float(x.shape[0])), int(x.shape[0])
        return y


class _ListedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(5, 3)
        self.lst = [self.l.weight]  # (a reference the step cannot swap)

    def forward(self, x):
        return self.l(x) + x @ self.lst[0].T


@pytest.mark.parametrize("method", ["vmap", "bk"])
def test_the_step_leaves_no_tensor_attributes_graphs_or_missed_strays(method):
    """Review, round 38: a tensor the forward kept as a plain attribute stayed after the step (under
    vmap a functorch wrapper: deepcopy and torch.save failed, and it held the chunk's activations);
    the returned grads, norms and loss kept a graph back to a batch input that required grad; a
    parameter passed in params but frozen on the model escaped the check for uses the step cannot
    see (its gradient 4.1 off, silently)."""
    import copy
    import io

    torch.manual_seed(0)
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    loss = lambda mod, b: F.cross_entropy(mod(b["x"]), b["y"], reduction="none")
    m = _Caching()
    step = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1.0, method=method)
    xr = x.clone().requires_grad_()
    out = step(pdpsgd.trainable_params(m), {"x": xr, "y": y})
    if method == "vmap":  # (functorch wrappers: put back, as a pair, and inside a tuple / dict: a KV cache)
        assert m.cache is None and m.kv is None and m.table_len == 2 and torch.equal(m.table, torch.zeros(2))
        assert m.hist == [] and m.store == {}  # (containers filled in place: their contents put back)
    else:  # (the batched forward's plain tensors stay, as the model's own forward leaves them)
        assert m.table_len == 4 and m.cache.shape[1:] == (3,) and not m.cache.requires_grad
    copy.deepcopy(m)
    torch.save(m, io.BytesIO())
    assert not any(g.requires_grad for g in out.grads.values())
    assert not (out.per_sample_norms.requires_grad or out.loss.requires_grad)
    m2 = _ListedWeight()
    m2.l.weight.requires_grad_(False)
    step2 = pdpsgd.make_dp_step(m2, loss, max_grad_norm=1.0, noise_multiplier=0.0, method=method)
    with pytest.raises(ValueError, match=r"parameter\(s\) \['l.weight'\] other than through the model's modules"):
        step2(dict(m2.named_parameters()), {"x": x, "y": y})
    assert not m2.l.weight.requires_grad  # (put back)
    step2(pdpsgd.trainable_params(m2), {"x": x, "y": y})  # (not trained: its use is a constant's)


@pytest.mark.parametrize("method", ["vmap", "bk"])
def test_a_per_example_entry_that_is_not_a_tensor_is_refused(method):
    """Review, round 38: a Python list (or NumPy array) of one value per example went whole to every
    example's loss under vmap: lengths from a collate function let one example move the others'
    clipped sum by 1.25 C. Such entries are refused with the fix; a shared scalar, a string flag and
    a list of another length pass."""
    import numpy as np

    torch.manual_seed(0)
    m = nn.Linear(3, 3)
    x, y = torch.randn(4, 6, 3), torch.randint(0, 3, (4,))

    def loss(mod, b):
        L = max(b["lens"]) if "lens" in b else 6
        return F.cross_entropy(mod(b["x"][:, :L]).mean(1), b["y"], reduction="none")

    step = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1.0, method=method)
    params = pdpsgd.trainable_params(m)
    for lens in ([2, 2, 2, 6], np.array([2, 2, 2, 6]), (2, 2, 2, 6)):
        with pytest.raises(ValueError, match=r"batch entry \['lens'\] is .* one per example\? .*torch.tensor"):
            step(params, {"x": x, "y": y, "lens": lens})
    with pytest.raises(ValueError, match=r"batch entry \['toks'\] is a list of 4 items without tensors"):
        step(params, {"x": x, "y": y, "toks": [[1], [1, 2], [3], [4] * 9]})  # (per-example lists; round 38)
    with pytest.raises(ValueError, match=r"batch entry \['rows'\]"):
        step(params, {"x": x, "y": y, "rows": [{"n": 1}, {"n": 2}, {"n": 3}, {"n": 4}]})
    step(params, {"x": x, "y": y, "lens": [6], "mode": "mean", "scale": 2.0, "shape": torch.Size([4, 6, 3, 1])})
    step(params, {"x": x[:1], "y": y[:1], "lens": [6]})  # (B = 1: nothing to mix)
    with pytest.raises(ValueError, match=r"batch entry \['lens'\] is a list of 2 items without tensors"):
        step(params, {"x": x[:2], "y": y[:2], "lens": [2, 6]})  # (from B = 2 on; mutation review, round 42: B < 3 survived)


def text_batch(seed, B, T, vocab=30, classes=3):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, vocab, (B, T), generator=g), "labels": torch.randint(0, classes, (B,), generator=g)}


@given(seed=st.integers(0, 1000), B=st.integers(1, 6), T=st.integers(1, 9), chunk=st.integers(1, 6))
def test_text_cnn_exact(seed, B, T, chunk):
    # T >= 2: torch 2.13 CPU float64 conv1d backward with T=1, k=3, padding=1 fails in plain autograd
    # ("slow_conv2d: grad_weight must be contiguous"), i.e. in the oracle itself.
    T = max(T, 2)
    torch.manual_seed(seed)
    assert_exact(TextCNN(), cls_loss, text_batch(seed, B, T), chunk_size=chunk, max_grad_norm=0.5)


@given(seed=st.integers(0, 1000), B=st.integers(1, 5), T=st.integers(1, 7))
def test_tied_weights_exact_and_bounded(seed, B, T):
    torch.manual_seed(seed)
    m = TiedLM()
    b = text_batch(seed, B, T, vocab=20)
    b["labels"] = b["input_ids"]
    rep = assert_exact(m, lm_loss_fn, b, max_grad_norm=0.1)
    assert list(rep.per_param) == ["emb.weight", "mid.weight", "mid.bias"]  # the tied weight is one parameter
    # Per-example norm is that of the *summed* gradient of both uses.
    md = to_float64(m)
    _, g = naive_per_sample_grads(md, lm_loss_fn, b)
    step = pdpsgd.make_dp_step(md, lm_loss_fn, max_grad_norm=0.1, noise_multiplier=0.0)
    out = step(pdpsgd.trainable_params(md), b)
    total = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in g.values()))
    torch.testing.assert_close(out.per_sample_norms, total, rtol=1e-10, atol=0)


def test_alias_name_of_tied_weight_is_accepted():
    m = TiedLM().double()
    b = text_batch(0, 3, 5, vocab=20)
    b["labels"] = b["input_ids"]
    params = {"head.weight": m.head.weight}  # alias of emb.weight
    out = pdpsgd.make_dp_step(m, lm_loss_fn, max_grad_norm=1.0, noise_multiplier=0.0)(params, b)
    assert set(out.grads) == {"head.weight"}
    assert_exact(m, lm_loss_fn, b, params={"emb.weight": m.emb.weight})


class _ShadowBuffer(nn.Module):
    """A trained weight also registered as a buffer (and, with ``alias``, under a second name)."""

    def __init__(self, alias):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("shadow", self.lin.weight)
        if alias:
            self.w2 = self.lin.weight

    def forward(self, x):
        return self.lin(x) + 0.5 * (x @ self.shadow.t())


@pytest.mark.parametrize("alias", [False, True])
@pytest.mark.parametrize("method", ["vmap", "bk"])
def test_a_buffer_that_is_a_trained_weight_is_swapped_with_it(alias, method):
    """Review, round 34: the buffer went into the pure function's constants beside the parameter it
    is, and torch refused ("multiple values for keys ... which are tied") or raised a bare KeyError."""
    m = _ShadowBuffer(alias).double()
    b = {"x": torch.randn(5, 4, dtype=torch.float64), "y": torch.randint(0, 4, (5,))}

    def loss(mm, bb):
        return F.cross_entropy(mm(bb["x"]), bb["y"], reduction="none")

    assert_exact(m, loss, b, method=method, max_grad_norm=0.5)


@given(seed=st.integers(0, 1000), B=st.integers(1, 6), chunk=st.integers(1, 6))
def test_shared_layer_buffers_and_raw_parameter_exact(seed, B, chunk):
    torch.manual_seed(seed)
    m = SharedTwice()
    g = torch.Generator().manual_seed(seed)
    b = {"x": torch.randn(B, 6, generator=g), "y": torch.randint(0, 3, (B,), generator=g)}
    assert_exact(m, mlp_loss, b, chunk_size=chunk, max_grad_norm=0.2)


def test_frozen_subset_gets_no_gradient_and_is_exact():
    torch.manual_seed(0)
    m = TextCNN().double()
    b = text_batch(1, 5, 6)
    params = {n: p for n, p in m.named_parameters() if n.startswith(("out", "norm"))}
    out = pdpsgd.make_dp_step(m, cls_loss, max_grad_norm=0.3, noise_multiplier=0.0)(params, b)
    assert set(out.grads) == set(params)
    assert_exact(m, cls_loss, b, params=params, max_grad_norm=0.3)
    # requires_grad=False parameters are left out of trainable_params
    m.emb.weight.requires_grad_(False)
    assert "emb.weight" not in pdpsgd.trainable_params(m)


def test_model_is_not_modified():
    m, b = mlp_case(0, 5, 4, 5)
    before = {n: p.detach().clone() for n, p in m.state_dict().items()}
    ids = {n: id(p) for n, p in m.named_parameters()}
    pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0)(pdpsgd.trainable_params(m), b)
    assert all(torch.equal(before[n], p) for n, p in m.state_dict().items())
    assert ids == {n: id(p) for n, p in m.named_parameters()}
    assert all(p.grad is None for p in m.parameters())


def test_dropout_in_train_mode_runs_with_independent_masks():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 32), nn.Dropout(0.5), nn.Linear(32, 2)).train()
    x = torch.randn(1, 4).repeat(6, 1)  # six identical examples
    b = {"x": x, "y": torch.zeros(6, dtype=torch.long)}
    out = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=100.0, noise_multiplier=0.0)(pdpsgd.trainable_params(m), b)
    assert len(set(round(float(v), 6) for v in out.per_sample_norms)) > 1


def test_group_clipping_and_budget():
    m, b = mlp_case(2, 7, 4, 5)
    groups = {"first": ["0.weight", "0.bias"], "second": ["2.weight", "2.bias"]}
    assert_exact(m, mlp_loss, b, max_grad_norm=0.4, clipping=groups, clip_budget=[3.0, 1.0])
    from pdpsgd.clipping import make_groups
    g = make_groups(["0.weight", "0.bias", "2.weight", "2.bias"], groups, 0.4, budget=[3.0, 1.0])
    assert math.isclose(math.sqrt(sum(t * t for t in g.thresholds)), 0.4)
    with pytest.raises(ValueError, match="no clipping group"):
        make_groups(["a", "b"], {"g": ["a"]}, 1.0)


def test_a_clipping_spec_is_read_once_and_checked_when_the_step_is_made():
    """Review, round 38: a flat list of names was taken as one group per name (per-layer clipping, not
    the one group it reads as); a generator spec was used up by the first step; groups naming unknown
    or repeated parameters, a budget of the wrong length and a NaN γ passed make_dp_step and failed
    only at the first step; σ·C could overflow to inf; the same groups spelled as a dict, a list, in
    another order or by a tied alias gave different clipping keys (their sums refused)."""
    m, b = mlp_case(3, 6, 4, 5)
    params = pdpsgd.trainable_params(m)
    two = [["0.weight", "0.bias"], ["2.weight", "2.bias"]]

    def make(**kw):
        return pdpsgd.make_dp_step(m, mlp_loss, **{"max_grad_norm": 0.3, "noise_multiplier": 0.0, **kw})

    with pytest.raises(ValueError, match="flat list of parameter names"):
        make(clipping=["0.weight", "0.bias", "2.weight", "2.bias"])
    with pytest.raises(ValueError, match="named twice in clipping group 0"):
        make(clipping=[["0.weight", "0.weight", "0.bias"], ["2.weight", "2.bias"]])
    with pytest.raises(ValueError, match="'nope', which is not a trained parameter"):
        make(clipping=[["0.weight", "0.bias"], ["nope"]])
    with pytest.raises(ValueError, match="budget needs 2 positive"):
        make(clipping=two, clip_budget=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="gamma must be finite"):
        make(clip_fn="automatic", gamma=float("nan"))
    with pytest.raises(ValueError, match="overflows"):
        make(max_grad_norm=1e308, noise_multiplier=2.0)
    make(gamma="unused")(params, b)  # (γ is automatic clipping's alone)
    gen = make(clipping=(g for g in two))
    ref = make(clipping=two)(params, b).grads
    for _ in range(2):  # (a generator is read once, when the step is made)
        out = gen(params, b).grads
        for n in params:
            torch.testing.assert_close(out[n], ref[n], rtol=0, atol=0)
    same = [make(clipping=two), make(clipping={"a": ["0.bias", "0.weight"], "b": ["2.weight", "2.bias"]}),
            make(clipping=[["0.bias", "0.weight"], ("2.bias", "2.weight")])]
    assert len({s.clipping_key for s in same}) == 1
    same[0].finalize(same[1].clipped_sum(params, b) + same[2].clipped_sum(params, b))
    assert make(clipping=two[::-1]).clipping_key != same[0].clipping_key  # (group order: the budget's order)
    # (a budget shares C by its ratios: equal weights are the default's; round 38, second review)
    assert make(clipping=two, clip_budget=[2, 2]).clipping_key == same[0].clipping_key
    assert make(clipping=two, clip_budget=[1, 3]).clipping_key == make(clipping=two, clip_budget=(2.0, 6.0)).clipping_key
    assert make(clipping=two, clip_budget=[1, 3]).clipping_key != same[0].clipping_key
    from pdpsgd.clipping import make_groups, make_weights_fn
    make_weights_fn(make_groups(["a"], "flat", 1.0), clip_fn="automatic", gamma=torch.tensor(0.05))


@given(seed=st.integers(0, 10_000), B=st.integers(2, 9), split=st.integers(1, 8), sigma=st.sampled_from([0.0, 1.1]))
def test_logical_batch_split_equals_one_physical_batch(seed, B, split, sigma):
    """Accumulating clipped sums over physical batches and adding noise once == one big batch."""
    split = 1 + split % (B - 1)
    m, b = mlp_case(seed, B, 4, 5)
    params = pdpsgd.trainable_params(m)
    def step():
        return pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=0.5, noise_multiplier=sigma, expected_batch_size=B,
                                   generator=torch.Generator().manual_seed(seed))
    whole = step()(params, b)
    s = step()
    part = s.clipped_sum(params, {k: v[:split] for k, v in b.items()}) + s.clipped_sum(params, {k: v[split:] for k, v in b.items()})
    acc = s.finalize(part, params=params)
    for n in params:
        torch.testing.assert_close(acc.grads[n], whole.grads[n], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(acc.loss, whole.loss)
    assert int(acc.num_examples) == B


@given(seed=st.integers(0, 10_000), max_phys=st.integers(1, 6), sigma=st.sampled_from([0.0, 0.8]))
def test_poisson_physical_batches_with_padding_equal_one_batch(seed, max_phys, sigma):
    """Sampler → fixed-shape padded physical batches → accumulate → finalize == the logical batch at once."""
    from pdpsgd.sampling import PoissonSampler, collate, to_physical_batches

    N = 20
    m, data = mlp_case(seed, N, 4, 5)
    params = pdpsgd.trainable_params(m)
    idx = next(iter(PoissonSampler(N, 0.4, 1, generator=torch.Generator().manual_seed(seed))))
    def make():
        return pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=0.5, noise_multiplier=sigma, expected_batch_size=8,
                                   generator=torch.Generator().manual_seed(seed))
    s = make()
    part = None
    for pb in to_physical_batches(idx, max_phys):
        assert pb.indices.shape == (max_phys,)
        batch, mask = collate(data, pb)
        p = s.clipped_sum(params, batch, mask)
        part = p if part is None else part + p
    acc = s.finalize(part, params=params)
    assert int(acc.num_examples) == len(idx)
    if len(idx) == 0:
        return
    whole = make()(params, {k: v[idx] for k, v in data.items()})
    for n in params:
        torch.testing.assert_close(acc.grads[n], whole.grads[n], rtol=1e-12, atol=1e-14)


def test_vmap_default_chunk_scales_with_free_accelerator_memory():
    from pdpsgd.per_sample import CPU_CHUNK_BUDGET_ELEMS, chunk_budget_elems, default_chunk_size

    assert chunk_budget_elems(torch.device("cpu")) == CPU_CHUNK_BUDGET_ELEMS
    assert default_chunk_size(8, 124_000_000) == 1  # GPT-2 small on the CPU budget: one example per chunk
    big = chunk_budget_elems(torch.device("cuda"), free_bytes=140 * 2**30)  # an idle H200
    assert default_chunk_size(8, 124_000_000, budget_elems=big) == 8
    assert default_chunk_size(200, 124_000_000, budget_elems=big) == 37  # an eighth of 140 GiB in float32
    assert chunk_budget_elems(torch.device("cuda"), free_bytes=2**20) == CPU_CHUNK_BUDGET_ELEMS  # never below


@pytest.mark.parametrize("dtype,chunks", [(torch.float32, 3), (torch.float64, 5)])
def test_vmap_engine_takes_its_default_chunk_from_the_device_budget(monkeypatch, dtype, chunks):
    from pdpsgd import per_sample

    m, b = mlp_case(0, 9, 4, 5)  # float64 model
    m = m.to(dtype)
    b = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in b.items()}
    params = pdpsgd.trainable_params(m)
    numel = sum(p.numel() for p in params.values())
    seen = []
    monkeypatch.setattr(per_sample, "chunk_budget_elems", lambda dev: (seen.append(dev), 4 * numel)[1])
    calls = []
    real = per_sample.per_sample_grads
    monkeypatch.setattr(per_sample, "per_sample_grads", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=0.0, method="vmap")(params, b)
    assert seen == [torch.device("cpu")]
    assert len(calls) == chunks  # 9 examples in chunks of 4 (float32) or 2 (float64: 8-byte gradients)


def test_sum_sq_norms_matches_the_plain_sum_and_promotes():
    from pdpsgd.clipping import sum_sq_norms

    torch.manual_seed(0)
    sq = {f"p{i}": torch.rand(5, dtype=torch.float64) for i in range(7)}
    torch.testing.assert_close(sum_sq_norms(sq), sum(sq.values()), rtol=1e-15, atol=0)
    torch.testing.assert_close(sum_sq_norms(sq, ["p1", "p4"]), sq["p1"] + sq["p4"], rtol=1e-15, atol=0)
    assert sum_sq_norms(sq, ["p3"]) is sq["p3"]
    mixed = {"a": torch.ones(3), "b": torch.full((3,), 2.0, dtype=torch.float64)}
    out = sum_sq_norms(mixed)
    assert out.dtype == torch.float64 and torch.equal(out, torch.full((3,), 3.0, dtype=torch.float64))


class _AliasedTied(nn.Module):
    """A LayerNorm registered under two names (and called twice) whose bias is tied to another
    LayerNorm: torch's functional_call (2.13) leaves its substitute in such a model."""

    def __init__(self, d=4):
        super().__init__()
        self.pre, self.ln, self.ln2, self.out = nn.Linear(3, d), nn.LayerNorm(d), nn.LayerNorm(d), nn.Linear(d, 2)
        self.alias = self.ln
        self.ln2.bias = self.ln.bias

    def forward(self, x):
        z = self.ln(self.pre(x))
        return self.out(self.alias(self.ln2(torch.tanh(z)))).sum(1)


@pytest.mark.parametrize("method", ["vmap", "bk", "auto"])
def test_steps_leave_the_model_as_it_was(method):
    from pdpsgd.testing import assert_exact

    torch.manual_seed(0)
    m = _AliasedTied().double()
    before = {n: p for n, p in m.named_parameters(remove_duplicate=False)}
    b = {"x": torch.randn(3, 2, 3, dtype=torch.float64), "y": torch.randint(0, 2, (3,))}
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=0.2, noise_multiplier=0.0, method=method)
    first = step.clipped_sum(pdpsgd.trainable_params(m), b)
    second = step.clipped_sum(pdpsgd.trainable_params(m), b)  # the same model again, ties intact
    assert {n: p for n, p in m.named_parameters(remove_duplicate=False)} == before
    assert m.ln2.bias is m.ln.bias and isinstance(m.ln.bias, nn.Parameter)
    torch.testing.assert_close(first.per_sample_norms, second.per_sample_norms, rtol=1e-12, atol=0)
    assert_exact(m, mlp_loss, b, method=method, max_grad_norm=0.2)


@pytest.mark.parametrize("method", ["vmap", "bk"])
def test_a_failing_forward_leaves_the_model_intact(method):
    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x):
            self.a(x)  # the first layer runs (its parameters are swapped in), then the forward fails
            raise RuntimeError("boom after the first layer")

    m = Fails()
    before = {n: p for n, p in m.named_parameters()}
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=0.0, method=method)
    with pytest.raises(RuntimeError, match="boom"):
        step.clipped_sum(pdpsgd.trainable_params(m), {"x": torch.randn(2, 3), "y": torch.tensor([0, 1])})
    assert {n: p for n, p in m.named_parameters()} == before
    assert all(isinstance(p, nn.Parameter) for p in m.parameters())


def test_buffers_and_frozen_parameters_are_read_at_call_time():
    """Rebinding a buffer or converting the model after the step was built is seen by the step."""
    from pdpsgd.testing import naive_clipped_sum

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)
            self.register_buffer("scale", torch.tensor(1.0))

        def forward(self, x):
            return self.b(torch.tanh(self.a(x) * self.scale))

    torch.manual_seed(0)
    m = Scaled().double()
    b = {"x": torch.randn(6, 4, dtype=torch.float64), "y": torch.randint(0, 3, (6,))}
    for method in ("vmap", "bk"):
        step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=0.3, noise_multiplier=0.0, method=method,
                                   expected_batch_size=1.0)
        m.scale = torch.tensor(3.0, dtype=torch.float64)  # rebound after construction
        m.a.weight.requires_grad_(False)  # (frozen: passed as a constant, read now)
        with torch.no_grad():
            m.a.weight.mul_(2.0)
        params = {n: p for n, p in m.named_parameters() if p.requires_grad}
        got = step.clipped_sum(params, b)
        norms, sums = naive_clipped_sum(m, mlp_loss, b, max_grad_norm=0.3, params=params)
        for n in params:
            torch.testing.assert_close(got.sums[n], sums[n], rtol=1e-9, atol=1e-12)
        m.scale = torch.tensor(1.0, dtype=torch.float64)
        m.a.weight.requires_grad_(True)


@pytest.mark.parametrize("method", ["vmap", "bk", "auto"])
def test_an_empty_batch_is_a_noise_only_step(method):
    """A Poisson-sampled batch can be empty: the clipped sums are 0 and the step is the noise alone
    (std σC / expected_batch_size, as any step's); without expected_batch_size there is nothing to
    divide by, and the error says so."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(30, 40), nn.Tanh(), nn.Linear(40, 2))
    loss = lambda mm, b: F.cross_entropy(mm(b["x"]), b["y"], reduction="none")  # noqa: E731
    b = {"x": torch.zeros(0, 30), "y": torch.zeros(0, dtype=torch.long)}
    params = pdpsgd.trainable_params(m)
    quiet = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4, method=method)
    out = quiet(params, b)
    assert all(not bool(g.any()) for g in out.grads.values()) and int(out.num_examples) == 0 and float(out.loss) == 0
    noisy = pdpsgd.make_dp_step(m, loss, max_grad_norm=2.0, noise_multiplier=1.5, expected_batch_size=4, method=method,
                                generator=torch.Generator().manual_seed(1))
    g = noisy(params, b).grads["0.weight"]  # 1200 draws of N(0, (1.5·2 / 4)²)
    assert abs(float(g.std()) / 0.75 - 1) < 0.1, float(g.std())
    with pytest.raises(ValueError, match="expected_batch_size"):
        pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=1.0, method=method)(params, b)
    # accumulated with a real batch, in either order: the real batch's sums, norms and routes
    real = {"x": torch.randn(3, 30), "y": torch.tensor([0, 1, 1])}
    part, none = quiet.clipped_sum(params, real), quiet.clipped_sum(params, b)
    for acc in (part + none, none + part):
        assert acc.routes == part.routes and acc.per_sample_norms.shape == (3,)
        assert all(torch.equal(acc.sums[n], part.sums[n]) for n in part.sums)


@pytest.mark.parametrize("method", ["vmap", "bk", "auto"])
def test_step_under_a_callers_no_grad_is_the_same_and_inference_mode_is_refused(method):
    """The step turns grad mode on for its own gradients (before, bk/auto under a caller's no_grad
    failed with torch's "does not require grad"); inference_mode tensors cannot enter autograd, so
    it is refused with an error that says what to do."""
    torch.manual_seed(0)
    m = mlp().double()
    b = {"x": torch.randn(4, 5, dtype=torch.float64), "y": torch.randint(0, 3, (4,))}
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=0.1, noise_multiplier=0.0, method=method)
    params = pdpsgd.trainable_params(m)
    ref = step.clipped_sum(params, b)
    with torch.no_grad():
        got = step.clipped_sum(params, b)
    for n in ref.sums:
        torch.testing.assert_close(got.sums[n], ref.sums[n], rtol=1e-12, atol=0)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="outside torch.inference_mode"):
        step.clipped_sum(params, b)
    with torch.no_grad():  # (the plan and the fallback reasons run the engine's capture too)
        assert step.plan(b, params).keys() == params.keys() and isinstance(step.fallback_reasons(b, params), dict)
    with torch.inference_mode():
        inf_params = {n: p.clone() for n, p in params.items()}
        inf_x = b["x"].clone()
    if method == "vmap":  # (functional_call takes inference tensors as values)
        step.clipped_sum(inf_params, {**b, "x": inf_x})
        return
    with pytest.raises(RuntimeError, match=r"parameter\(s\).*inference_mode"):
        step.clipped_sum(inf_params, b)
    with pytest.raises(RuntimeError, match="a batch tensor was created under torch.inference_mode"):
        step.clipped_sum(params, {**b, "x": inf_x})


def _stance():
    from torch._dynamo import eval_frame

    return getattr(getattr(eval_frame, "_stance", None), "stance", "default")


@pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch.compiler.set_stance: torch >= 2.6")
@pytest.mark.parametrize("method", ["bk", "vmap"])
def test_compiled_model_runs_eagerly_inside_the_step(method):
    """A ``torch.compile``d model (an OptimizedModule, its parameters named ``_orig_mod.*``): the step
    says at construction that it runs the model eagerly, runs it so (dynamo enters no frame: before,
    the first bk step compiled for ~2 minutes, recompiling every wrapped layer up to dynamo's
    limit), and its norms and clipped sums equal the naive float64 oracle's on the eager model. The
    stance is torch's default again after the step, also after a failing one; plan() and
    fallback_reasons() run eagerly too."""
    import warnings

    from models import hf_lm_loss, tiny_gpt2

    torch.manual_seed(0)
    base = tiny_gpt2().double()
    model = torch.compile(base)
    ids = torch.randint(0, 40, (3, 7))
    b = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    with pytest.warns(UserWarning, match="torch.compile'd"):
        step = pdpsgd.make_dp_step(model, hf_lm_loss, max_grad_norm=0.3, noise_multiplier=0.0, method=method)
    params = pdpsgd.trainable_params(model)
    assert all(n.startswith("_orig_mod.") for n in params)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        part = step.clipped_sum(params, b)
        if method != "vmap":
            step.plan(b, params)
            step.fallback_reasons(b, params)
    assert sum(torch._dynamo.utils.counters["frames"].values()) == 0  # dynamo entered no frame
    assert _stance() == "default"
    if method == "bk":
        assert "vmap" not in part.routes.values(), part.routes
    norms, sums = pdpsgd.testing.naive_clipped_sum(base, hf_lm_loss, b, max_grad_norm=0.3)
    torch.testing.assert_close(part.per_sample_norms, norms, rtol=1e-9, atol=0)
    for n, v in sums.items():
        torch.testing.assert_close(part.sums["_orig_mod." + n], v, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError):
        step.clipped_sum(params, {**b, "labels": ids[:2]})  # a failing step
    assert _stance() == "default"


@pytest.mark.parametrize("method", ["bk", "vmap"])
def test_step_inside_the_users_compiled_function(method):
    """A training step that the user wraps in ``torch.compile`` and that calls the DP step: the DP
    step is a graph break there and runs as it is (exact against the oracle); a model compiled in
    place (``module.compile()``) is recognised too (the warning)."""
    import warnings

    from models import hf_lm_loss, tiny_gpt2

    torch.manual_seed(0)
    model = tiny_gpt2().double()
    ids = torch.randint(0, 40, (3, 7))
    b = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    step = pdpsgd.make_dp_step(model, hf_lm_loss, max_grad_norm=0.3, noise_multiplier=0.0, method=method)
    params = pdpsgd.trainable_params(model)

    @torch.compile(backend="eager")
    def train_step(p, batch):
        return step.clipped_sum(p, batch).per_sample_norms

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = train_step(params, b)
    norms, _ = pdpsgd.testing.naive_clipped_sum(model, hf_lm_loss, b, max_grad_norm=0.3)
    torch.testing.assert_close(got, norms, rtol=1e-9, atol=0)
    model.transformer.h[0].compile()
    with pytest.warns(UserWarning, match="torch.compile'd"):
        pdpsgd.make_dp_step(model, hf_lm_loss, max_grad_norm=0.3, noise_multiplier=0.0, method=method)


class _SparseEmb(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.e = nn.Embedding(11, 4, sparse=True, **kw)
        self.bag = nn.EmbeddingBag(11, 3, mode="sum", sparse=True)
        self.lin = nn.Linear(4, 3)

    def forward(self, ids):  # (B, T) -> (B, T, 3)
        return self.lin(self.e(ids)) + self.bag(ids).unsqueeze(1)


@pytest.mark.parametrize("method,kw", [("vmap", {}), ("bk", {}), ("auto", {"padding_idx": 0})])
def test_sparse_embeddings_get_exact_dense_gradients(method, kw):
    """``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(sparse=True)``: torch.func.vmap cannot batch
    a sparse gradient (before: torch's "Could not run 'aten::view' ... 'SparseCPU' backend"); the
    layers run with dense gradients inside vmap (the vmap method, and book-keeping's exact fallback,
    which the bag takes) and are restored after. Exact against the naive float64 oracle."""
    torch.manual_seed(0)
    model = _SparseEmb(**kw)
    ids = torch.randint(0, 11, (4, 6))
    ids[:, :2] = 3  # a repeated token

    def loss(m, b):
        return (m(b["ids"]) * b["y"]).sum((1, 2))

    r = assert_exact(model, loss, {"ids": ids, "y": torch.randn(4, 6, 3)}, method=method, max_grad_norm=0.5)
    if method != "vmap":
        assert r.routes["bag.weight"] == "vmap" and r.routes["e.weight"] != "vmap", r.routes
    assert model.e.sparse and model.bag.sparse  # restored


@pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch.compiler.set_stance: torch >= 2.6")
def test_overlapping_steps_in_threads_restore_the_stance():
    """Steps that overlap in several threads: the compiler stance (one per process) is force_eager
    while any of them runs and torch's default again after the last (before, each step saved and
    restored its own: interleaved, the last to leave could restore another's force_eager for good,
    and every compiled function of the process then ran eagerly)."""
    import threading

    errors = []
    gate = threading.Barrier(4)

    def work(seed):
        try:
            torch.manual_seed(seed)
            model = mlp()
            step = pdpsgd.make_dp_step(model, mlp_loss, max_grad_norm=1.0, noise_multiplier=0.0, method="bk")
            params = pdpsgd.trainable_params(model)
            b = {"x": torch.randn(3, 5), "y": torch.randint(0, 3, (3,))}
            gate.wait()
            for _ in range(10):
                step.clipped_sum(params, b)
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    ts = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert _stance() == "default"


@given(seed=st.integers(0, 1000), B=st.integers(1, 5), T=st.integers(1, 6), d=st.integers(2, 12),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       affine=st.sampled_from(["both", "weight", "bias"]), keyword=st.booleans())
def test_mixed_dtype_layer_norm_under_vmap_is_the_float32_layer_norm(seed, B, T, d, dtype, affine, keyword):
    """A bf16 / fp16 input with float32 affine parameters (a LayerNorm right after a linear layer
    under autocast): torch's eager kernel takes it, but its backward fails under vmap ("expected
    scalar type BFloat16 but found Float"; with a bias and no weight even plain autograd fails).
    Inside the engines' vmap it is computed as the float32 layer norm of the upcast input: the
    output and the input gradient the float64 values rounded to the input's dtype, and the weight /
    bias gradients the float32 sums of the per-example products (float64 references)."""
    from torch.func import grad, vmap

    from pdpsgd.per_sample import _MixedLayerNorm

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, d, generator=g).to(dtype)
    w = torch.randn(d, generator=g) if affine != "bias" else None
    b = torch.randn(d, generator=g) if affine != "weight" else None
    go = torch.randn(B, T, d, generator=g).to(dtype)

    def ln(w, b, xi):
        return F.layer_norm(xi, (d,), weight=w, bias=b, eps=1e-5) if keyword else F.layer_norm(xi, (d,), w, b, 1e-5)

    affine_params = {k: v for k, v in (("w", w), ("b", b)) if v is not None}

    def f(p, xi, gi):
        return (ln(p.get("w"), p.get("b"), xi).float() * gi.float()).sum()

    with _MixedLayerNorm():
        out = ln(w, b, x)
        gp, gx = vmap(grad(f, argnums=(0, 1)), in_dims=(None, 0, 0))(affine_params, x, go)
    gw, gb = gp.get("w"), gp.get("b")
    eps = torch.finfo(dtype).eps  # the output and the input gradient are rounded to the input's dtype
    x64 = x.double().requires_grad_(True)
    xhat = F.layer_norm(x64, (d,), eps=1e-5)  # (B, T, d)
    y64 = xhat * (w.double() if w is not None else 1) + (b.double() if b is not None else 0)
    assert out.dtype == dtype and gx.dtype == dtype
    torch.testing.assert_close(out.double(), y64.detach(), rtol=eps, atol=eps * float(y64.abs().max()))
    want_x = torch.autograd.grad(y64, x64, go.double())[0]
    torch.testing.assert_close(gx.double(), want_x, rtol=2 * eps, atol=4 * eps * float(want_x.abs().max()))
    if w is not None:
        want = (go.double() * xhat.detach()).sum(1)  # (B, d)
        assert gw.dtype == torch.float32
        torch.testing.assert_close(gw.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    if b is not None:
        want = go.double().sum(1)
        assert gb.dtype == torch.float32
        torch.testing.assert_close(gb.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


class _LinearThenNorm(nn.Module):
    """A LayerNorm right after a linear layer (BERT's masked-LM head: dense, activation, LayerNorm)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.dense = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 3)

    def forward(self, ids):
        return self.out(self.norm(F.gelu(self.dense(self.emb(ids)))).mean(1))


@pytest.mark.parametrize("where", ["outer", "inner"])
@pytest.mark.parametrize("method", ["vmap", "bk", "auto"])
@pytest.mark.parametrize("make", [TextCNN, _LinearThenNorm], ids=["textcnn", "linear_then_norm"])
def test_layer_norm_after_a_linear_layer_under_autocast(method, make, where):
    """The step inside bf16 autocast on models whose LayerNorm takes a bf16 linear / conv output
    directly. Before, method='vmap' (and any parameter book-keeping sends to its exact fallback)
    failed with torch's "expected scalar type BFloat16 but found Float". Now each example's
    contribution stays ≤ C and the per-example norms are the naive autocast loop's, to bf16
    precision (eager's mixed-dtype kernel rounds its weight gradient at bf16; the engine's are
    float32). Book-keeping keeps the norm on its rule: its example-order check compares at bf16's
    rounding unit a use computed from bf16 inputs (``Use.src``); before, the norm's float32
    per-example gradient was compared at float32's and fell back to vmap in every step."""
    torch.manual_seed(0)
    model = make()
    batch = text_batch(3, 4, 6)
    params = pdpsgd.trainable_params(model)

    def amp_loss(m, b):  # autocast entered inside the loss (review: the vmap method failed there still)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return cls_loss(m, b)

    loss = cls_loss if where == "outer" else amp_loss
    outer = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=where == "outer")  # noqa: E731
    step = pdpsgd.make_dp_step(model, loss, max_grad_norm=1e9, noise_multiplier=0.0, method=method)
    with outer(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (inside the loss: the order check says it compares at bf16)
        got = step.clipped_sum(params, batch)
        _, want = naive_per_sample_grads(model, loss, batch)
    norms = torch.stack([g.flatten(1).double().pow(2).sum(1) for g in want.values()]).sum(0).sqrt()
    torch.testing.assert_close(got.per_sample_norms.double(), norms, rtol=0.02, atol=0)
    if method != "vmap":
        assert "vmap" not in got.routes.values(), got.routes
    C = float(norms.min()) / 4
    step = pdpsgd.make_dp_step(model, loss, max_grad_norm=C, noise_multiplier=0.0, method=method)
    with outer(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = pdpsgd.testing.check_sensitivity(step, params, batch, neighbour=text_batch(9, 4, 6))
    assert r.max_ratio <= 1 + 1e-6 and float(r.contributions.min()) > C * (1 - 1e-5)


@pytest.mark.parametrize("mode", ["outer", "inner", "bf16 model"])
@pytest.mark.parametrize("family", ["t5", "bert_mlm"])
def test_hf_models_under_bf16_autocast_stay_on_their_rules(family, mode):
    """T5 (its RMSNorm and relative attention bias take float32 inputs whose values carry a bf16
    layer's rounding) and BERT's masked-LM head (a LayerNorm fed a bf16 dense output) inside bf16
    autocast: every parameter on its rule (before: 5 and 2 of them on the exact vmap fallback in
    every step, their float32 per-example gradients compared at float32's rounding unit; T5 with
    padded rows), each
    contribution ≤ C, and a model that mixes examples still caught under autocast (the test of
    ``test_bookkeeping``'s order check). Autocast around the step, inside the loss, and the model
    in bf16 alike (round 28: the order check's float32 run decides in each, with no warning)."""
    import transformers as tf

    import models

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if family == "t5":
        model, loss = models.tiny_t5(), models.t5_loss
        ids = torch.randint(1, models.T5_VOCAB, (3, 7), generator=g)
        am = torch.ones_like(ids)
        am[1, 5:] = 0  # padded rows (unpadded, the rounding happens to agree)
        am[2, 3:] = 0
        batch = {"input_ids": ids, "attention_mask": am,
                 "labels": torch.randint(1, models.T5_VOCAB, (3, 4), generator=g)}
    else:
        cfg = tf.BertConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                            vocab_size=50, max_position_embeddings=40)
        cfg._attn_implementation = "eager"
        model = tf.BertForMaskedLM(cfg).eval()
        ids = torch.randint(3, 50, (3, 7), generator=g)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

        def loss(m, b):
            lg = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float()
            return F.cross_entropy(lg.flatten(0, 1), b["input_ids"].flatten(), reduction="none").view(b["input_ids"].shape).sum(1)
    if mode == "bf16 model":
        model = model.to(torch.bfloat16)
    params = pdpsgd.trainable_params(model)

    def inner(m, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss(m, b)

    step = pdpsgd.make_dp_step(model, inner if mode == "inner" else loss, max_grad_norm=0.05, noise_multiplier=0.0,
                               method="bk")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "outer"), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*example-order check compared")
        out = step.clipped_sum(params, batch)
        r = pdpsgd.testing.check_sensitivity(step, params, batch, rtol=1e-6)
    assert "vmap" not in out.routes.values(), [n for n, v in out.routes.items() if v == "vmap"]
    assert r.max_ratio <= 1 + 1e-6


@pytest.mark.parametrize("norm", ["batch", "instance"])
@pytest.mark.parametrize("where", ["outer", "bf16 model"])
def test_eval_batch_norm_under_bf16_vmap_and_bk_agree(where, norm):
    """An eval-mode BatchNorm or an affine InstanceNorm after a conv under bf16 autocast (a bf16
    input, float32 statistics and affine) or in a bf16 model: torch's eager kernel takes the mixed
    call, but its backward failed under vmap ("expected scalar type BFloat16 but found Float"); it now runs as the float32 batch
    norm of the upcast input there, and on its rule in book-keeping: both within bf16's rounding of
    the float64 oracle, and of each other."""
    torch.manual_seed(0)
    layer = nn.BatchNorm1d(4) if norm == "batch" else nn.InstanceNorm1d(4, affine=True)
    m = nn.Sequential(nn.Conv1d(3, 4, 3), layer, nn.Flatten(), nn.Linear(4 * 7, 3))
    with torch.no_grad():
        if norm == "batch":
            m[1].running_mean.normal_()
        m[1].weight.normal_()
    m.eval()
    b = {"x": torch.randn(5, 3, 9), "y": torch.randint(0, 3, (5,))}
    if where == "bf16 model":
        m = m.to(torch.bfloat16)
        b["x"] = b["x"].bfloat16()
    loss = lambda mod, bb: F.cross_entropy(mod(bb["x"]).float(), bb["y"], reduction="none")  # noqa: E731
    params = pdpsgd.trainable_params(m)
    got = {}
    for method in ("vmap", "bk"):
        step = pdpsgd.make_dp_step(m, loss, max_grad_norm=1e3, noise_multiplier=0.0, method=method)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=where == "outer"):
            got[method] = step.clipped_sum(params, b)
    assert got["bk"].routes["1.weight"] == "explicit" and got["vmap"].routes["1.weight"] == "vmap"
    _, ref = naive_per_sample_grads(to_float64(m), loss, to_float64(b))
    want = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in ref.values()))
    for method in ("vmap", "bk"):
        torch.testing.assert_close(got[method].per_sample_norms.double(), want, rtol=0.05, atol=0)
    scale = max(float(v.abs().max()) for v in got["bk"].sums.values())  # (InstanceNorm: the conv bias's is ~0)
    for n in params:
        torch.testing.assert_close(got["vmap"].sums[n].double(), got["bk"].sums[n].double(), rtol=0.05,
                                   atol=0.02 * scale)


def test_finalize_without_params_returns_the_models_dtypes():
    """Review, round 35: ``finalize(part)`` without ``params=`` gave a bf16 model float32 gradients
    (the sums' dtype), which ``p.grad = ...`` refuses."""
    m = nn.Linear(3, 2).to(torch.bfloat16)
    loss = lambda mm, b: F.mse_loss(mm(b["x"]).float(), b["y"], reduction="none").sum(1)  # noqa: E731
    step = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    params = pdpsgd.trainable_params(m)
    part = step.clipped_sum(params, {"x": torch.randn(4, 3, dtype=torch.bfloat16), "y": torch.randn(4, 2)})
    assert part.sums["weight"].dtype == torch.float32  # (sums stay float32 at least)
    out = step.finalize(part)
    assert {g.dtype for g in out.grads.values()} == {torch.bfloat16}
    for n, p in m.named_parameters():
        p.grad = out.grads[n]


def test_no_clip_bound_with_automatic_clipping_is_refused():
    """C = inf is "no clipping" for abadi's min(1, C/‖g‖); automatic clipping's C/(‖g‖+γ) is then
    inf for every example (review, round 36: the gradients came back inf/NaN without an error)."""
    m = mlp()
    with pytest.raises(ValueError, match="automatic"):
        pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=math.inf, noise_multiplier=0.0, clip_fn="automatic")
    pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=math.inf, noise_multiplier=0.0, clip_fn="abadi")


@pytest.mark.parametrize("method", ["vmap", "bk"])
def test_clipping_groups_may_name_a_tied_weight_by_any_alias(method):
    """A tied tensor may be named by any of its names in clipping groups, as in params= (review, round
    36: its alias was refused as "not a trained parameter"); naming it twice is an error naming both."""
    torch.manual_seed(0)
    model = TiedLM().double()
    ids = torch.randint(0, 20, (4, 5))
    b = {"input_ids": ids, "labels": ids}
    loss = lm_loss_fn
    canon = {"emb": ["emb.weight"], "rest": ["mid.weight", "mid.bias"]}
    alias = {"emb": ["head.weight"], "rest": ["mid.weight", "mid.bias"]}
    params = pdpsgd.trainable_params(model)
    ref = pdpsgd.make_dp_step(model, loss, max_grad_norm=0.1, noise_multiplier=0.0, method=method,
                              clipping=canon).clipped_sum(params, b)
    step = pdpsgd.make_dp_step(model, loss, max_grad_norm=0.1, noise_multiplier=0.0, method=method, clipping=alias)
    got = step.clipped_sum(params, b)
    for n in ref.sums:
        torch.testing.assert_close(got.sums[n], ref.sums[n], rtol=1e-12, atol=1e-15)
    assert got.clipping == ref.clipping  # (the same groups: their sums add; round 38)
    assert_exact(model, loss, b, max_grad_norm=0.1, method=method, clipping=alias)
    both = {"a": ["head.weight"], "b": ["emb.weight", "mid.weight", "mid.bias"]}
    with pytest.raises(ValueError, match="head.weight.*emb.weight|emb.weight.*head.weight"):
        pdpsgd.make_dp_step(model, loss, max_grad_norm=0.1, noise_multiplier=0.0, method=method,
                            clipping=both).clipped_sum(params, b)


@pytest.mark.parametrize("method", ["vmap", "bk"])
def test_a_per_layer_budget_follows_the_models_order_not_the_dicts(method):
    """Review, round 39: clipping="per_layer"'s groups followed the params dict's order, so the same
    tensors passed in another order got other thresholds (0.0099 C and 0.0010 C swapped) under one
    clipping key. They follow the model's parameter order; the spec's mistakes are errors at build."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    b = {"x": torch.randn(3, 4, dtype=torch.float64) * 3, "y": torch.tensor([1, 0, 1])}
    params = pdpsgd.trainable_params(model)
    kw = dict(max_grad_norm=0.01, noise_multiplier=0.0, clipping="per_layer", clip_budget=[100, 1, 1, 1],
              method=method, expected_batch_size=1.0)
    step = pdpsgd.make_dp_step(model, mlp_loss, **kw)
    a = step.clipped_sum(params, b)
    r = step.clipped_sum(dict(reversed(list(params.items()))), b)
    for n in params:
        torch.testing.assert_close(r.sums[n], a.sums[n], rtol=1e-12, atol=0)
    assert float(a.sums["0.weight"].norm()) > 0.009  # (C·√(100/103): the first tensor's share)
    assert_exact(model, mlp_loss, b, params=dict(reversed(list(params.items()))),
                 **{k: v for k, v in kw.items() if k not in ("noise_multiplier", "expected_batch_size")})
    for bad, needle in ((dict(clipping=[]), "names no group"), (dict(clipping={}), "names no group"),
                        (dict(clip_budget=[1, 2]), "budget needs 1"),
                        (dict(clipping="per_layer", clip_budget=[1, -1]), "budget needs 2"),
                        (dict(clip_fn="automatic", gamma=True), "gamma must be a number")):
        with pytest.raises(ValueError, match=needle):
            pdpsgd.make_dp_step(model, mlp_loss, max_grad_norm=1.0, noise_multiplier=0.0, method=method, **bad)


@pytest.mark.parametrize("method", ["vmap", "bk"])
@pytest.mark.parametrize("how", ["functional", "submodule", "python_random", "numpy_random", "train"])
def test_no_engine_skips_masked_chunks_of_a_forward_that_draws(how, method):
    """A root in eval mode can still draw random numbers: F.dropout's default training=True, or a
    submodule left in train mode. vmap skipped all-padding chunks whenever the root was in eval
    mode, which moved every later chunk's dropout masks when an example was masked out: the move of
    the sum exceeded C (review, round 36). Such chunks run; masking one example out leaves the
    others' norms as they were. Python's random and numpy's global state too (round 37: torch's
    alone were watched). Book-keeping skipped them even in train mode (review, round 39: 2.5 C), and
    an all-padding physical batch too, moving the masks of the batches after it."""
    import random

    import numpy as np

    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.drop = nn.Linear(5, 7), nn.Linear(7, 3), nn.Dropout(0.5)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            if how == "python_random":
                return self.b(h * (0.5 + random.random()))
            if how == "numpy_random":
                return self.b(h * float(0.5 + np.random.rand()))
            h = F.dropout(h, 0.5) if how == "functional" else self.drop(h)
            return self.b(h)

    torch.manual_seed(0)
    m = Drop().double().eval()
    if how == "submodule":
        m.drop.train()
    if how == "train":
        m.train()
    b = {"x": torch.randn(5, 5, dtype=torch.float64) * 3, "y": torch.randint(0, 3, (5,))}
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=0.05, noise_multiplier=1.0, method=method, chunk_size=1)
    params = pdpsgd.trainable_params(m)
    assert pdpsgd.testing.check_sensitivity(step, params, b).max_ratio <= 1 + 1e-9
    outs = []
    for mask in (None, torch.tensor([False, True, True, True, True])):
        with torch.random.fork_rng():
            torch.manual_seed(3), random.seed(3), np.random.seed(3)
            outs.append(step.clipped_sum(params, b, mask).per_sample_norms)
    torch.testing.assert_close(outs[1][1:], outs[0][1:], rtol=0, atol=0)
    if how != "train":
        return
    # physical batches of one step: the middle one all padding (its example masked out) or not
    whole = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=0.05, noise_multiplier=0.0, method=method)
    last = []
    for mid in (torch.tensor([True, False]), torch.tensor([False, False])):
        with torch.random.fork_rng():
            torch.manual_seed(1)
            parts = [whole.clipped_sum(params, {k: v[i:i + 2] for k, v in b.items()}, mk) for i, mk in
                     ((0, torch.ones(2, dtype=torch.bool)), (2, mid), (3, torch.ones(2, dtype=torch.bool)))]
        last.append(parts[2].sums)
    for n in params:
        torch.testing.assert_close(last[1][n], last[0][n], rtol=0, atol=0)


@pytest.mark.parametrize("method", ["vmap", "bk"])
def test_skipped_padding_chunks_keep_the_losses_dtype(method):
    """An all-padding chunk that vmap skips gets zero losses in the real chunks' dtype (review, round
    37: float32 zeros, and the losses were cast to the last chunk's dtype: a float64 loss of 1e300
    became inf, the example counted as non-finite although summed, and the loss moved with chunk_size)."""
    torch.manual_seed(0)
    m = nn.Linear(3, 2).double().eval()
    loss = lambda mod, bb: F.cross_entropy(mod(bb["x"]), bb["y"], reduction="none") + 1e300
    b = {"x": torch.randn(4, 3, dtype=torch.float64), "y": torch.tensor([0, 1, 0, 1])}
    params = pdpsgd.trainable_params(m)
    mask = torch.tensor([True, True, False, False])
    parts = [pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1,
                                 chunk_size=c, on_nonfinite="raise", method=method).clipped_sum(params, b, mask)
             for c in (4, 2)]
    for p in parts:
        assert p.losses.dtype == torch.float64 and p.kept.tolist() == [True, True, False, False]
    assert torch.equal(parts[0].losses[mask], parts[1].losses[mask])  # (padding rows: run or skipped)
    assert parts[1].losses[2:].tolist() == [0.0, 0.0]  # (skipped: this model draws nothing in eval mode)


@pytest.mark.parametrize("method", ["vmap", "bk"])
def test_one_rule_decides_a_finite_loss(method):
    """A float64 loss of a float32 model beyond float32's range is finite: kept, summed and counted as
    kept (review, round 37: the weights tested the loss cast to float32 and dropped it, the step's
    count tested it as returned and kept it: num_nonfinite 0, on_nonfinite='raise' silent)."""
    torch.manual_seed(0)
    m = nn.Linear(3, 2).eval()
    loss = lambda mod, bb: F.cross_entropy(mod(bb["x"]), bb["y"], reduction="none").double() + bb["w"]
    b = {"x": torch.randn(3, 3), "y": torch.tensor([0, 1, 0]), "w": torch.tensor([0.0, 1e40, 0.0], dtype=torch.float64)}
    params = pdpsgd.trainable_params(m)
    step = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1,
                               method=method, on_nonfinite="raise")
    part = step.clipped_sum(params, b)
    assert part.kept.all()
    plain = step.clipped_sum(params, {**b, "w": torch.zeros(3, dtype=torch.float64)})
    for n in params:
        torch.testing.assert_close(part.sums[n], plain.sums[n])


def test_accumulation_refuses_a_part_twice_and_parts_of_other_parameter_values():
    """Review, round 39: ``p + p`` gave one example 2 C in a sum noised for C (num_examples 2), a part
    from before an optimizer step added to one from after it, and a part finalized twice released the
    same sum twice: each is refused; the physical batches of one step still add up."""
    torch.manual_seed(0)
    m = mlp()
    b = {"x": torch.randn(4, 5), "y": torch.randint(0, 3, (4,))}
    params = pdpsgd.trainable_params(m)
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    halves = [{k: v[i:i + 2] for k, v in b.items()} for i in (0, 2)]
    p1, p2 = (step.clipped_sum(params, h) for h in halves)
    with pytest.raises(ValueError, match="added twice"):
        p1 + p1
    with pytest.raises(ValueError, match="added twice"):
        (p1 + p2) + p2
    total = p1 + p2
    summed = sum([p1, p2])  # (round 43: ``sum(parts)`` starts from 0; a user's walkthrough got a TypeError)
    assert summed.ids == total.ids and all(torch.equal(summed.sums[n], total.sums[n]) for n in total.sums)
    with pytest.raises(TypeError):
        1 + p1
    out = step.finalize(total)
    with pytest.raises(ValueError, match="finalized already"):
        step.finalize(total)
    with pytest.raises(ValueError, match="finalized already"):
        step.finalize(p1)
    # another step object with the same clipping (review of round 39: each step knew only its own)
    twin = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    with pytest.raises(ValueError, match="finalized already"):
        twin.finalize(p2)
    opt = torch.optim.SGD(params.values(), lr=0.1)
    for n, p in params.items():
        p.grad = out.grads[n]
    opt.step()
    p3 = step.clipped_sum(params, halves[1])
    with pytest.raises(ValueError, match="different parameter values.*optimizer step"):
        p1 + p3
    with pytest.raises(ValueError, match="different parameter values"):
        step._empty_sum(params, torch.device("cpu")) + step.clipped_sum(params, halves[0]) + p2
    step.finalize(step.clipped_sum(params, halves[0]) + p3 + step._empty_sum(params, torch.device("cpu")))
    fresh = {n: v.detach().clone() for n, v in params.items()}  # (other tensors: nothing to compare)
    step.finalize(step.clipped_sum(fresh, halves[0]) + step.clipped_sum(params, halves[1]))


def test_finalize_refuses_a_sum_clipped_by_another_step():
    """A ClippedSum carries the clipping it was made with: finalize with a step of another bound (its
    noise calibrated to another C) and adding parts of two such steps are refused (review, round 37:
    parts clipped at C = 10 were noised for C = 0.1, 100x too little noise, silently)."""
    torch.manual_seed(0)
    m = mlp()
    b = {"x": torch.randn(4, 5), "y": torch.randint(0, 3, (4,))}
    params = pdpsgd.trainable_params(m)
    wide = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=10.0, noise_multiplier=1.0, expected_batch_size=4)
    tight = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=0.1, noise_multiplier=1.0, expected_batch_size=4)
    part = wide.clipped_sum(params, b)
    with pytest.raises(ValueError, match="clipped by another step"):
        tight.finalize(part)
    with pytest.raises(ValueError, match="clipped by another step"):
        part + tight.clipped_sum(params, b)
    twin = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=10.0, noise_multiplier=2.0, expected_batch_size=4)
    twin.finalize(part + twin.clipped_sum(params, b))  # (the same clipping: σ does not enter the sum)
    wide.finalize(wide.clipped_sum(params, b) + wide._empty_sum(params, torch.device("cpu")))


def test_a_mask_with_padding_and_no_expected_batch_size_warns_about_the_divisor():
    """Without expected_batch_size a noised step divides by the batch's size, padding rows included:
    said once (review, round 37: a padded last batch had its mean scaled by real/padded, silently);
    not for check_sensitivity's own masks (`pdpsgd check` printed it for batches without padding),
    after which it stays armed for the user's batches; not at σ = 0."""
    from pdpsgd.testing import check_sensitivity

    torch.manual_seed(0)
    m = mlp()
    b = {"x": torch.randn(4, 5), "y": torch.randint(0, 3, (4,))}
    params = pdpsgd.trainable_params(m)
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0)
    pad = torch.tensor([True, False, False, False])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(params, b)
        check_sensitivity(step, params, b)
        pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=0.0)(params, b, pad)
    # (review, round 45: parts added into one sum are divided by all their rows, which the warning now says)
    with pytest.warns(UserWarning, match="padding rows .* the number of rows it finalizes, .*parts added into one "
                                         "sum: all of their rows"):
        step(params, b, pad)


@pytest.mark.parametrize("method", ["vmap", "bk"])
def test_an_example_with_a_non_finite_loss_and_a_finite_gradient_is_dropped_from_the_sum(method):
    """Mutation review, round 40: the sums kept an example whose loss was inf (its gradient finite)
    while the step counted it dropped, unnoticed. It contributes nothing, as counted."""
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    loss = lambda mod, b: F.cross_entropy(mod(b["x"]), b["y"], reduction="none").double() + b["w"]
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    w = torch.tensor([0.0, math.inf, 0.0, 0.0], dtype=torch.float64)
    params = pdpsgd.trainable_params(m)
    step = pdpsgd.make_dp_step(m, loss, max_grad_norm=0.1, noise_multiplier=0.0, expected_batch_size=1,
                               method=method)
    out = step(params, {"x": x, "y": y, "w": w})
    assert out.num_nonfinite == 1
    keep = torch.tensor([0, 2, 3])
    ref = step(params, {"x": x[keep], "y": y[keep], "w": torch.zeros(3, dtype=torch.float64)})
    for n in params:
        torch.testing.assert_close(out.grads[n], ref.grads[n])


def test_a_finalize_that_fails_releases_nothing_and_leaves_the_part_finalizable():
    """Review of round 40: a part was marked finalized before the finalize's own checks, so one that
    failed (no expected_batch_size for an empty batch) could not be finalized by a step fixed after
    the error, though nothing was released."""
    torch.manual_seed(0)
    m = mlp()
    params = pdpsgd.trainable_params(m)
    loose = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0)
    part = loose.clipped_sum(params, {"x": torch.zeros(0, 5), "y": torch.zeros(0, dtype=torch.long)})
    assert part.ids
    with pytest.raises(ValueError, match="expected_batch_size"):
        loose.finalize(part)
    fixed = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    fixed.finalize(part)
    with pytest.raises(ValueError, match="finalized already"):
        fixed.finalize(part)


def test_without_expected_batch_size_the_divisor_is_the_padded_size_and_accumulation_keeps_the_counts():
    """Mutation review, round 40 (third pass): dividing by the count of real rows (private under
    Poisson sampling, and the release's scale would show it) instead of the physical batch's size,
    and an accumulated part whose mask / kept were swapped (num_examples, num_nonfinite and the loss
    then misreported), went unnoticed."""
    torch.manual_seed(0)
    m = mlp()
    params = pdpsgd.trainable_params(m)
    b = {"x": torch.randn(4, 5), "y": torch.randint(0, 3, (4,))}
    pad = torch.tensor([True, False, False, False])
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=0.0)
    part = step.clipped_sum(params, b, pad)
    out = step.finalize(part)
    for n in params:
        torch.testing.assert_close(out.grads[n], part.sums[n] / 4)
    x2 = torch.randn(4, 5)
    x2[1] = float("nan")
    drop = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=8,
                               on_nonfinite="drop")
    p1 = drop.clipped_sum(params, b, torch.tensor([True, True, True, False]))
    p2 = drop.clipped_sum(params, {"x": x2, "y": b["y"]})
    out = drop.finalize(p1 + p2)
    assert int(out.num_examples) == 7 and int(out.num_nonfinite) == 1 and bool(torch.isfinite(out.loss))
    per = torch.cat([p1.losses, p2.losses])
    kept = torch.cat([p1.kept, p2.kept])
    torch.testing.assert_close(out.loss, per[kept].mean())


def test_a_tied_tensor_under_two_names_is_refused_by_the_step():
    """Mutation review, round 40 (third pass): the step's refusal was tested only through the oracle's."""
    m = TiedLM()
    step = pdpsgd.make_dp_step(m, lambda mod, x: mod(x).pow(2).sum((1, 2)), max_grad_norm=1.0,
                               noise_multiplier=0.0)
    with pytest.raises(ValueError, match="same tied tensor"):
        step(dict(m.named_parameters(remove_duplicate=False)), torch.randint(0, 20, (3, 5)))


@pytest.mark.parametrize("where", ["root", "submodule"])
def test_all_padding_chunks_are_not_skipped_in_training_mode_under_an_own_generator(where):
    """Mutation review, round 40 (third pass): vmap skips an all-padding chunk only when no module is
    in training mode; the random-state watch alone sees only the global streams, and a module that
    draws from its own generator would get its draws moved by a masked-out row. With the generator
    restarted for each call, the sum over rows {0, 2} is the sum over all rows less row 1's. Also for
    a submodule in training mode under a root in eval mode (mutation review, round 42: reading the
    root's mode alone survived)."""
    class OwnNoise(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.g = torch.Generator()

        def forward(self, x):
            return self.lin(x + 0.5 * torch.randn(x.shape, generator=self.g))

    torch.manual_seed(0)
    inner = OwnNoise().double().train()
    m = inner if where == "root" else nn.Sequential(inner).eval()
    inner.train()
    params = pdpsgd.trainable_params(m)
    x = torch.randn(3, 3, dtype=torch.float64)
    step = pdpsgd.make_dp_step(m, lambda mod, b: mod(b).pow(2).sum(1), max_grad_norm=100.0, noise_multiplier=0.0,
                               method="vmap", chunk_size=1)

    def sums(mask):
        inner.g.manual_seed(7)
        return step.clipped_sum(params, x, torch.tensor(mask)).sums["lin.weight" if where == "root" else "0.lin.weight"]

    torch.testing.assert_close(sums([True, False, True]), sums([True, True, True]) - sums([False, True, False]))


def test_step_output_says_which_slots_are_real_and_kept():
    """``per_sample_norms`` has one entry per slot, padding included: ``mask`` and ``kept`` (review, round 42:
    after accumulating padded physical batches the norms could not be matched to the real examples)."""
    torch.manual_seed(3)
    m = nn.Linear(4, 3)
    b = {"x": torch.randn(6, 4), "y": torch.randint(0, 3, (6,))}
    b["x"][4] = float("nan")  # real, dropped as non-finite
    mask = torch.tensor([True, True, False, True, True, False])
    params = pdpsgd.trainable_params(m)
    for method in ("vmap", "bk"):
        step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4,
                                   method=method)
        out = step(params, b, mask)
        assert out.mask.tolist() == mask.tolist()
        assert out.kept.tolist() == [True, True, False, True, False, False]
        assert int(out.num_examples) == int(out.mask.sum()) and int(out.num_nonfinite) == int((out.mask & ~out.kept).sum())
        # accumulated parts: concatenated in the order they were added, as per_sample_norms
        part = step.clipped_sum(params, b, mask) + step.clipped_sum(params, {k: v[:2] for k, v in b.items()})
        acc = step.finalize(part)
        assert acc.per_sample_norms.shape == acc.mask.shape == acc.kept.shape == (8,)
        assert acc.mask.tolist() == mask.tolist() + [True, True]
        assert acc.kept.tolist() == out.kept.tolist() + [True, True]
        torch.testing.assert_close(acc.per_sample_norms[acc.kept][:3], out.per_sample_norms[out.kept])


def test_frozen_parameters_passed_in_params_warn_and_an_all_frozen_model_says_so():
    """A parameter the model froze (requires_grad=False) but the params dict names is trained: the step warns
    once per call site (review, round 42: Opacus users freeze with requires_grad_(False), and a dict of all
    named_parameters() trained the frozen layer silently); trainable_params leaves it out, with no warning.
    A model with nothing trainable names the cause, not just "params is empty"."""
    torch.manual_seed(4)
    m = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    m[0].requires_grad_(False)
    b = {"x": torch.randn(5, 4), "y": torch.randint(0, 3, (5,))}
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.warns(UserWarning, match=r"2 parameter\(s\) the model has frozen.*'0.weight'.*trains them"):
        out = step(dict(m.named_parameters()), b)
    assert float(out.grads["0.weight"].abs().sum()) > 0  # (trained indeed: what the warning says)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = step(pdpsgd.trainable_params(m), b)
        assert set(out.grads) == {"2.weight", "2.bias"}
        # the functional idiom: detached tensors of trainable parameters are not "frozen"
        step({n: p.detach() for n, p in pdpsgd.trainable_params(m).items()}, b)
    m.requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        step(pdpsgd.trainable_params(m), b)
    with pytest.raises(ValueError, match="params is empty: pass pdpsgd.trainable_params"):
        pdpsgd.make_dp_step(nn.Linear(2, 2), mlp_loss, max_grad_norm=1.0, noise_multiplier=0.0)({}, b)


# ---- tests for the survivors of a mutation review of clipping, per_sample, functional (round 42) ----
def test_a_flat_list_of_two_names_is_refused_and_one_name_is_one_group():
    """The flat-list guard's boundary: two names are as ambiguous as four; a single name reads as one group."""
    from pdpsgd.clipping import as_spec

    with pytest.raises(ValueError, match="flat list of parameter names"):
        as_spec(["0.weight", "0.bias"])
    m, _ = mlp_case(3, 6, 4, 5)
    with pytest.raises(ValueError, match="flat list of parameter names"):
        pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=0.3, noise_multiplier=0.0, clipping=["0.weight", "0.bias"])
    assert as_spec(["0.weight"]) == [["0.weight"]]


def test_an_empty_clipping_group_and_a_zero_budget_weight_are_refused_by_name():
    from pdpsgd.clipping import make_groups

    with pytest.raises(ValueError, match="clipping group 1 is empty"):
        make_groups(["a", "b"], [["a", "b"], []], 1.0)
    with pytest.raises(ValueError, match="clipping group 0 is empty"):
        make_groups(["a", "b"], {"none": [], "all": ["a", "b"]}, 1.0)
    for budget in ([1.0, 0.0], [0.0, 0.0], [0, 2]):  # (an all-zero budget divided by zero)
        with pytest.raises(ValueError, match="budget needs 2 positive finite weights"):
            make_groups(["a", "b"], [["a"], ["b"]], 1.0, budget=budget)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("method", ["vmap", "bk"])
def test_automatic_clipping_matches_the_oracle(clipping, method):
    """C / (‖g‖ + γ) exactly (the hypothesis test's derandomised draws reached clip_fn='automatic' on
    all-padding batches only, whose sums are 0 whatever the formula: C / max(‖g‖, γ) survived)."""
    m, b = mlp_case(1, 5, 4, 5)
    for gamma in (0.01, 0.5):
        assert_exact(m, mlp_loss, b, method=method, max_grad_norm=0.5, clipping=clipping, clip_fn="automatic",
                     gamma=gamma, rtol=1e-9)


def test_default_chunk_is_one_example_for_a_model_past_the_budget():
    from pdpsgd.per_sample import CPU_CHUNK_BUDGET_ELEMS, default_chunk_size

    assert default_chunk_size(8, 355_000_000) == 1
    assert default_chunk_size(8, CPU_CHUNK_BUDGET_ELEMS + 1) == 1
    assert default_chunk_size(0, 10) == 1


def test_model_structure_layout_sees_requires_grad_and_an_instance_forward():
    """The structure key drops the step's memos (probe, example-order verdicts) when a parameter is frozen or
    unfrozen, or a module's forward is replaced on the instance (a patched forward may mix examples)."""
    import types

    from pdpsgd.functional import model_structure

    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    k0 = model_structure(m)[0][0]
    assert model_structure(m)[0][0] == k0
    m[2].weight.requires_grad_(False)
    assert model_structure(m)[0][0] != k0
    m[2].weight.requires_grad_(True)
    assert model_structure(m)[0][0] == k0
    m[0].forward = types.MethodType(
        lambda self, x: nn.Linear.forward(self, x).mean(0, keepdim=True).expand_as(nn.Linear.forward(self, x)), m[0])
    assert model_structure(m)[0][0] != k0


# ---- tests for the survivors of the rest of that mutation review (round 42, 24 mutants, 7 real survivors) ----
def test_a_forward_that_has_drawn_once_never_has_padding_chunks_skipped():
    """Once a chunk has moved the random state every later chunk runs, even if a later chunk draws
    nothing; else a masked chunk skipped after a quiet one shifts the later examples' draws."""
    import random

    calls = [0]

    class EveryOther(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(5, 7), nn.Linear(7, 3)

        def forward(self, x):
            calls[0] += 1
            s = 0.5 + random.random() if calls[0] % 2 else 1.0  # (draws on odd calls only)
            return self.b(torch.tanh(self.a(x)) * s)

    torch.manual_seed(0)
    m = EveryOther().double().eval()
    b = {"x": torch.randn(4, 5, dtype=torch.float64) * 3, "y": torch.randint(0, 3, (4,))}
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=0.05, noise_multiplier=0.0, expected_batch_size=1,
                               method="vmap", chunk_size=1)
    params = pdpsgd.trainable_params(m)
    keep = torch.tensor([True, True, False, True])
    outs = []
    for mask in (None, keep):
        calls[0] = 0
        random.seed(3)
        outs.append(step.clipped_sum(params, b, mask).per_sample_norms)
    torch.testing.assert_close(outs[1][keep], outs[0][keep], rtol=0, atol=0)


def test_an_fp16_gradient_whose_square_overflows_fp16_is_clipped_not_dropped():
    """Finite fp16 gradients whose squares pass 65504: the norm is taken in float32, the example kept."""
    torch.manual_seed(0)
    m = nn.Linear(4, 2).half()
    loss = lambda mod, b: (mod(b["x"]).float() * 1000.0).sum(1)  # noqa: E731
    b = {"x": torch.ones(3, 4).half()}
    params = pdpsgd.trainable_params(m)
    for method in ("vmap", "bk"):
        step = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=3,
                                   method=method)
        part = step.clipped_sum(params, b)
        assert part.kept.tolist() == [True, True, True]
        torch.testing.assert_close(part.per_sample_norms.double(),
                                   torch.full((3,), 1000.0 * 10 ** 0.5, dtype=torch.float64), rtol=1e-6, atol=0)
        out = step(params, b)
        assert int(out.num_nonfinite) == 0 and all(bool(torch.isfinite(g).all()) for g in out.grads.values())


@pytest.mark.parametrize("method", ["vmap", "bk"])
def test_b_containers_of_tensors_are_not_taken_for_per_example_values(method):
    """A batch of as many containers of tensors as examples (a tuple of tuples, a list of dicts) is a pytree of
    tensors, not a list of per-example values (the check looks into the containers)."""
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    x, y = torch.randn(2, 3), torch.tensor([0, 1])
    params = pdpsgd.trainable_params(m)
    ref = pdpsgd.make_dp_step(m, lambda mod, b: F.cross_entropy(mod(b[0]), b[1], reduction="none"), max_grad_norm=1.0,
                              noise_multiplier=0.0, expected_batch_size=2, method=method)(params, (x, y))
    for batch, lf in ((((x, torch.ones(2, 3)), (y,)),
                       lambda mod, b: F.cross_entropy(mod(b[0][0] * b[0][1]), b[1][0], reduction="none")),
                      ([{"x": x}, {"y": y}],
                       lambda mod, b: F.cross_entropy(mod(b[0]["x"]), b[1]["y"], reduction="none"))):
        step = pdpsgd.make_dp_step(m, lf, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=2, method=method)
        out = step(params, batch)
        for n in params:
            torch.testing.assert_close(out.grads[n], ref.grads[n])


# ----------------------------------------------------------------------------------
# mutation review of step.py, round 44: each test below fails under a mutant the suite had let pass
# ----------------------------------------------------------------------------------


def _mr_mlp(seed=0, d_in=5, hidden=7, n_out=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, n_out)).double()


def _mr_loss(model, b):
    return F.cross_entropy(model(b["x"]), b["y"], reduction="none")


def _mr_batch(B, seed=0, d_in=5, n_out=3):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(B, d_in, generator=g, dtype=torch.float64),
            "y": torch.randint(0, n_out, (B,), generator=g)}


def _mr_sum_loss(model, b):
    return model(b["x"]).sum(1)


def test_padding_with_expected_batch_size_does_not_warn_about_the_divisor():
    """Mutation review, round 44: (a false 'divides by the batch's size' warning
    when the divisor is the fixed expected_batch_size)."""
    m = _mr_mlp()
    params = pdpsgd.trainable_params(m)
    step = pdpsgd.make_dp_step(m, _mr_loss, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4,
                               generator=torch.Generator().manual_seed(0), noise_rng="numpy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(params, _mr_batch(4), torch.tensor([True, False, True, False]))


@pytest.mark.parametrize("clipping", ["per_layer", [["weight"], ["bias"]]])
def test_clip_fraction_counts_a_clip_in_any_group_not_only_the_last(clipping):
    """Mutation review, round 44: (only the last group's clip counted). Weight group (first) is clipped, bias group (last) is not."""
    torch.manual_seed(0)
    m = nn.Linear(4, 3).double()
    params = pdpsgd.trainable_params(m)
    b = {"x": torch.full((2, 4), 10.0, dtype=torch.float64)}
    # d loss / d out = 1: ||g_bias|| = sqrt(3) = 1.73 < C/sqrt(2) = 3.54 < ||g_weight|| = 20 sqrt(3)
    step = pdpsgd.make_dp_step(m, _mr_sum_loss, max_grad_norm=5.0, noise_multiplier=0.0, clipping=clipping)
    out = step(params, b)
    assert float(out.clip_fraction) == 1.0


def test_automatic_clipping_reports_every_kept_example_as_clipped():
    """Mutation review, round 44: (automatic clipping rescales every example: clip_fraction is 1, padding and dropped rows excluded)."""
    m = _mr_mlp()
    params = pdpsgd.trainable_params(m)
    step = pdpsgd.make_dp_step(m, _mr_loss, max_grad_norm=1e3, noise_multiplier=0.0, clip_fn="automatic")
    out = step(params, _mr_batch(5), torch.tensor([True, True, False, True, False]))
    assert float(out.clip_fraction) == 1.0


def test_per_group_clip_fraction_uses_each_groups_own_norm():
    """Mutation review, round 44: (each group judged by the total norm). Both groups'
    norms (sqrt 3) are under C/sqrt 2, the total (sqrt 6) is over it: nothing is clipped."""
    m = nn.Linear(4, 3).double()
    params = pdpsgd.trainable_params(m)
    b = {"x": torch.full((3, 4), 0.5, dtype=torch.float64)}  # ||x|| = 1: ||g_w|| = ||g_b|| = sqrt 3
    step = pdpsgd.make_dp_step(m, _mr_sum_loss, max_grad_norm=3.0, noise_multiplier=0.0, clipping="per_layer")
    out = step(params, b)
    assert float(out.clip_fraction) == 0.0
    # and the sum is the unclipped one (factor 1 for every example)
    for n, p in m.named_parameters():
        ref = torch.autograd.grad(_mr_sum_loss(m, b).sum(), p)[0] / 3
        torch.testing.assert_close(out.grads[n], ref, rtol=1e-12, atol=0)


def _noisy_step(m, **kw):
    return pdpsgd.make_dp_step(m, _mr_loss, max_grad_norm=1.0, noise_multiplier=1.0, noise_rng="numpy",
                               generator=torch.Generator().manual_seed(0), **kw)


def test_a_batch_size_that_shrinks_warns_about_the_divisor():
    """Mutation review, round 44: (a Poisson batch smaller than the first one revealed its size by the divisor, unwarned)."""
    m = _mr_mlp()
    params = pdpsgd.trainable_params(m)
    step = _noisy_step(m)
    step(params, _mr_batch(6))
    with pytest.warns(UserWarning, match=r"batch size changed between steps \(6 -> 5\)"):
        step(params, _mr_batch(5))


def test_the_divisor_warning_is_given_once():
    """Mutation review, round 44: (warned at every step whose size differs from the first, not once)."""
    m = _mr_mlp()
    params = pdpsgd.trainable_params(m)
    step = _noisy_step(m)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for B in (4, 5, 6, 3):
            step(params, _mr_batch(B))
    assert len([w for w in rec if "batch size changed" in str(w.message)]) == 1


def test_clip_fraction_is_over_the_kept_examples_not_the_dropped_ones():
    """Mutation review, round 44: (a dropped non-finite example counted as an unclipped one)."""
    m = _mr_mlp()
    params = pdpsgd.trainable_params(m)
    b = _mr_batch(4)
    b["x"][1] = float("nan")
    step = pdpsgd.make_dp_step(m, _mr_loss, max_grad_norm=1e-6, noise_multiplier=0.0)  # every finite one clipped
    out = step(params, b)
    assert int(out.num_nonfinite) == 1 and int(out.num_examples) == 4
    assert float(out.clip_fraction) == 1.0


def test_step_output_reports_the_noise_std_sigma_C():
    """Mutation review, round 44: (StepOutput.noise_std, what a user logs, said σ instead of σ·C)."""
    m = _mr_mlp()
    params = pdpsgd.trainable_params(m)
    step = pdpsgd.make_dp_step(m, _mr_loss, max_grad_norm=0.5, noise_multiplier=1.3, expected_batch_size=4,
                               noise_rng="numpy", generator=torch.Generator().manual_seed(0))
    out = step(params, _mr_batch(4))
    assert out.noise_std == pytest.approx(0.65, rel=1e-12)
    out0 = pdpsgd.make_dp_step(m, _mr_loss, max_grad_norm=0.5, noise_multiplier=0.0)(params, _mr_batch(4))
    assert out0.noise_std == 0.0


def test_all_zero_gradients_warn_even_next_to_a_dropped_non_finite_example():
    """Mutation review, round 44: (a NaN row's norm hid that every kept example's gradient is exactly 0)."""
    m = nn.Linear(3, 2).double()
    params = pdpsgd.trainable_params(m)
    b = {"x": torch.ones(3, 3, dtype=torch.float64)}
    b["x"][2] = float("nan")
    step = pdpsgd.make_dp_step(m, lambda mod, bb: mod(bb["x"]).sum(1) * 0.0, max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.warns(UserWarning, match="exactly 0"):
        out = step(params, b)
    assert int(out.num_nonfinite) == 1


def test_the_padding_warning_is_given_once():
    """Mutation review, round 44: (the warning repeated every padded step)."""
    m = _mr_mlp()
    params = pdpsgd.trainable_params(m)
    step = _noisy_step(m)
    pad = torch.tensor([True, True, False, False])
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            step(params, _mr_batch(4), pad)
    assert len([w for w in rec if "padding rows" in str(w.message)]) == 1


def test_a_fractional_expected_batch_size_is_the_exact_divisor():
    """Mutation review, round 44: (q·N is rarely an integer: 2.5 must divide by 2.5, not 2 or 3)."""
    m = _mr_mlp()
    params = pdpsgd.trainable_params(m)
    step = pdpsgd.make_dp_step(m, _mr_loss, max_grad_norm=0.3, noise_multiplier=0.0, expected_batch_size=2.5)
    b = _mr_batch(3)
    part = step.clipped_sum(params, b)
    out = step.finalize(part)
    for n in params:
        torch.testing.assert_close(out.grads[n], part.sums[n] / 2.5, rtol=1e-13, atol=0)


def test_an_all_padding_batch_without_expected_batch_size_divides_by_its_size():
    """Mutation review, round 44: (a non-empty batch of
    padding rows only was refused; its size, not its real count, is the divisor, so it is a zero step)."""
    m = _mr_mlp()
    params = pdpsgd.trainable_params(m)
    step = pdpsgd.make_dp_step(m, _mr_loss, max_grad_norm=1.0, noise_multiplier=0.0)
    out = step(params, _mr_batch(3), torch.zeros(3, dtype=torch.bool))
    assert int(out.num_examples) == 0
    assert all(not bool(g.any()) for g in out.grads.values())


def test_gamma_does_not_enter_an_abadi_steps_clipping_key():
    """Mutation review, round 44: (γ is unused by 'abadi' clipping: a part of one abadi step is finalized by another of the same C)."""
    m = _mr_mlp()
    params = pdpsgd.trainable_params(m)
    a = pdpsgd.make_dp_step(m, _mr_loss, max_grad_norm=1.0, noise_multiplier=0.0, gamma=0.01)
    b = pdpsgd.make_dp_step(m, _mr_loss, max_grad_norm=1.0, noise_multiplier=0.0, gamma=0.5)
    part = a.clipped_sum(params, _mr_batch(3))
    out = b.finalize(part + b.clipped_sum(params, _mr_batch(2, seed=1)))
    assert int(out.num_examples) == 5


def test_parts_of_different_parameter_sets_are_refused_in_either_order():
    """Mutation review, round 44: (a part over fewer
    parameters plus one over more silently dropped the extra parameters' sums)."""
    m = _mr_mlp()
    full = pdpsgd.trainable_params(m)
    sub = {k: v for k, v in full.items() if k.startswith("2.")}
    step = pdpsgd.make_dp_step(m, _mr_loss, max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(ValueError, match="different parameter sets"):
        step.clipped_sum(sub, _mr_batch(3)) + step.clipped_sum(full, _mr_batch(3, seed=1))
    with pytest.raises(ValueError, match="different parameter sets"):
        step.clipped_sum(full, _mr_batch(3)) + step.clipped_sum(sub, _mr_batch(3, seed=1))


def test_a_sum_holding_one_already_finalized_part_is_refused():
    """Mutation review, round 44: (finalize(p1) then
    finalize(p1 + p2) released p1's examples twice: two noisy releases the accountant counts as one)."""
    m = _mr_mlp()
    params = pdpsgd.trainable_params(m)
    step = pdpsgd.make_dp_step(m, _mr_loss, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4)
    p1 = step.clipped_sum(params, _mr_batch(2))
    p2 = step.clipped_sum(params, _mr_batch(2, seed=1))
    step.finalize(p1)
    with pytest.raises(ValueError, match="finalized already"):
        step.finalize(p1 + p2)
    with pytest.raises(ValueError, match="finalized already"):
        step.finalize(p2 + p1)


@pytest.mark.parametrize("option", ["max_grad_norm", "noise_multiplier", "expected_batch_size"])
def test_a_bool_is_not_a_number_option(option):
    """Mutation review, round 44: ``noise_multiplier=False`` was read as σ = 0 (a step without noise, no warning),
    ``max_grad_norm=True`` as C = 1; a bool (Python, NumPy or a bool tensor) is refused by name."""
    import numpy as np

    m = _mr_mlp()
    for v in (True, False, np.bool_(True), torch.tensor(True)):
        kw = dict(max_grad_norm=1.0, noise_multiplier=1.0)
        kw[option] = v
        with pytest.raises(TypeError, match=f"{option} must be a real number, got the bool"):
            pdpsgd.make_dp_step(m, _mr_loss, **kw)
    kw = dict(max_grad_norm=1.0, noise_multiplier=1.0)
    kw[option] = np.float32(2.0)
    assert getattr(pdpsgd.make_dp_step(m, _mr_loss, **kw), option) == 2.0


def test_a_part_finalized_long_ago_is_still_refused():
    """Round 46: the finalized part ids were remembered for the last 4096 only, so a part finalized again after
    4096 other finalizations in the process was released twice. Now a bit set of every id (one bit per part)."""
    from pdpsgd import step as step_mod

    m = mlp()
    params = pdpsgd.trainable_params(m)
    st = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    b = {"x": torch.randn(4, 5), "y": torch.randint(0, 3, (4,))}
    old, other = st.clipped_sum(params, b), st.clipped_sum(params, b)
    st.finalize(old)
    for _ in range(10_000):  # (as many other parts made and finalized since)
        step_mod._mark_finalized(step_mod._next_part_id(), True)
    with pytest.raises(ValueError, match="finalized already"):
        st.finalize(old)
    st.finalize(other)  # (an id below the others, never finalized: not refused)
    with pytest.raises(ValueError, match="finalized already"):
        st.finalize(other)


def test_a_noise_std_past_the_sums_dtype_is_refused():
    """Round 46: σ·C = 1e38 with float32 sums could give ±inf noise coordinates (drawn at σC / divisor), handed to
    the optimizer silently. The divisor counts (review): σ·C = 1e38 over 1e6 expected examples is fine."""
    m = mlp()
    b = {"x": torch.randn(4, 5), "y": torch.randint(0, 3, (4,))}
    big = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1e30, noise_multiplier=1e8, expected_batch_size=4)
    with pytest.raises(OverflowError, match="too large for torch.float32"):
        big(pdpsgd.trainable_params(m), b)
    for sigma, denom in ((1e6, 4), (1e8, 1e6)):
        ok = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1e30, noise_multiplier=sigma, expected_batch_size=denom)
        assert all(torch.isfinite(g).all() for g in ok(pdpsgd.trainable_params(m), b).grads.values())
    m64 = mlp().double()  # (float64 sums hold it)
    b64 = {"x": b["x"].double(), "y": b["y"]}
    out = pdpsgd.make_dp_step(m64, mlp_loss, max_grad_norm=1e30, noise_multiplier=1e8, expected_batch_size=4)(
        pdpsgd.trainable_params(m64), b64)
    assert all(torch.isfinite(g).all() for g in out.grads.values())


def test_part_ids_of_other_processes_do_not_collide():
    """Review, round 46: part ids were 1, 2, ... in every process, so a worker's part added to the main process's
    own was refused as added twice, and one finalized there as finalized already. Ids now start at a random base per
    process (drawn again in a forked child); ids not made here are kept finalized exactly, in a set."""
    import multiprocessing as mp

    from pdpsgd import step as step_mod

    if "fork" not in mp.get_all_start_methods():
        pytest.skip("no fork start method here")
    m = mlp()
    params = pdpsgd.trainable_params(m)
    st = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8)
    b = {"x": torch.randn(4, 5), "y": torch.randint(0, 3, (4,))}
    here = st.clipped_sum(params, b)
    with mp.get_context("fork").Pool(2) as pool:  # (two workers forked from one state)
        first, second = pool.map(_child_part_ids, [0, 1], chunksize=1)
    assert not set(first) & set(second) and not (set(first) | set(second)) & set(here.ids)
    one, two = here._replace(ids=tuple(first)), here._replace(ids=tuple(second))  # (the workers' parts, as received)
    st.finalize(here + one + two)
    with pytest.raises(ValueError, match="finalized already"):
        st.finalize(two)
    for forged in (-5, 2 ** 80, (7 << 40) + (1 << 39)):  # (no such ids are made: kept in a set, no huge bit set)
        assert not step_mod._finalized(forged)
        step_mod._mark_finalized(forged, True)
        assert step_mod._finalized(forged)
    assert sum(len(b) for b in step_mod._FINALIZED.values()) < 1 << 22
    # a forked child keeps the parent's finalized parts (the hook a fork runs in the child, run here)
    token = step_mod._PART_TOKEN
    try:
        step_mod._new_part_token()
        assert step_mod._PART_TOKEN != token
        with pytest.raises(ValueError, match="finalized already"):
            st.finalize(here)
    finally:
        step_mod._PART_TOKEN = token


def _child_part_ids(_):
    import time

    from pdpsgd import step as step_mod

    time.sleep(0.2)  # (each worker takes one task; no torch op in a forked child: its thread pool may hang)
    return [step_mod._next_part_id() for _ in range(3)]
