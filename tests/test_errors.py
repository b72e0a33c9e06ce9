"""Bad input gets a clear error that names the problem and the fix."""
import math
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pdpsgd
from models import mlp, mlp_loss


def batch(B=4):
    return {"x": torch.randn(B, 5), "y": torch.randint(0, 3, (B,))}


def test_batchnorm_in_training_is_refused_and_eval_is_fine():
    m = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    with pytest.raises(ValueError, match="mixes examples.*GroupNorm"):
        pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0)
    m.eval()
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0)
    m.train()  # switched back after construction: still caught at call time
    with pytest.raises(ValueError, match="mixes examples"):
        step(pdpsgd.trainable_params(m), batch())


@pytest.mark.parametrize("method", ["vmap", "bk"])
def test_batchnorm_without_running_stats_is_refused_in_eval_mode_too(method):
    """track_running_stats=False: batch statistics in eval mode as well (it mixes examples)."""
    m = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4, affine=False, track_running_stats=False),
                      nn.Linear(4, 3)).eval()
    with pytest.raises(ValueError, match="track_running_stats=False.*mixes examples"):
        pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0, method=method)


@pytest.mark.parametrize("method", ["vmap", "bk", "auto"])
@pytest.mark.parametrize("frozen", [False, True])
def test_embedding_max_norm_is_refused(method, frozen):
    """Embedding(max_norm=...) rescales the batch's weight rows in place in every forward (train and
    eval): a noise-free, data-dependent edit of the model. Refused before it can happen, even frozen."""
    emb = nn.Embedding(10, 4, max_norm=1.0)
    m = nn.Sequential(emb, nn.Flatten(), nn.Linear(12, 3)).eval()
    emb.weight.requires_grad_(not frozen)
    w0 = emb.weight.detach().clone()
    loss = lambda mod, b: F.cross_entropy(mod(b["x"]), b["y"], reduction="none")  # noqa: E731
    with pytest.raises(ValueError, match=r"max_norm=1\.0.*in place.*max_norm=None"):
        step = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=1.0, method=method)
    emb.max_norm = None
    step = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=1.0, method=method)
    emb.max_norm = 1.0  # set after construction: still caught at call time, before any forward
    with pytest.raises(ValueError, match="max_norm"):
        step(pdpsgd.trainable_params(m), {"x": torch.randint(0, 10, (4, 3)), "y": torch.randint(0, 3, (4,))})
    assert torch.equal(emb.weight, w0)


def test_scalar_loss_is_refused():
    m = mlp()
    step = pdpsgd.make_dp_step(m, lambda mod, b: F.cross_entropy(mod(b["x"]), b["y"]), max_grad_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="reduction='none'"):
        step(pdpsgd.trainable_params(m), batch())


class _Unruled(nn.Linear):
    """A Linear whose forward is its own (no rule: the exact fallback under book-keeping)."""

    def forward(self, x):
        return super().forward(x) * 1.0


@pytest.mark.parametrize("method", ["vmap", "bk", "auto"])
@pytest.mark.parametrize("how", ["detach", "no_grad", "detached_output"])
@pytest.mark.parametrize("first", ["ruled", "unruled"])
def test_loss_that_does_not_reach_the_parameters_is_refused(method, how, first):
    """A loss that depends on none of the trained parameters would give gradients of 0 (noise alone,
    silently; review of round 31): refused, naming the cause, under every method, whether the layers
    are on rules or on the exact fallback. A loss that reaches only some of them is fine.
    ``detached_output``: the model's output detached, compared with the batch's float inputs, which
    book-keeping's capture puts in the autograd graph (round 49): the losses need a gradient through
    the inputs alone, and are refused as well."""
    m = nn.Sequential(nn.Linear(5, 4) if first == "ruled" else _Unruled(5, 4), nn.Tanh(), nn.Linear(4, 3))

    def loss(model, b):
        if how == "no_grad":
            with torch.no_grad():
                return mlp_loss(model, b)
        if how == "detached_output":
            return (model(b["x"]).detach() - b["x"][:, :3]).pow(2).sum(1)
        out = mlp_loss(model, b)
        return out.detach()

    step = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=1.0, method=method)
    with pytest.raises(ValueError, match="do not depend on the trained parameters.*require grad"):
        step(pdpsgd.trainable_params(m), batch())
    head = {n: p for n, p in pdpsgd.trainable_params(m).items() if n.startswith("2.")}
    frozen_first = lambda model, b: F.cross_entropy(model[2](model[1](model[0](b["x"]).detach())), b["y"],  # noqa: E731
                                                    reduction="none")
    out = pdpsgd.make_dp_step(m, frozen_first, max_grad_norm=1.0, noise_multiplier=0.0, method=method)(head, batch())
    assert all(bool(g.abs().sum() > 0) for g in out.grads.values())


def test_wrong_loss_shape_is_refused():
    m = mlp()
    step = pdpsgd.make_dp_step(m, lambda mod, b: mod(b["x"]).reshape(-1), max_grad_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match=r"shape \[B\]"):
        step(pdpsgd.trainable_params(m), batch())


def test_batch_dims_disagree():
    m = mlp()
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="batch dims disagree"):
        step(pdpsgd.trainable_params(m), {"x": torch.randn(4, 5), "y": torch.zeros(3, dtype=torch.long)})


def test_params_not_of_the_model():
    m = mlp()
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="does not belong to the model"):
        step({"fc.weight": torch.zeros(3, 5)}, batch())
    with pytest.raises(ValueError, match="shape"):
        step({"0.weight": torch.zeros(3, 3)}, batch())
    with pytest.raises(ValueError, match="empty"):
        step({}, batch())


