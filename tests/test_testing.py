"""The public oracle itself: independent, correct, and able to catch a wrong engine."""
import pytest
import torch
from hypothesis import given, strategies as st

import pdpsgd.per_sample as per_sample
from pdpsgd.testing import assert_exact, naive_per_sample_grads, token_batches
from models import mlp, mlp_loss


@given(seed=st.integers(0, 1000), B=st.integers(1, 7))
def test_oracle_per_example_grads_sum_to_the_batch_gradient(seed, B):
    torch.manual_seed(seed)
    m = mlp().double()
    b = {"x": torch.randn(B, 5, dtype=torch.float64), "y": torch.randint(0, 3, (B,))}
    losses, grads = naive_per_sample_grads(m, mlp_loss, b)
    m.zero_grad()
    full = mlp_loss(m, b)
    full.sum().backward()
    torch.testing.assert_close(losses, full.detach())
    for n, p in m.named_parameters():
        torch.testing.assert_close(grads[n].sum(0), p.grad, rtol=1e-12, atol=1e-14)


def test_assert_exact_catches_a_wrong_engine(monkeypatch):
    torch.manual_seed(0)
    m = mlp()
    b = {"x": torch.randn(5, 5) * 4, "y": torch.randint(0, 3, (5,))}
    assert_exact(m, mlp_loss, b, max_grad_norm=0.1)
    real = per_sample.sq_norm_per_example
    monkeypatch.setattr(per_sample, "sq_norm_per_example", lambda g: real(g) * (1 + 1e-6))
    with pytest.raises(AssertionError, match="differs from the naive per-example loop"):
        assert_exact(m, mlp_loss, b, max_grad_norm=0.1)


@given(batch=token_batches(vocab_size=17, max_batch=5, max_len=7, num_labels=4))
def test_token_batches_strategy_draws_valid_batches(batch):
    ids, am, y = batch["input_ids"], batch["attention_mask"], batch["labels"]
    assert ids.shape == am.shape and ids.shape[0] == y.shape[0]
    assert 1 <= ids.shape[0] <= 5 and 1 <= ids.shape[1] <= 7
    assert int(ids.max()) < 17 and int(y.max()) < 4
    assert bool((am.sum(1) >= 1).all())


def test_token_batches_draws_more_than_one_shape():
    from hypothesis import settings

    shapes = set()

    @given(token_batches(vocab_size=5, max_batch=4, max_len=4))
    @settings(max_examples=30, derandomize=True, database=None)
    def collect(b):
        shapes.add(tuple(b["input_ids"].shape))

    collect()
    assert len(shapes) > 3
