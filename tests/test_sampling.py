"""Tests of pdpsgd.sampling: Poisson sampling statistics, physical batches, resume."""
import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdpsgd.sampling import PhysicalBatch, PoissonSampler, collate, to_physical_batches

CHEAP = settings(max_examples=8, deadline=None, derandomize=True)


def draws(sampler):
    """steps x N indicator matrix of a full pass."""
    rows = []
    for idx in sampler:
        row = torch.zeros(sampler.num_examples, dtype=torch.float64)
        row[idx] = 1.0
        rows.append(row)
    return torch.stack(rows)


# ----------------------------------------------------------------------------------
# statistics of the draws
# ----------------------------------------------------------------------------------
@CHEAP
@given(q=st.sampled_from([0.02, 0.1, 0.3, 0.7]), seed=st.integers(0, 2 ** 31))
def test_inclusion_frequency_is_q_per_example(q, seed):
    n, steps = 200, 2000
    x = draws(PoissonSampler(n, q, steps, generator=seed))
    counts = x.sum(0)
    sd = math.sqrt(steps * q * (1 - q))
    # each count ~ Binomial(steps, q): 6 sd per example (all 200 within: p_fail ~ 4e-7)
    assert (counts - steps * q).abs().max() <= 6 * sd
    # the spread across examples matches the binomial variance (not, e.g., balanced epochs)
    ratio = counts.var().item() / sd ** 2
    assert 0.6 < ratio < 1.5


@CHEAP
@given(q=st.sampled_from([0.05, 0.2, 0.5]), seed=st.integers(0, 2 ** 31))
def test_batch_size_is_binomial_not_fixed(q, seed):
    n, steps = 500, 1500
    sizes = torch.tensor([len(i) for i in PoissonSampler(n, q, steps, generator=seed)], dtype=torch.float64)
    var = n * q * (1 - q)
    assert abs(sizes.mean().item() - n * q) <= 6 * math.sqrt(var / steps)
    assert 0.75 < sizes.var().item() / var < 1.3  # a shuffled fixed-size batcher has variance 0


@CHEAP
@given(q=st.sampled_from([0.1, 0.3, 0.5]), seed=st.integers(0, 2 ** 31))
def test_independence_across_examples_and_steps(q, seed):
    n, steps = 60, 3000
    x = draws(PoissonSampler(n, q, steps, generator=seed))
    z = (x - x.mean(0)) / x.std(0)
    corr = (z.T @ z) / (steps - 1)  # example-by-example correlation
    off = corr[~torch.eye(n, dtype=torch.bool)]
    assert off.abs().max() < 6 / math.sqrt(steps)
    lag1 = (z[1:] * z[:-1]).sum(0) / (steps - 1)  # step-to-step, per example
    assert lag1.abs().max() < 6 / math.sqrt(steps)
    assert abs(lag1.mean().item()) < 6 / math.sqrt(steps * n)


def test_q_equal_one_takes_everything():
    for idx in PoissonSampler(17, 1.0, 5, generator=0):
        assert torch.equal(idx, torch.arange(17))


# ----------------------------------------------------------------------------------
# physical batches
# ----------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    indices=st.lists(st.integers(0, 10_000), max_size=300, unique=True).map(sorted),
    max_batch_size=st.integers(1, 64),
)
def test_physical_batches_fixed_shape_exact_masks_no_drops(indices, max_batch_size):
    idx = torch.tensor(indices, dtype=torch.long)
    batches = to_physical_batches(idx, max_batch_size)
    k = len(indices)
    assert len(batches) == max(1, math.ceil(k / max_batch_size))
    for pb in batches:
        assert isinstance(pb, PhysicalBatch)
        assert pb.indices.shape == (max_batch_size,) and pb.indices.dtype == torch.long
        assert pb.mask.shape == (max_batch_size,) and pb.mask.dtype == torch.bool
        assert torch.all(pb.indices[~pb.mask] == 0)  # padding is index 0, masked out
    real = torch.cat([pb.indices[pb.mask] for pb in batches])
    assert real.tolist() == indices  # every index exactly once, in order
    assert sum(int((~pb.mask).sum()) for pb in batches) == len(batches) * max_batch_size - k
    # masks are a prefix: real rows first, padding only at the end of the last batch
    flat_mask = torch.cat([pb.mask for pb in batches])
    assert flat_mask[:k].all() and not flat_mask[k:].any()


def test_splitting_never_drops_sampled_indices():
    sampler = PoissonSampler(1000, 0.3, 20, generator=1)  # ~300 per step, 16 per physical batch
    for indices, batches in zip(PoissonSampler(1000, 0.3, 20, generator=1), sampler.iter_physical(16)):
        assert len(batches) == math.ceil(len(indices) / 16) > 1
        got = torch.cat([b.indices[b.mask] for b in batches])
        assert torch.equal(got, indices)


def test_empty_draw_gives_one_all_padding_batch():
    batches = to_physical_batches(torch.zeros(0, dtype=torch.long), 8)
    assert len(batches) == 1 and not batches[0].mask.any()
    assert batches[0].indices.shape == (8,)