@pytest.mark.parametrize("kwargs,match", [
    ({"chunk_size": 0}, "chunk_size"),
    ({"chunk_size": -3}, "chunk_size"),
    ({"max_grad_norm": 0.0}, "max_grad_norm"),
    ({"max_grad_norm": -1.0}, "max_grad_norm"),
    ({"noise_multiplier": -0.1}, "noise_multiplier"),
    ({"noise_multiplier": float("nan")}, "noise_multiplier"),
    ({"method": "fast"}, "method"),
    ({"clip_fn": "soft"}, "clip_fn"),
    ({"clipping": "per_neuron"}, "clipping"),
    ({"expected_batch_size": 0}, "expected_batch_size"),
    ({"max_grad_norm": float("inf")}, "unbounded"),
])
def test_bad_options(kwargs, match):
    opts = {"max_grad_norm": 1.0, "noise_multiplier": 1.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        step = pdpsgd.make_dp_step(mlp(), mlp_loss, **opts)
        step(pdpsgd.trainable_params(step.model), batch())


def test_mask_of_wrong_shape():
    m = mlp()
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="mask"):
        step(pdpsgd.trainable_params(m), batch(4), mask=torch.ones(3, dtype=torch.bool))


def test_data_dependent_control_flow_is_explained():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 3)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent Python branch
                return self.lin(x)
            return -self.lin(x)

    m = Branchy()
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(RuntimeError, match="branches on tensor values.*method='bk'"):
        step(pdpsgd.trainable_params(m), batch())


class _OldStyleGelu(torch.autograd.Function):
    """A custom autograd.Function with ``ctx`` in forward (no setup_context), as transformers' BloomGelu."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(1.702 * x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(1.702 * x)
        return g * (s + 1.702 * x * s * (1 - s))


def test_vmap_errors_of_old_style_autograd_functions_and_dynamic_shapes_are_explained():
    """Review, round 42 (a zoo sweep in train mode): BLOOM's train-mode gelu (an autograd.Function without
    setup_context) and BartForSequenceClassification's unique_consecutive (a dynamic-shape op) failed under
    vmap with torch's raw functorch message; both name the cause and the fix now, and method='bk' runs both."""
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(5, 4), nn.Linear(4, 3)

        def forward(self, x):
            return self.b(_OldStyleGelu.apply(self.a(x)))

    def dynamic_loss(model, b):  # the number of distinct labels in each example's own row: a dynamic shape
        out = model(b["x"])
        n = torch.unique_consecutive(b["y"]).numel()
        return F.cross_entropy(out, b["y"], reduction="none") * (1.0 + 0 * n)

    torch.manual_seed(0)
    for m, loss, match in ((Custom(), mlp_loss, "autograd.Function written without a setup_context.*method='bk'"),
                           (mlp(5, 4, 3), dynamic_loss, "output shape depends on the values.*method='bk'")):
        params = pdpsgd.trainable_params(m)
        with pytest.raises(RuntimeError, match=match):
            pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, method="vmap")(params, batch())
        out = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, method="bk")(params, batch())
        assert set(out.routes.values()) <= {"ghost", "explicit"}


class _Checkpointed(nn.Module):
    """x -> a -> checkpoint(b -> tanh -> c) -> d: the checkpointed block's input requires grad."""

    def __init__(self, reentrant):
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(5, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3)
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(lambda t: self.c(torch.tanh(self.b(t))), torch.tanh(self.a(x)), use_reentrant=self.reentrant)
        return self.d(h)


def test_gradient_checkpointing_runs_under_bk_and_is_explained_under_vmap():
    """Non-reentrant activation checkpointing (Hugging Face's default): method='bk'/'auto' run it
    exactly (the backward's recomputation sees the same parameters, and is not recorded twice);
    vmap cannot, and says so with the fix."""
    from pdpsgd.testing import assert_exact

    torch.manual_seed(0)
    m = _Checkpointed(reentrant=False)
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(RuntimeError, match="gradient checkpointing.*method='bk'"):
        step(pdpsgd.trainable_params(m), batch())
    for method in ("bk", "auto"):
        r = assert_exact(m, mlp_loss, batch(), method=method, max_grad_norm=0.5)
        assert set(r.routes.values()) <= {"ghost", "explicit"}
    before = {n: p.clone() for n, p in m.named_parameters()}
    pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0, method="bk")(
        pdpsgd.trainable_params(m), batch())
    for n, p in m.named_parameters():  # the model's own parameters are back in place, unchanged
        assert isinstance(p, nn.Parameter) and torch.equal(p, before[n]) and p.grad is None


def test_reentrant_checkpointing_is_refused_by_bk():
    """use_reentrant=True runs the block without gradients in the forward: book-keeping cannot
    capture it, so it refuses with the fix instead of training b and c as if their gradient were 0."""
    torch.manual_seed(0)
    m = _Checkpointed(reentrant=True)
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0, method="bk")
    with pytest.raises(RuntimeError, match="book-keeping cannot capture.*use_reentrant=False"):
        step(pdpsgd.trainable_params(m), batch())


class _NoGradAndCheckpoint(nn.Module):
    """The same layers used under no_grad and inside non-reentrant checkpoints (review cases)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 3)
        self.pos = nn.Embedding(6, 5)
        self.rnn = nn.LSTM(5, 5, batch_first=True)

    def block(self, h):
        with torch.no_grad():
            p = torch.sigmoid(self.pos(torch.arange(h.shape[1])[None]))  # (1, T, d): broadcast, no gradient
            t, _ = self.rnn(h)  # a custom-forward rule under no_grad
        return torch.tanh(self.a(h)) * p + 0.1 * t

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        with torch.no_grad():
            gate = self.a(x).mean((1, 2)).unsqueeze(1)  # a used without gradients too
        h = checkpoint(self.block, x, use_reentrant=False)
        h2, _ = self.rnn(h)
        return self.b(h2.mean(1)) * torch.sigmoid(gate)


@pytest.mark.parametrize("method", ["bk", "auto"])
def test_no_grad_uses_inside_and_outside_checkpoints_exact(method):
    from pdpsgd.testing import assert_exact

    torch.manual_seed(0)
    b = {"x": torch.randn(4, 6, 5), "y": torch.randint(0, 3, (4,))}
    r = assert_exact(_NoGradAndCheckpoint(), mlp_loss, b, method=method, max_grad_norm=0.5)
    assert "vmap" not in r.routes.values()


@pytest.mark.parametrize("method", ["vmap", "bk", "auto"])
def test_instance_norm_updating_running_stats_is_refused(method):
    """InstanceNorm(track_running_stats=True) in training mode normalises each example by its own
    statistics but updates its running ones in place from the batch (no noise): refused, as opacus'
    validator refuses it; in eval mode (the running statistics read, not written) it runs, on its rule."""
    inorm = nn.InstanceNorm1d(4, affine=True, track_running_stats=True)
    m = nn.Sequential(nn.Conv1d(3, 4, 3), inorm, nn.Flatten(), nn.Linear(4 * 5, 3))
    loss = lambda mod, b: F.cross_entropy(mod(b["x"]), b["y"], reduction="none")  # noqa: E731
    b = {"x": torch.randn(4, 3, 7), "y": torch.randint(0, 3, (4,))}
    with pytest.raises(ValueError, match=r"InstanceNorm1d\(track_running_stats=True\).*running statistics"
                                         r".*track_running_stats=False"):
        pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=1.0, method=method)
    inorm.eval()
    step = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, method=method)
    rm = inorm.running_mean.clone()
    out = step(pdpsgd.trainable_params(m), b)
    assert torch.equal(inorm.running_mean, rm)
    assert out.routes["1.weight"] == ("vmap" if method == "vmap" else "explicit")


class _RunningMean(nn.Module):
    """A custom layer that keeps a running mean of its input in a buffer, updated in the forward
    (``how``: "buffer" in place; "data" through ``.data``; "numpy" through a numpy view; "storage"
    through the untyped storage; "rebind": ``.data`` set to a new tensor; "frozen": a frozen parameter
    edited in place; "counter": an integer buffer counting the batch's examples; "same": the buffer
    rewritten with the value it holds, not a write from the batch)."""

    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.how = how
        self.register_buffer("mean", torch.zeros(5))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.frozen = nn.Parameter(torch.ones(5), requires_grad=False)

    def forward(self, x):
        new = 0.1 * x.detach().mean(0)
        with torch.no_grad():
            if self.how == "buffer":
                self.mean.mul_(0.9).add_(new)
            elif self.how == "data":
                self.mean.data.mul_(0.9).add_(new)
            elif self.how == "numpy":
                self.mean.numpy()[:] = new.numpy()
            elif self.how == "storage":
                self.mean.untyped_storage().copy_(new.untyped_storage())
            elif self.how == "rebind":
                self.mean.data = new.clone()
            elif self.how == "frozen":
                self.frozen.copy_(x.abs().mean(0) + 1)
            elif self.how == "counter":
                self.count += x.shape[0]
            elif self.how == "same":
                self.mean.copy_(torch.zeros(5))
        return self.lin(x - self.mean.detach().clone().zero_())  # (what is written is not read back: no mixing)


_WRITTEN = {"frozen": "frozen", "counter": "count"}


@pytest.mark.parametrize("how", ["buffer", "data", "numpy", "storage", "rebind", "frozen", "counter", "same"])
@pytest.mark.parametrize("method", ["bk", "auto", "vmap"])
def test_forward_writing_to_the_model_from_the_batch_is_refused(how, method):
    """A forward that writes a value computed from the batch into a buffer or a frozen parameter
    stores it in the model without noise: the step raises, naming the tensor, and puts a buffer's
    values back (under vmap torch refuses the in-place ones itself, the same-value one too). A
    rewrite of the same values is no write. ``plan`` and ``fallback_reasons``, which run the forward too, raise alike."""
    m = _RunningMean(how)
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0, method=method)
    name = _WRITTEN.get(how, "mean")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    if method == "vmap":
        if how in ("data", "numpy", "storage", "rebind"):
            # (under vmap these store functorch-wrapped tensors, or bytes of one, in the buffer:
            # torch's undefined behaviour, a crash at the next read; torch does not refuse them)
            pytest.skip("a write through .data / numpy / the storage under vmap is torch's undefined behaviour")
        with pytest.raises(RuntimeError, match="inplace|in-place|mutate"):  # (torch refuses it itself)
            step(pdpsgd.trainable_params(m), batch())
        return
    if how == "same":
        step(pdpsgd.trainable_params(m), batch())
        return
    with pytest.raises(ValueError, match=rf"wrote to \['{name}'\].*without noise"):
        step(pdpsgd.trainable_params(m), batch())
    if how != "frozen":  # a buffer: put back
        assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items()), m.state_dict()
    if method != "vmap":
        for call in (step.plan, step.fallback_reasons):
            with pytest.raises(ValueError, match=rf"wrote to \['{name}'\]"):
                call(batch())
    m.how = "none"  # (no write: a plain step)
    step(pdpsgd.trainable_params(m), batch())


def test_plan_refuses_what_the_step_refuses():
    """``plan`` / ``fallback_reasons`` run the forward on the batch: a BatchNorm in training mode is
    refused there as in the step."""
    m = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)).eval()
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0, method="bk")
    m.train()
    for call in (step.plan, step.fallback_reasons):
        with pytest.raises(ValueError, match="mixes examples"):
            call(batch())


@pytest.mark.parametrize("style", ["hook", "parametrization"])
@pytest.mark.parametrize("method", ["bk", "vmap"])
def test_spectral_norm_power_iteration_is_not_a_write_from_the_batch(style, method):
    """Spectral normalisation updates its u / v vectors in place in training mode, from the weight
    alone (no batch data): not refused by the write check."""
    from torch.nn.utils import spectral_norm
    from torch.nn.utils.parametrizations import spectral_norm as spectral_norm_p

    lin = (spectral_norm if style == "hook" else spectral_norm_p)(nn.Linear(5, 3))
    m = nn.Sequential(lin).train()
    u = lin.weight_u if style == "hook" else lin.parametrizations.weight[0]._u
    with torch.no_grad():  # (away from the converged vector, so that one more iteration moves it)
        u.copy_(F.normalize(torch.randn(u.shape, generator=torch.Generator().manual_seed(0)), dim=0))
    u0 = u.clone()
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0, method=method)
    out = step(pdpsgd.trainable_params(m), batch())
    assert all(torch.isfinite(g).all() for g in out.grads.values())
    assert not torch.equal(u, u0)  # (it did run its power iteration)


@pytest.mark.parametrize("style", ["hook", "parametrization"])
@pytest.mark.parametrize("method", ["bk", "vmap"])
def test_spectral_norm_advances_once_per_step_whatever_the_batch_size(style, method):
    """Review, round 34: torch advances u / v in every training-mode forward, and a step runs as
    many forwards as the private batch size gives (one per vmap chunk): kept in the model, they
    moved the next step's clipped sum by 1e-5 C between neighbouring batch sizes (and
    check_sensitivity failed on this stock layer). Now they are held during the step's forwards and
    advanced once per step (finalize), from the public weights, as one ordinary forward does."""
    import copy

    from torch.nn.utils import spectral_norm
    from torch.nn.utils.parametrizations import spectral_norm as spectral_norm_p

    from pdpsgd.testing import check_sensitivity

    def u_of(m):
        return m[0].weight_u if style == "hook" else m[0].parametrizations.weight[0]._u

    def v_of(m):
        return m[0].weight_v if style == "hook" else m[0].parametrizations.weight[0]._v

    torch.manual_seed(0)
    base = nn.Sequential((spectral_norm if style == "hook" else spectral_norm_p)(nn.Linear(5, 3))).train()
    with torch.no_grad():  # (both away from convergence: each iteration then moves them)
        u_of(base).copy_(F.normalize(torch.randn(u_of(base).shape), dim=0))
        v_of(base).copy_(F.normalize(torch.randn(v_of(base).shape), dim=0))
    x, y = torch.randn(5, 5), torch.randint(0, 3, (5,))
    probe = {"x": torch.randn(3, 5), "y": torch.randint(0, 3, (3,))}
    after = {}
    for B in (4, 5):  # neighbouring Poisson draws: 2 or 3 chunks of 2
        m = copy.deepcopy(base)
        step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=0.0, chunk_size=2,
                                   expected_batch_size=4, method=method)
        params = pdpsgd.trainable_params(m)
        step(params, {"x": x[:B], "y": y[:B]})
        after[B] = (u_of(m).clone(), step.clipped_sum(params, probe).sums)
    assert torch.equal(after[4][0], after[5][0])
    assert all(torch.equal(after[4][1][n], after[5][1][n]) for n in after[4][1])
    once = copy.deepcopy(base)
    with torch.no_grad():
        once(x[:1])  # one ordinary training forward: one power iteration
    torch.testing.assert_close(after[4][0], u_of(once), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(u_of(base), u_of(once))  # (it does move)
    m = copy.deepcopy(base)
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=0.2, noise_multiplier=0.0, method=method)
    assert check_sensitivity(step, pdpsgd.trainable_params(m), {"x": x * 3, "y": y}).max_ratio <= 1 + 1e-5


def test_spectral_norm_advances_from_the_weights_the_step_ran_with():
    """Review of round 34's fix: the once-per-step iteration ran on the model's own weight, not on
    the parameters the step was given (a functional loop); it also skipped a spectral norm stacked
    on a parametrization with several originals, and advanced the first of two stacked ones twice."""
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import spectral_norm as spectral_norm_p

    def loss(mm, b):
        return F.cross_entropy(mm(b["x"]), b["y"], reduction="none")

    b = {"x": torch.randn(4, 6), "y": torch.randint(0, 4, (4,))}
    torch.manual_seed(0)
    m = nn.Sequential(spectral_norm_p(nn.Linear(6, 4))).train()
    sn = m[0].parametrizations.weight[0]
    step = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, method="vmap")
    params = {n: p.detach().clone() for n, p in pdpsgd.trainable_params(m).items()}
    w = next(n for n in params if n.endswith("original"))
    params[w] = torch.randn_like(params[w]) * 3  # the weights this functional loop trains
    for _ in range(30):
        step(params, b)
    top = torch.linalg.svd(params[w])[0][:, 0]
    assert abs(float(sn._u @ top)) > 0.999

    class LowRank(nn.Module):
        def forward(self, A, B):
            return A @ B

        def right_inverse(self, W):
            return W[:, :2].clone(), torch.eye(2, W.shape[1])

    lin = nn.Linear(6, 4)
    parametrize.register_parametrization(lin, "weight", LowRank())
    spectral_norm_p(lin)
    m2 = nn.Sequential(lin).train()
    sn2 = lin.parametrizations.weight[1]
    with torch.no_grad():
        sn2._u.copy_(F.normalize(torch.randn(4), dim=0))
    u0 = sn2._u.clone()
    step2 = pdpsgd.make_dp_step(m2, loss, max_grad_norm=1.0, noise_multiplier=0.0, method="vmap")
    step2(pdpsgd.trainable_params(m2), b)
    assert not torch.equal(sn2._u, u0)  # (it advanced: the originals through the low-rank product)

    from pdpsgd.functional import advance_spectral_norms

    two = spectral_norm_p(spectral_norm_p(nn.Linear(6, 4)))
    first = two.parametrizations.weight[0]
    with torch.no_grad():
        first._v.copy_(F.normalize(torch.randn(6), dim=0))
    W, v = two.parametrizations.weight.original.detach(), first._v.clone()
    u1 = F.normalize(W @ v, dim=0)  # one power iteration from v
    advance_spectral_norms(two)
    torch.testing.assert_close(first._u, u1, rtol=0, atol=1e-6)


def test_overlapping_steps_on_one_model_restore_the_spectral_iteration_count():
    """Review of round 34: two threads stepping one model each saved the other's held 0 and put it
    back last: the spectral norm never advanced again. Holds are counted per module now."""
    import threading

    from torch.nn.utils.parametrizations import spectral_norm as spectral_norm_p

    torch.manual_seed(0)
    m = nn.Sequential(spectral_norm_p(nn.Linear(5, 5)), nn.Tanh(), nn.Linear(5, 3)).train()
    sn = m[0].parametrizations.weight[0]

    def work(seed):
        step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0, method="vmap")
        g = torch.Generator().manual_seed(seed)
        for _ in range(40):
            step(pdpsgd.trainable_params(m), {"x": torch.randn(4, 5, generator=g),
                                              "y": torch.randint(0, 3, (4,), generator=g)})

    import transformers.masking_utils as mu

    before = mu.is_tracing
    ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sn.n_power_iterations == 1
    # (the vmap shim for transformers' masks, also held by both, is put back: it leaked before)
    assert mu.is_tracing is before and not mu.is_tracing(torch.ones(1))


class _FrozenShadow(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 3)
        self.register_buffer("shadow", self.lin.weight)
        self.lin.weight.requires_grad_(False)

    def forward(self, x):
        return self.head(self.lin(x) + 0.5 * (x @ self.shadow.t()))


@pytest.mark.parametrize("method", ["vmap", "bk"])
def test_a_buffer_that_is_a_frozen_weight_runs(method):
    """Review of round 34's fix: a buffer that is a *frozen* parameter's tensor still went into the
    constants beside it (torch's tied-keys error)."""
    from pdpsgd.testing import assert_exact

    m = _FrozenShadow().double()
    b = {"x": torch.randn(5, 4, dtype=torch.float64), "y": torch.randint(0, 3, (5,))}
    assert_exact(m, mlp_loss, b, method=method, max_grad_norm=0.5)


class _Exotic(nn.Module):
    """Buffers the write check cannot copy byte by byte, unused by the forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.register_buffer("sparse", torch.eye(4).to_sparse())
        self.register_buffer("expanded", torch.zeros(1).expand(10))
        self.register_buffer("conj", torch.randn(3, dtype=torch.complex64).conj())
        self.register_buffer("quant", torch.quantize_per_tensor(torch.rand(4), 0.1, 0, torch.quint8))
        self.register_buffer("meta", torch.empty(3, device="meta"))

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("method", ["bk", "vmap"])
def test_write_check_takes_buffers_it_cannot_copy(method):
    """Sparse, expanded, conjugate-view, quantized and meta buffers: the step runs (they are
    watched by version counter and place, not copied)."""
    m = _Exotic()
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0, method=method)
    out = step(pdpsgd.trainable_params(m), batch())
    assert all(torch.isfinite(g).all() for g in out.grads.values())


class _Registers(nn.Module):
    def __init__(self, what):
        super().__init__()
        self.lin, self.what = nn.Linear(5, 3), what

    def forward(self, x):
        if self.what == "buffer":
            self.register_buffer("leak", x.detach().mean(0).clone())
        return self.lin(x)


def test_buffers_registered_in_the_forward_are_refused_and_removed():
    """A forward that registers a buffer with batch values: the step raises and the new buffer is
    removed (it was not in the copies taken before it). (A submodule made in the forward is left:
    lazily built layers are the usual case; ``tests/test_bookkeeping.py``'s lazy target network.)"""
    m = _Registers("buffer")
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0, method="bk")
    with pytest.raises(ValueError, match=r"buffers \['leak'\], registered during the step, were removed"):
        step(pdpsgd.trainable_params(m), batch())
    assert "leak" not in m._buffers


def test_buffers_put_back_when_the_step_fails():
    """A forward that writes into a buffer, in a step that then fails on its own (a scalar loss):
    the buffer is put back before the error propagates."""
    m = _RunningMean("buffer")
    step = pdpsgd.make_dp_step(m, lambda mod, b: F.cross_entropy(mod(b["x"]), b["y"]), max_grad_norm=1.0,
                               noise_multiplier=1.0, method="bk")
    with pytest.raises(ValueError, match="reduction='none'"):
        step(pdpsgd.trainable_params(m), batch())
    assert torch.equal(m.mean, torch.zeros(5))


def test_a_clipping_bound_where_float32_norms_underflow_is_refused():
    # review, round 32: C = 1e-30 with gradient entries of 1e-25 gave a norm of 0 (squares underflow)
    # and a contribution of 1e5·C
    lin = nn.Linear(3, 2)

    def loss(m, b):
        return m(b["x"]).sum(1)

    with pytest.raises(ValueError, match="max_grad_norm=1e-30 is below 1e-10.*underflow.*scale the loss up"):
        pdpsgd.make_dp_step(lin, loss, max_grad_norm=1e-30, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="threshold .* below 1e-10.*clipping groups"):
        step = pdpsgd.make_dp_step(lin, loss, max_grad_norm=1e-9, noise_multiplier=1.0, clipping="per_layer",
                                   clip_budget=[1e-4, 1.0])
        step(pdpsgd.trainable_params(lin), {"x": torch.randn(2, 3)})
    with pytest.raises(ValueError, match="gamma must be finite and ≥ 1e-10"):
        step = pdpsgd.make_dp_step(lin, loss, max_grad_norm=1.0, noise_multiplier=1.0, clip_fn="automatic",
                                   gamma=1e-20)
        step(pdpsgd.trainable_params(lin), {"x": torch.randn(2, 3)})
    pdpsgd.make_dp_step(lin, loss, max_grad_norm=1e-10, noise_multiplier=1.0)  # the floor itself is fine


def test_infinite_clip_budgets_or_gamma_are_refused_and_huge_ones_work():
    """Review, round 34: clip_budget=[inf, inf] made every threshold NaN and every gradient NaN, with
    no error; [1e308, 1e308] overflowed their sum (a misleading 'threshold 0' error); automatic
    clipping with gamma=inf weighted every example 0."""
    lin = nn.Linear(3, 2)

    def loss(m, b):
        return m(b["x"]).sum(1)

    b = {"x": torch.randn(4, 3)}
    for budget in ([math.inf, math.inf], [1.0, math.nan]):
        with pytest.raises(ValueError, match="positive finite weights"):
            step = pdpsgd.make_dp_step(lin, loss, max_grad_norm=1.0, noise_multiplier=1.0, clipping="per_layer",
                                       clip_budget=budget)
            step(pdpsgd.trainable_params(lin), b)
    with pytest.raises(ValueError, match="gamma must be finite"):
        step = pdpsgd.make_dp_step(lin, loss, max_grad_norm=1.0, noise_multiplier=1.0, clip_fn="automatic",
                                   gamma=math.inf)
        step(pdpsgd.trainable_params(lin), b)
    step = pdpsgd.make_dp_step(lin, loss, max_grad_norm=1.0, noise_multiplier=1.0, clipping="per_layer",
                               clip_budget=[1e308, 1e308])
    assert step(pdpsgd.trainable_params(lin), b).grads["weight"].isfinite().all()
    assert step.sensitivity == pytest.approx(1.0)


@pytest.mark.parametrize("method", ["vmap", "bk"])
@pytest.mark.parametrize("clip_fn", ["abadi", "automatic"])
def test_complex_parameters_are_refused(method, clip_fn):
    # review, round 33: automatic clipping accepted a complex parameter; its per-example norm came out
    # complex, the clipped sum's real norm was 1.73 C, and complex noise has σC/√2 per real part
    class Phase(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, dtype=torch.complex64))

        def forward(self, x):
            return (x.to(torch.complex64) * self.w).abs().sum(1)

    m = Phase()
    step = pdpsgd.make_dp_step(m, lambda mm, b: mm(b["x"]), max_grad_norm=1.0, noise_multiplier=1.0,
                               method=method, clip_fn=clip_fn)
    with pytest.raises(TypeError, match="parameter 'w' is complex.*view_as_real.*requires_grad=False"):
        step(pdpsgd.trainable_params(m), {"x": torch.randn(4, 3)})