def test_collate():
    data = {"x": torch.arange(20).reshape(10, 2), "y": torch.arange(10) * 10}
    pb = to_physical_batches(torch.tensor([3, 7, 9]), 4)[0]
    batch, mask = collate(data, pb)
    assert batch["x"].shape == (4, 2) and batch["y"].shape == (4,)
    assert batch["y"].tolist() == [30, 70, 90, 0]
    assert torch.equal(batch["x"][:3], data["x"][[3, 7, 9]])
    assert mask.tolist() == [True, True, True, False]
    with pytest.raises(ValueError, match="leading dim"):
        collate({"a": torch.zeros(3), "b": torch.zeros(4)}, pb)
    with pytest.raises(IndexError, match="out of range"):
        collate({"a": torch.zeros(5)}, pb)


# ----------------------------------------------------------------------------------
# reproducibility, resume
# ----------------------------------------------------------------------------------
def test_same_seed_same_draws_and_different_seed_different_draws():
    a = list(PoissonSampler(500, 0.1, 10, generator=123))
    b = list(PoissonSampler(500, 0.1, 10, generator=123))
    from pdpsgd._seeding import keyed_generator, seed_key

    c = list(PoissonSampler(500, 0.1, 10, generator=keyed_generator(seed_key(123, "PoissonSampler"))))
    d = list(PoissonSampler(500, 0.1, 10, generator=123 + (1 << 32)))  # (every bit of the seed counts)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, y) for x, y in zip(a, c))
    assert not all(torch.equal(x, y) for x, y in zip(a, d))
    e = list(PoissonSampler(500, 0.1, 10))  # OS entropy
    f = list(PoissonSampler(500, 0.1, 10))
    assert not all(torch.equal(x, y) for x, y in zip(e, f))


def test_state_dict_exact_resume():
    full = list(PoissonSampler(300, 0.05, 30, generator=7))
    s = PoissonSampler(300, 0.05, 30, generator=7)
    it = iter(s)
    head = [next(it) for _ in range(12)]
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf)
    resumed = PoissonSampler(300, 0.05, 30, generator=999)
    resumed.load_state_dict(state)
    assert resumed.position == 12 and resumed.remaining == 18
    tail = list(resumed)
    assert len(head) + len(tail) == len(full) == len(s) == 30
    assert all(torch.equal(x, y) for x, y in zip(head + tail, full))
    with pytest.raises(RuntimeError, match="exhausted"):
        resumed.sample()
    with pytest.raises(ValueError, match="sample_rate"):
        PoissonSampler(300, 0.1, 30).load_state_dict(state)


def test_from_plan():
    from pdpsgd.accounting import plan_privacy

    plan = plan_privacy(8.0, 1e-5, 2000, 100, 1, accountant="rdp")
    s = PoissonSampler.from_plan(plan, generator=0)
    assert len(s) == plan.steps == 20
    assert s.sample_rate == plan.sample_rate == pytest.approx(0.05)
    assert s.num_examples == 2000 and s.expected_batch_size == pytest.approx(100)


# ----------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("q", [0.0, -0.5, 1.01, float("nan")])
def test_bad_sample_rate(q):
    with pytest.raises(ValueError, match=r"sample_rate must be in \(0, 1\]"):
        PoissonSampler(10, q, 5)


def test_bad_sizes():
    with pytest.raises(ValueError, match="num_examples must be >= 1"):
        PoissonSampler(0, 0.1, 5)
    with pytest.raises(ValueError, match="steps must be >= 0"):
        PoissonSampler(10, 0.1, -1)
    with pytest.raises(TypeError, match="integer"):
        PoissonSampler(10.5, 0.1, 5)
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        to_physical_batches(torch.arange(3), 0)
    with pytest.raises(TypeError, match="integer tensor"):
        to_physical_batches(torch.rand(3), 2)
    with pytest.raises(TypeError, match="generator"):
        PoissonSampler(10, 0.1, 5, generator="seed")
    assert len(list(PoissonSampler(10, 0.1, 0))) == 0


def test_inclusion_probability_never_exceeds_q(monkeypatch):
    # uniforms are multiples of 2^-53 and ``u < q`` took ceil(q·2^53) of the 2^53 values: more than q
    # (at q = 1e-17, 11 q; review, round 32). The grid value just below q is now left out.
    for q in (0.3, 1e-17, 1e-6 + 1e-22):
        below = math.floor(q * 2.0 ** 53) * 2.0 ** -53
        assert below < q
        fake = torch.tensor([below, max(below - 2.0 ** -53, 0.0), 0.0], dtype=torch.float64)
        monkeypatch.setattr(torch, "rand", lambda n, generator=None, dtype=None: fake[:n].clone())
        got = PoissonSampler(3, q, 1, generator=0).sample().tolist()
        assert got == ([1, 2] if below > 0 else []), (q, got)
    monkeypatch.undo()
    u = torch.rand(100_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert bool((u * 2.0 ** 53 == (u * 2.0 ** 53).floor()).all())  # torch's float64 uniforms: on the grid