def test_mask_and_option_types_are_checked():
    """A mask must be bool (review, round 37: a float mask [0.5, 2.0, 0.0] was cast to [T, T, F], an
    index mask [0, 2, 1] to [F, T, T]); a numpy integer chunk_size is an int; a clip_budget that is not
    a sequence of numbers is a clear error."""
    import numpy as np

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 3))
    loss = lambda mod, b: F.cross_entropy(mod(b["x"]), b["y"], reduction="none")
    b = {"x": torch.randn(3, 5), "y": torch.randint(0, 3, (3,))}
    params = pdpsgd.trainable_params(m)
    step = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0)
    for bad in (torch.tensor([0.5, 2.0, 0.0]), torch.tensor([0, 2, 1])):
        with pytest.raises(ValueError, match="mask must be a bool tensor"):
            step(params, b, bad)
    out = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, chunk_size=np.int64(2))(params, b)
    assert int(out.num_examples) == 3
    with pytest.raises(ValueError, match="clip_budget"):
        pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, clipping="per_layer",
                            clip_budget={"a": 1.0, "b": 1.0})(params, b)


def test_a_buffer_written_in_place_under_vmap_is_explained():
    """A forward that updates a buffer in place (running statistics of its own) cannot run per
    example under vmap: the error names the cause and the fixes, not only torch's "mutate a captured
    Tensor" (review, round 37)."""

    class RunStat(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.register_buffer("run", torch.zeros(3))

        def forward(self, x):
            with torch.no_grad():
                self.run.mul_(0.9).add_(0.1 * x.mean(0))
            return self.lin(x - self.run)

    m = RunStat()
    loss = lambda mod, b: F.cross_entropy(mod(b["x"]), b["y"], reduction="none")
    b = {"x": torch.randn(4, 3), "y": torch.randint(0, 2, (4,))}
    with pytest.raises(RuntimeError, match="writes a tensor it did not create.*buffer"):
        pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, method="vmap")(
            pdpsgd.trainable_params(m), b)


def test_a_users_error_under_vmap_is_reported_as_it_reads_eagerly():
    """Review of round 40: a label out of range read 'index 5 is out of bounds for dimension 2 with
    size 3' for 2-D logits (vmap's internals); float labels read as gather's dtype error. The error is
    the one loss_fn raises on the batch run eagerly. A wrong loss_fn signature, a NumPy batch and a
    0-dim leaf name the fix."""
    import numpy as np

    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    lf = lambda mod, b: F.cross_entropy(mod(b[0]), b[1], reduction="none")
    st = pdpsgd.make_dp_step(m, lf, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8, method="vmap")
    params = pdpsgd.trainable_params(m)
    y = torch.zeros(8, dtype=torch.long)
    y[5] = 5  # (not the first example)
    with pytest.raises(IndexError, match="Target 5 is out of bounds") as got:
        st(params, (torch.randn(8, 4), y))
    assert "index 5 is out of bounds for dimension" in str(got.value.__cause__)  # (vmap's, chained)
    if sys.version_info >= (3, 11):
        assert "run eagerly" in " ".join(got.value.__notes__)
    with pytest.raises(RuntimeError, match="expected target dtype"):
        st(params, (torch.randn(8, 4), torch.zeros(8)))

    class BadLabel(ValueError):  # (the user's own exception, with its own arguments: raised as it is)
        def __init__(self, idx, why):
            super().__init__(f"{idx}: {why}")
            self.idx = idx

    def strict(mod, b):
        if b[1].dtype != torch.long:
            raise BadLabel(3, "float labels")
        return lf(mod, b)

    st2 = pdpsgd.make_dp_step(m, strict, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8,
                              method="vmap")
    with pytest.raises(BadLabel) as got:
        st2(params, (torch.randn(8, 4), torch.ones(8)))
    assert got.value.idx == 3

    def penalised(mod, b):  # (a gradient penalty and a dynamic shape: runs eagerly, not under vmap)
        h = mod(b[0])
        g, = torch.autograd.grad(h.sum(), mod[0].weight, create_graph=True)
        return lf(mod, b) + 0 * g.sum() + 0 * torch.nonzero(h > 0).shape[0]

    st3 = pdpsgd.make_dp_step(m, penalised, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8,
                              method="vmap")
    with pytest.raises(RuntimeError) as got:  # (vmap's own error: the eager run, with grad, succeeds)
        st3(params, (torch.randn(8, 4), y.clamp_max(2)))
    assert "require grad" not in str(got.value) and "run eagerly" not in " ".join(getattr(got.value, "__notes__", []))
    import functools

    def fills(fn):  # (a decorator that fills in an argument: its wrapper is what is called)
        @functools.wraps(fn)
        def w(*a, **k):
            return fn(*a, scale=1.0, **k)
        return w

    @fills
    def scaled(mod, b, scale):
        return scale * lf(mod, b)

    pdpsgd.make_dp_step(m, scaled, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8)
    for bad in (lambda b: b, lambda mod, x, y: x):
        with pytest.raises(TypeError, match=r"loss_fn\(model, batch\).*cannot be called so"):
            pdpsgd.make_dp_step(m, bad, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8)
    with pytest.raises(ValueError, match="NumPy arrays.*torch.from_numpy"):
        st(params, (np.zeros((8, 4), np.float32), np.zeros(8, np.int64)))
    with pytest.raises(ValueError, match="0-dim.*closure"):
        st(params, (torch.randn(8, 4), y.clamp_max(2), torch.tensor(0.5)))
    # (round 43, a user's walkthrough: Opacus's habits gave torch's and Python's bare errors)
    with pytest.raises(TypeError, match="optimizer.*wraps no optimizer.*p.grad = out.grads"):
        pdpsgd.make_dp_step(m, torch.optim.SGD(m.parameters(), lr=0.1), max_grad_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(TypeError, match=r"torch loss module \(CrossEntropyLoss\).*loss_fn\(model, batch\)"):
        pdpsgd.make_dp_step(m, nn.CrossEntropyLoss(reduction="none"), max_grad_norm=1.0, noise_multiplier=1.0)
    from torch.utils.data import DataLoader, TensorDataset

    dl = DataLoader(TensorDataset(torch.randn(8, 4), y.clamp_max(2)), batch_size=4)
    for loader in (dl, iter(dl)):
        with pytest.raises(ValueError, match="is a .*, not tensors: iterate it.*PoissonSampler"):
            st(params, loader)
    with pytest.raises(ValueError, match="holds a DataLoader, not tensors"):
        st(params, {"x": dl})

    class OwnLoss(nn.modules.loss._Loss):  # (a user's own subclass taking (model, batch) is a loss_fn)
        def forward(self, mod, b):
            return F.cross_entropy(mod(b[0]), b[1], reduction="none")

    pdpsgd.make_dp_step(m, OwnLoss(), max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8)


@pytest.mark.parametrize("method", ["vmap", "bk", "auto"])
def test_a_loss_that_couples_examples_is_said_at_run_time(method):
    """Review of round 40: an in-batch contrastive loss trained nothing (every per-example gradient is
    0: each example alone is its own only negative) and a loss divided by a batch statistic was
    trained as each example's own, with no word at run time. Both warn; the contrastive one names
    the all-zero gradients; an ordinary loss warns neither."""
    import warnings

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 5))
    params = pdpsgd.trainable_params(m)

    def contrastive(mod, b):
        za, zb = F.normalize(mod(b["a"]), dim=1), F.normalize(mod(b["b"]), dim=1)
        return F.cross_entropy(za @ zb.T / 0.1, torch.arange(za.shape[0]), reduction="none")

    def batch_normalised(mod, b):
        per = (mod(b["a"]) ** 2).sum(1)
        return per / per.detach().mean()  # (a statistic of the batch, as a token count would be)

    batch = {"a": torch.randn(12, 4), "b": torch.randn(12, 4)}

    def said(loss):
        st = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, method=method)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            st(params, batch)
        return " | ".join(str(x.message) for x in w)

    got = said(contrastive)
    assert "every example's gradient is exactly 0" in got and "couples" in got, got
    assert ("mixing (or reordering)" in got) == (method != "vmap"), got
    got = said(batch_normalised)
    assert "exactly 0" not in got and ("mixing (or reordering)" in got) == (method != "vmap"), got
    assert "exactly 0" not in said(lambda mod, b: (mod(b["a"]) ** 2).sum(1)) and "mixing" not in said(
        lambda mod, b: (mod(b["a"]) ** 2).sum(1))


def test_an_out_of_memory_error_under_vmap_stays_itself():
    """The eager re-run that restates a user's error is never tried for an OOM (book-keeping and the
    chunking read OOMs by type)."""
    m = nn.Linear(4, 3)

    def lf(mod, b):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    st = pdpsgd.make_dp_step(m, lf, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4, method="vmap")
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate") as got:
        st(pdpsgd.trainable_params(m), torch.randn(4, 4))
    assert "run eagerly" not in " ".join(getattr(got.value, "__notes__", []))


class _WritesItsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(5, 3)

    def forward(self, x):
        with torch.no_grad():
            self.lin.bias.add_(x.detach().mean() * 1e-3)  # a batch statistic written into a trained weight
        return self.lin(x)


@pytest.mark.parametrize("method", ["bk", "auto"])
def test_forward_writing_to_a_trained_parameter_is_refused(method):
    """(Mutation review, round 42: the write check's watch of the trained parameters was untested under bk.)"""
    m = _WritesItsWeight()
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=1.0, method=method)
    with pytest.raises(ValueError, match=r"wrote to \['lin.bias'\].*without noise"):
        step(pdpsgd.trainable_params(m), batch())


def test_an_oom_in_the_eager_rerun_leaves_the_vmap_error_as_it_is():
    """(Mutation review, round 42.) vmap's error is re-run eagerly to report the user's own error as it reads; an
    OOM in that re-run is not the user's error and must not replace vmap's."""
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    def loss(mod, b):
        if b[0].shape[0] == 1:  # (one example: under vmap)
            raise RuntimeError("vmap-side failure")
        raise torch.OutOfMemoryError("eager run out of memory")

    st = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8, method="vmap")
    with pytest.raises(RuntimeError, match="vmap-side failure") as got:
        st(pdpsgd.trainable_params(m), (torch.randn(8, 4), torch.zeros(8, dtype=torch.long)))
    assert not isinstance(got.value, torch.OutOfMemoryError)


class _ScalesInPlace(nn.Module):
    """A forward that edits its input in place (``x /= 255``): other values at each forward."""

    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(5, 4), nn.Linear(4, 3)

    def forward(self, x):
        x /= 255
        return self.out(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("method", ["bk", "auto"])
def test_a_forward_that_edits_the_batch_in_place_is_refused_and_the_batch_put_back(method):
    """Round 49: book-keeping runs the forward several times a step (its checks, the exact fallback), so ``x /= 255``
    in the forward divided the caller's batch by 255 at each (255⁶ on a first step) and the step trained on other
    data, while the example-order check blamed mixing. Refused with an error that names the edit and the fix; the
    batch is put back as it was passed."""
    m = _ScalesInPlace()
    b = batch()
    x0 = b["x"].clone()
    step = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=0.0, method=method)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"edited tensor .* in place.*x = x / 255"):
            step.clipped_sum(pdpsgd.trainable_params(m), b)
    assert torch.equal(b["x"], x0)


def test_an_in_place_edit_a_second_forward_repeats_to_the_same_values_is_fine():
    """Round 49: an in-place edit that sets the same values at every forward (labels past the classes set to the last
    one, as padding labels to -100) leaves the batch as one forward would: no error, the sums of the edited batch."""
    m = mlp()

    def loss(model, b):
        b["y"][b["y"] > 1] = 1
        return mlp_loss(model, b)

    b = batch()
    b["y"][:3] = 2
    want = {**b, "y": b["y"].clamp(max=1)}
    got = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, method="bk").clipped_sum(
        pdpsgd.trainable_params(m), b)
    ref = pdpsgd.make_dp_step(m, mlp_loss, max_grad_norm=1.0, noise_multiplier=0.0, method="bk").clipped_sum(
        pdpsgd.trainable_params(m), want)
    assert torch.equal(b["y"], want["y"])
    for n in ref.sums:
        torch.testing.assert_close(got.sums[n], ref.sums[n], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("method", ["vmap", "bk"])
def test_params_of_a_replaced_layer_are_refused(method):
    """(Review, round 51.) ``params`` built before the head was replaced trained the old head's tensors, which
    the model no longer holds: the step's loss was not the model's, the new head never moved, no warning. Such
    an nn.Parameter is refused (naming the fix); params built again, and plain tensors (a functional caller's own
    values), are taken."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    loss = lambda m, b: F.cross_entropy(m(b["x"]), b["y"], reduction="none")  # noqa: E731
    b = {"x": torch.randn(6, 5), "y": torch.randint(0, 2, (6,))}
    params = pdpsgd.trainable_params(model)
    step = pdpsgd.make_dp_step(model, loss, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=6, method=method)
    step(params, b)
    model[2] = nn.Linear(8, 2)
    with pytest.raises(ValueError, match=r"params\['2.weight'\].*trainable_params\(model\)"):
        step(params, b)
    fresh = pdpsgd.trainable_params(model)
    out = step(fresh, b)
    assert set(out.grads) == set(fresh)
    step({n: p.detach().clone() for n, p in fresh.items()}, b)  # (plain tensors: the caller's own values)
