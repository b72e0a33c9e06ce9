"""The watch on a forward's batch order (``pdpsgd.batch_order``) and what book-keeping does with it.

Found by review (round 23): a model that sorts its batch by length and restores it passed the
example-order check on a batch whose lengths were all equal (the sort is then the identity), the
pass was memoised per batch shape, and later batches (or later chunks of the same batch) were
attributed to the wrong examples: the clipped sum was not the naive loop's, and removing one example
moved it by more than C."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import pdpsgd
from pdpsgd.batch_order import DrawWatch, DropoutOff, ReorderWatch
from pdpsgd.testing import assert_exact, check_sensitivity

V = 30


def _order(lengths, how):
    """(order, restore): the batch's order by length, longest first, by an ordering op."""
    if how == "argsort":
        order = torch.argsort(lengths, descending=True, stable=True)
    elif how == "sort":
        order = lengths.sort(descending=True, stable=True).indices
    else:  # topk over the whole batch
        order = torch.topk(lengths.double() - 1e-3 * torch.arange(len(lengths)), len(lengths)).indices
    return order, torch.argsort(order)


class _SortedEncoder(nn.Module):
    """Sorts the batch by length (as for ``pack_padded_sequence(enforce_sorted=True)``), runs its
    layers on the sorted rows, restores the order (several ways)."""

    def __init__(self, how, restore, d=6):
        super().__init__()
        self.how, self.restore = how, restore
        self.emb, self.proj, self.head = nn.Embedding(V, d, padding_idx=0), nn.Linear(d, d), nn.Linear(d, 3)

    def forward(self, ids, lengths):  # (B, T), (B,)
        order, inv = _order(lengths, self.how)
        ids_s = ids.index_select(0, order) if self.restore == "index_copy" else ids[order]
        len_s = lengths[order]
        h = torch.tanh(self.proj(self.emb(ids_s)))  # (B, T, d), rows in sorted order
        keep = (torch.arange(ids.shape[1])[None, :] < len_s[:, None]).to(h.dtype)
        pooled = (h * keep[..., None]).sum(1) / len_s[:, None].to(h.dtype)  # (B, d)
        if self.restore == "getitem":
            back = pooled[inv]
        elif self.restore == "setitem":
            back = torch.zeros_like(pooled)
            back[order] = pooled
        else:
            back = torch.zeros_like(pooled).index_copy(0, order, pooled)
        return self.head(back)


def _loss(m, b):
    return F.cross_entropy(m(b["ids"], b["len"]), b["y"], reduction="none")


def _batch(lengths, T, gen):
    lengths = torch.tensor(lengths)
    ids = torch.randint(1, V, (len(lengths), T), generator=gen)
    ids[torch.arange(T)[None, :] >= lengths[:, None]] = 0
    return {"ids": ids, "len": lengths, "y": torch.randint(0, 3, (len(lengths),), generator=gen)}


@settings(max_examples=8, deadline=None, derandomize=True)
@given(B=st.integers(2, 7), T=st.integers(2, 6), how=st.sampled_from(["argsort", "sort", "topk"]),
       restore=st.sampled_from(["getitem", "setitem", "index_copy"]), chunk=st.sampled_from([None, 1, 2, 3]),
       data=st.data(), seed=st.integers(0, 10**6))
def test_a_sort_that_is_the_identity_in_the_checked_batch_is_not_trusted(B, T, how, restore, chunk, data, seed):
    """The first batch of the shape has every length equal (each text truncated to T): the sort
    leaves it as it is, and the check's runs see nothing. The layers after the sort take the exact
    fallback all the same, and a later batch with other lengths is exact."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    m = _SortedEncoder(how, restore).double()
    lengths = data.draw(st.lists(st.integers(1, T), min_size=B, max_size=B))
    first, later = _batch([T] * B, T, gen), _batch(lengths, T, gen)
    for method in ("bk", "auto"):
        step = pdpsgd.make_dp_step(m, _loss, max_grad_norm=0.5, noise_multiplier=0.0, method=method,
                                   chunk_size=chunk)
        params = pdpsgd.trainable_params(m)
        out = step.clipped_sum(params, first)
        if chunk != 1:  # (a chunk of one example has nothing to reorder, and is not checked: "mixed")
            allowed = {"vmap"} if chunk is None else {"vmap", "mixed"}
            assert {out.routes[n] for n in ("emb.weight", "proj.weight", "proj.bias")} <= allowed, out.routes
            assert "reorders the batch's rows" in step.fallback_reasons(first)["proj.weight"]
        assert check_sensitivity(step, params, later).max_ratio <= 1 + 1e-9
    for b in (first, later):
        assert_exact(m, _loss, b, method="bk", max_grad_norm=0.5, chunk_size=chunk)


class _TrainOnlySort(nn.Module):
    """Sorts by length only in training (a bucketing trick), and adds a position embedding computed
    before the sort to the sorted rows."""

    def __init__(self, d=6, T=8):
        super().__init__()
        self.emb, self.pos, self.head = nn.Embedding(V, d, padding_idx=0), nn.Embedding(T, d), nn.Linear(d, 3)

    def forward(self, ids, lengths):
        pos = self.pos(torch.arange(ids.shape[1])[None])  # (1, T, d): broadcast over the batch
        if not self.training:
            return self.head(torch.tanh(self.emb(ids) + pos).mean(1))
        order = torch.argsort(lengths, descending=True, stable=True)
        h = torch.tanh(self.emb(ids[order]) + pos)
        return self.head(h.mean(1)[torch.argsort(order)])


@pytest.mark.parametrize("train", [True, False])
def test_a_sort_in_training_only_and_a_broadcast_read_after_it_are_seen(train):
    """The watch runs in the step's own mode (the order check's runs are in eval mode), and sends
    every layer to the fallback: also the position embedding, computed before the sort and read
    after it (found by review, round 23)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    m = _TrainOnlySort().double().train(train)
    first, later = _batch([8] * 5, 8, gen), _batch([3, 8, 2, 7, 5], 8, gen)
    step = pdpsgd.make_dp_step(m, _loss, max_grad_norm=0.5, noise_multiplier=0.0, method="bk")
    params = pdpsgd.trainable_params(m)
    routes = step.clipped_sum(params, first).routes
    if train:
        assert set(routes.values()) == {"vmap"}, routes
    else:  # (no sort in eval mode: on the rules)
        assert "vmap" not in routes.values(), routes
    assert check_sensitivity(step, params, later).max_ratio <= 1 + 1e-9


def _watch(fn, B):
    w = ReorderWatch(B)
    with w:
        fn()
    return w.found


def test_the_watch_sees_an_order_by_value_not_by_its_values():
    x, lengths = torch.randn(4, 3), torch.tensor([3, 3, 3, 3])
    assert _watch(lambda: x[torch.argsort(lengths)], 4) is not None  # the identity here, but computed
    assert _watch(lambda: x.index_select(0, lengths.sort().indices.flip(0)), 4) is not None  # derived
    assert _watch(lambda: torch.gather(x, 0, torch.argsort(lengths)[:, None].expand(4, 3)), 4) is not None
    assert _watch(lambda: x[torch.nonzero(lengths > 0).squeeze(1)], 4) is not None


def test_the_watch_sees_an_order_on_any_dimension_and_through_conversions():
    """(Found by review, round 23.) A sequence-first (T, B, d) tensor reordered on dim 1; an order
    built with ``where``; an order that became a list, a NumPy array, a float tensor, or was written
    into a buffer; the order ``pack_padded_sequence`` computes, used by the model."""
    import numpy as np
    x, lengths = torch.randn(4, 3), torch.tensor([3, 3, 3, 3])
    seq_first = torch.randn(5, 4, 3)  # (T, B, d)
    o = lambda: torch.argsort(lengths)  # noqa: E731
    assert _watch(lambda: seq_first[:, o()], 4) is not None
    assert _watch(lambda: seq_first.index_select(1, o()), 4) is not None
    assert _watch(lambda: x[None, o()], 4) is not None
    assert _watch(lambda: seq_first.permute(2, 0, 1)[..., o()], 4) is not None  # (d, T, B)
    assert _watch(lambda: x.index_select(np.int64(0), o()), 4) is not None
    long = lengths > 2
    assert _watch(lambda: x[torch.cat([torch.where(long)[0], torch.where(~long)[0]])], 4) is not None
    assert _watch(lambda: x[o().tolist()], 4) is not None
    assert _watch(lambda: x[o().numpy()], 4) is not None
    assert _watch(lambda: x[o().numpy().astype(np.uint8)], 4) is not None  # (unsigned too; mutation review, round 40)
    assert _watch(lambda: x[o().float().long()], 4) is not None

    def buffered():
        buf = torch.empty(4, dtype=torch.long)
        buf[:] = o()
        return x[buf]
    assert _watch(buffered, 4) is not None

    def packed_order():
        p = nn.utils.rnn.pack_padded_sequence(x[:, :, None], torch.tensor([3, 1, 2, 3]), batch_first=True,
                                              enforce_sorted=False)
        return x[p.sorted_indices]
    assert _watch(packed_order, 4) is not None


def test_the_watch_leaves_other_indexing_alone():
    x, lengths = torch.randn(4, 3), torch.tensor([1, 3, 2, 3])
    assert _watch(lambda: x[torch.arange(4), lengths - 1], 4) is None  # a token per row (a classifier's pick)
    assert _watch(lambda: x[lengths > 1], 4) is None  # a mask by comparison
    assert _watch(lambda: x.index_select(1, torch.argsort(x[0])), 4) is None  # not the batch dimension
    assert _watch(lambda: torch.randn(5, 3)[torch.argsort(torch.randn(5))], 4) is None  # not B rows
    # torch's own packing sorts and restores the batch for the RNN (whose rules know it)
    packed = lambda: nn.utils.rnn.pack_padded_sequence(x[:, :, None], lengths, batch_first=True,  # noqa: E731
                                                        enforce_sorted=False)
    assert _watch(packed, 4) is None
    # a token mask's positions, gathered and scattered back to their own rows (not B entries)
    mask = torch.arange(5)[None] < torch.tensor([2, 5, 3, 1])[:, None]  # (4, 5)
    h = torch.randn(4, 5, 3)
    nz = mask.nonzero()
    assert _watch(lambda: torch.zeros(4, 3).index_add(0, nz[:, 0], h[mask.nonzero(as_tuple=True)]), 4) is None
    assert _watch(lambda: torch.zeros(4, dtype=torch.long).scatter_reduce(0, nz[:, 0], nz[:, 1], "amax"), 4) is None


@pytest.mark.parametrize("check_order", [True, False])
def test_an_lstm_on_packed_unsorted_sequences_stays_on_its_rules(check_order):
    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.rnn, self.head = nn.Embedding(V, 5), nn.LSTM(5, 4, batch_first=True), nn.Linear(4, 3)

        def forward(self, ids, lengths):
            p = nn.utils.rnn.pack_padded_sequence(self.emb(ids), lengths, batch_first=True, enforce_sorted=False)
            _, (h, _) = self.rnn(p)
            return self.head(h[-1])

    torch.manual_seed(0)
    b = _batch([4, 2, 3, 1, 4], 4, torch.Generator().manual_seed(0))
    r = assert_exact(Packed().double(), _loss, b, method="bk", max_grad_norm=0.5,
                     bk_options={"check_order": check_order})
    assert "vmap" not in r.routes.values(), r.routes


class _RowByRowSort(nn.Module):
    """Sorts the batch by length and restores it one row at a time, by the order's 0-d entries:
    ``torch.stack([x[i] for i in order])`` (``getitem``; torch reads a 0-d index with ``.item()``,
    which vmap cannot run) or ``torch.cat([x.index_select(0, i) for i in order])``."""

    def __init__(self, how, d=6):
        super().__init__()
        self.how = how
        self.emb, self.proj, self.head = nn.Embedding(V, d, padding_idx=0), nn.Linear(d, d), nn.Linear(d, 3)

    def _rows(self, x, order):
        if self.how == "getitem":
            return torch.stack([x[i] for i in order])
        return torch.cat([x.index_select(0, i) for i in order])

    def forward(self, ids, lengths):  # (B, T), (B,)
        order, inv = _order(lengths, "argsort")
        ids_s, len_s = self._rows(ids, order), self._rows(lengths, order)
        h = torch.tanh(self.proj(self.emb(ids_s)))  # (B, T, d), rows in sorted order
        keep = (torch.arange(ids.shape[1])[None, :] < len_s[:, None]).to(h.dtype)
        pooled = (h * keep[..., None]).sum(1) / len_s[:, None].to(h.dtype)  # (B, d)
        return self.head(self._rows(pooled, inv))


@pytest.mark.parametrize("how", ["getitem", "index_select"])
def test_a_sort_applied_row_by_row_with_0d_indices_is_seen(how):
    """(Found by review.) The order's entries, one 0-d tensor a row, reorder the batch as the order
    itself does: the first batch of the shape (every length equal, the sort the identity) sends
    every layer to the fallback, and a later batch with other lengths stays within C; where vmap
    cannot run the model, the step says so (it moved the clipped sum by more than C, unseen)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    m = _RowByRowSort(how).double()
    first, later = _batch([5] * 6, 5, gen), _batch([1, 5, 2, 4, 3, 1], 5, gen)
    assert _watch(lambda: m(later["ids"], later["len"]), 6) is not None
    step = pdpsgd.make_dp_step(m, _loss, max_grad_norm=0.5, noise_multiplier=0.0, method="bk")
    params = pdpsgd.trainable_params(m)
    if how == "getitem":
        with pytest.raises(RuntimeError, match="reorders the batch's rows"):
            step.clipped_sum(params, first)
        return
    routes = step.clipped_sum(params, first).routes
    assert set(routes.values()) == {"vmap"}, routes
    assert check_sensitivity(step, params, later).max_ratio <= 1 + 1e-9
    assert_exact(m, _loss, later, method="bk", max_grad_norm=0.5)


def test_the_watch_sees_0d_entries_of_an_order_and_leaves_other_scalar_indices_alone():
    x, lengths = torch.randn(4, 3), torch.tensor([3, 3, 3, 3])
    seq_first = torch.randn(5, 4, 3)  # (T, B, d)
    o = lambda: torch.argsort(lengths)  # noqa: E731
    assert _watch(lambda: torch.stack([x[i] for i in o()]), 4) is not None
    assert _watch(lambda: torch.stack([x[o()[k]] for k in range(4)]), 4) is not None
    assert _watch(lambda: torch.stack([seq_first[:, i] for i in o()], 1), 4) is not None  # on dim 1
    assert _watch(lambda: torch.cat([x.index_select(0, i) for i in o()]), 4) is not None
    assert _watch(lambda: x[o()[0]], 4) is not None  # one example picked by the others' lengths

    def rows_placed():
        out = torch.zeros_like(x)
        for k, i in enumerate(o()):
            out[i] = x[k]
        return out
    assert _watch(rows_placed, 4) is not None
    # a Python int or a constant 0-d tensor on the batch dimension; a computed one on another dimension
    assert _watch(lambda: torch.stack([x[k] for k in range(4)]), 4) is None
    assert _watch(lambda: x[torch.tensor(0)] + x[0], 4) is None
    h = torch.randn(4, 5, 3)  # (B, T, d)
    cls = torch.nonzero(torch.arange(5) == 0)[0, 0]  # a computed 0-d position on dim 1 (size T)
    assert _watch(lambda: h[:, cls], 4) is None
    assert _watch(lambda: h.index_select(1, cls), 4) is None
    assert _watch(lambda: torch.randn(5, 3)[torch.argsort(torch.randn(5))[0]], 4) is None  # not B rows
    # T == B (a physical batch padded to its length): a position found along the sequence is not an
    # entry of an order of the batch (review, round 36: any computed scalar on a size-B dim was one)
    sq = torch.randn(4, 4, 3)  # (B, T, d), T = B
    ids = torch.tensor([[5, 2, 7, 7]] * 4)
    pos = (ids[0] == 2).nonzero()[0, 0]
    assert _watch(lambda: sq[:, pos], 4) is None
    assert _watch(lambda: sq[:, (ids[0] == 2).nonzero()[0, 0]], 4) is None
    assert _watch(lambda: sq[:, torch.argmax(ids[0])], 4) is None
    assert _watch(lambda: torch.stack([sq[i] for i in torch.argsort(lengths)]), 4) is not None


def test_the_watch_sees_parts_of_an_order_and_its_entries_through_select_and_narrow():
    """(Review, round 36's note.) Slices of an order of the B rows (``x[order[k:k+1]]``, split,
    chunk) and its entries passed to ``select`` / ``narrow`` apply the order piece by piece; parts of
    another index (a token mask's positions) and parts used on another dimension are not reported."""
    x, lengths = torch.randn(4, 3), torch.tensor([3, 3, 3, 3])
    seq_first = torch.randn(5, 4, 3)  # (T, B, d)
    o = lambda: torch.argsort(lengths)  # noqa: E731
    assert _watch(lambda: torch.cat([x[o()[k:k + 1]] for k in range(4)]), 4) is not None
    assert _watch(lambda: torch.cat([x.index_select(0, p) for p in o().split(2)]), 4) is not None
    assert _watch(lambda: torch.cat([x[p] for p in o().chunk(4)]), 4) is not None
    assert _watch(lambda: torch.cat([seq_first[:, p] for p in o().split(1)], 1), 4) is not None
    assert _watch(lambda: torch.stack([x.select(0, i) for i in o()]), 4) is not None
    assert _watch(lambda: torch.cat([x.narrow(0, i, 1) for i in o()]), 4) is not None
    assert _watch(lambda: torch.stack([torch.select(seq_first, 1, i) for i in o()], 1), 4) is not None
    # not the batch's order: parts of a token mask's positions; an order's part on a dimension of another size
    mask = torch.arange(5)[None] < torch.tensor([2, 5, 3, 1])[:, None]  # (4, 5)
    nz = mask.nonzero()[:, 0]  # 11 entries
    assert _watch(lambda: torch.cat([x[p] for p in nz.split(4)]), 4) is None
    assert _watch(lambda: torch.randn(5, 3)[torch.argsort(torch.randn(5))[:2]], 4) is None
    assert _watch(lambda: torch.stack([x.select(0, k) for k in range(4)]), 4) is None
    assert _watch(lambda: x.narrow(0, 1, 2), 4) is None


def _draw_found(fn, x):
    watch = DrawWatch(x.shape[0], {"x": x})
    with torch.no_grad(), watch:
        fn(x)
    return watch.found


def test_draw_watch_tells_per_example_draws_from_the_others():
    """``DrawWatch`` (round 38): draws one per example on the batch's first dimension are what vmap's
    per-example draws reproduce; a draw for a tensor not from the batch, for a batch tensor in
    another layout, or a factory of another first size is not."""
    x = torch.randn(3, 5, 4)
    pos = torch.randn(5, 4)
    assert _draw_found(lambda x: F.dropout(torch.tanh(x) * 2, 0.3), x) is None
    assert _draw_found(lambda x: F.dropout(x, 0.3, training=False) + F.dropout(pos, 0.0), x) is None
    assert _draw_found(lambda x: x + torch.rand(x.shape[0], 5, 4) + torch.rand_like(x), x) is None
    assert "does not come from the batch" in _draw_found(lambda x: x + F.dropout(pos, 0.3), x)
    assert "does not come from the batch" in _draw_found(lambda x: x + nn.Dropout(0.1)(pos.expand(3, 5, 4)), x)
    assert "first dimension is not the batch's" in _draw_found(lambda x: F.dropout(x.transpose(0, 1), 0.3), x)
    assert "rand(size=(5, 4))" in _draw_found(lambda x: x + torch.rand(5, 4), x)
    assert "randn(size=(5, 4))" in _draw_found(lambda x: x + torch.randn((5, 4)), x)
    assert "bernoulli_" in _draw_found(lambda x: x * torch.empty(5, 4).bernoulli_(0.5), x)
    out = []
    assert _draw_found(lambda x: out.append(pos.clone().copy_(x[0]).bernoulli_(0.5)), x) is not None  # (shape (5, 4))
    y = torch.zeros(3, 5, 4)
    assert _draw_found(lambda x: y.add_(x).bernoulli_(0.5), x) is None  # (written with the batch's rows)


def test_draw_watch_sees_fused_rnn_dropout_in_place_dropout_and_gumbel():
    """Review, round 38: an LSTM's dropout between layers (inside the fused kernel), the in-place
    dropouts, native_dropout's train=None and gumbel_softmax's draw were not seen."""
    x = torch.randn(3, 5, 4)
    pos = torch.randn(5, 4)
    two = nn.LSTM(4, 4, num_layers=2, dropout=0.5, batch_first=True)
    one = nn.LSTM(4, 4, num_layers=1, batch_first=True)
    assert "lstm with dropout 0.5" in _draw_found(lambda x: two(x), x)
    assert _draw_found(lambda x: one(x), x) is None
    assert _draw_found(lambda x: two.eval()(x), x) is None
    assert "gru with dropout" in _draw_found(lambda x: nn.GRU(4, 4, num_layers=3, dropout=0.2)(x.transpose(0, 1)), x)
    assert "dropout_" in _draw_found(lambda x: torch.dropout_(pos.clone(), 0.3, True), x)
    assert "native_dropout" in _draw_found(lambda x: torch.native_dropout(pos, 0.3, None), x)
    assert "gumbel_softmax" in _draw_found(lambda x: x + F.gumbel_softmax(pos), x)
    assert _draw_found(lambda x: F.gumbel_softmax(x), x) is None


def test_dropout_off_runs_every_torch_dropout_at_rate_0_and_leaves_other_draws():
    """``DropoutOff`` (the example-order check's runs of a training-mode forward, round 43): every form of
    torch's dropout, positional or keyword, in place or not, module or function, returns its input, and SDPA
    drops no attention weight; a draw of the model's own (``bernoulli_``, ``torch.rand``) still draws, and the
    same calls outside the mode still drop."""
    x = torch.randn(4, 6, 5)
    q = torch.randn(2, 4, 3)
    sdpa = F.scaled_dot_product_attention(q, q, q)
    calls = [lambda t: F.dropout(t, 0.5), lambda t: F.dropout(t, p=0.5, training=True), lambda t: nn.Dropout(0.3)(t),
             lambda t: nn.Dropout(0.5, inplace=True)(t.clone()), lambda t: F.dropout(t.clone(), 0.5, True, True),
             lambda t: torch.dropout(t, 0.5, True), lambda t: torch.native_dropout(t, 0.5, True)[0],
             lambda t: F.alpha_dropout(t, 0.5, True), lambda t: F.feature_alpha_dropout(t, 0.5, True),
             lambda t: F.dropout1d(t, 0.5, True), lambda t: F.dropout2d(t, 0.5, True), lambda t: nn.Dropout3d(0.5)(t[None]),
             lambda t: torch.feature_dropout(t, 0.5, True), lambda t: torch.dropout_(t.clone(), 0.5, True)]
    for i, f in enumerate(calls):
        with DropoutOff():
            got = f(x)
        assert torch.equal(got.reshape(x.shape), x), i
        assert not torch.equal(f(x).reshape(x.shape), x), i
    for f in (lambda: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5),
              lambda: F.scaled_dot_product_attention(q, q, q, None, 0.5)):
        with DropoutOff():
            assert torch.equal(f(), sdpa)
        assert not torch.equal(f(), sdpa)
    # nn.MultiheadAttention's dropout runs inside F.multi_head_attention_forward, whose inner calls a mode does not
    # see: its dropout_p is set to 0 there (review, round 43: a TransformerEncoderLayer still drew)
    from pdpsgd._compat import mha_fastpath_off

    enc = nn.TransformerEncoderLayer(6, 2, dim_feedforward=8, dropout=0.3, batch_first=True).train()
    h = torch.randn(3, 4, 6)
    with mha_fastpath_off():
        runs = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            with DropoutOff():
                runs.append(enc(h))
        assert torch.equal(*runs)
        torch.manual_seed(0)
        assert not torch.equal(enc(h), runs[0])
    with DropoutOff():
        state = torch.get_rng_state()
        own = torch.empty(100).bernoulli_(0.5)
        assert not torch.equal(state, torch.get_rng_state()) and 0 < int(own.sum()) < 100
        assert not torch.equal(torch.rand(3), torch.rand(3))


# ---- tests/test_batch_order.py ---------------------------------------------------------------------

# (mutation review, round 43) kills B01 ("unique" out of ORDERINGS), B02 ("randperm"), B03 ("multinomial"), B24 ("kthvalue")
def test_every_listed_ordering_op_marks_its_outputs():
    x, lengths = torch.randn(4, 3), torch.tensor([3, 3, 3, 3])
    assert _watch(lambda: x[torch.randperm(4)], 4) is not None  # a model that shuffles its batch
    assert _watch(lambda: x[torch.multinomial(torch.ones(4), 4)], 4) is not None
    assert _watch(lambda: x[torch.unique(lengths, return_inverse=True)[1]], 4) is not None
    assert _watch(lambda: x[torch.kthvalue(torch.randn(4, 4), 1, dim=1).indices], 4) is not None
    # the same selections by an index not computed by an ordering op are not reported
    assert _watch(lambda: x[torch.arange(4)], 4) is None
    assert _watch(lambda: x[lengths - 3], 4) is None


# (mutation review, round 43) kills B05 ("scatter_" out of ROW_OPS), B06 (take_along_dim's (dim, index) positions swapped),
#   B07 ("index_add"), B23 ("index_copy")
def test_the_watch_sees_each_row_op_that_places_or_takes_rows_by_an_order():
    x, lengths = torch.randn(4, 3), torch.tensor([3, 3, 3, 3])
    o = lambda: torch.argsort(lengths)  # noqa: E731
    assert _watch(lambda: torch.zeros_like(x).index_copy(0, o(), x), 4) is not None
    assert _watch(lambda: torch.zeros_like(x).index_add(0, o(), x), 4) is not None
    assert _watch(lambda: torch.zeros_like(x).scatter_(0, o()[:, None].expand(4, 3), x), 4) is not None
    assert _watch(lambda: torch.take_along_dim(x, o()[:, None].expand(4, 3), 0), 4) is not None
    assert _watch(lambda: torch.take_along_dim(x, o()[:, None].expand(4, 3), dim=0), 4) is not None
    # (the same ops by an index not computed by an ordering op)
    idx = torch.arange(4)
    assert _watch(lambda: torch.zeros_like(x).index_copy(0, idx, x), 4) is None
    assert _watch(lambda: torch.take_along_dim(x, idx[:, None].expand(4, 3), dim=0), 4) is None


# (mutation review, round 43) kills B08 (_is_order without "B entries": entries of an order of another length tagged),
#   B09 (_orders without "the dimension has B rows"), B11 (a Python list of any length),
#   B12 (a marked bool mask taken as an order), B15 (gather/scatter index of another extent)
def test_the_watch_leaves_indices_that_are_not_an_order_of_the_b_rows_alone():
    x, lengths = torch.randn(4, 3), torch.tensor([3, 1, 2, 3])
    o = lambda: torch.argsort(lengths)  # noqa: E731
    # an entry of an order of 5 things (a token position) picking a row of a (B, ...) tensor
    t5 = torch.tensor([5.0, 1.0, 4.0, 3.0, 9.0])  # (its argsort's first entry: 1, a row of x)
    assert _watch(lambda: x[torch.argsort(t5)[0]], 4) is None
    assert _watch(lambda: x.select(0, torch.argsort(t5)[0]), 4) is None
    # the batch's order of B entries used on a table of another size (6 rows): no batch rows are moved
    table = torch.randn(6, 3)
    assert _watch(lambda: table[o()], 4) is None
    assert _watch(lambda: table.index_select(0, o()), 4) is None
    # a Python list of fewer than B entries
    assert _watch(lambda: x[[0, 2]], 4) is None
    # a mask by comparison of an order's values: rows kept in their order
    assert _watch(lambda: x[o() >= 2], 4) is None
    # a token mask's positions (11 of them) gathered on the batch dimension: another length
    mask = torch.arange(5)[None] < torch.tensor([2, 5, 3, 1])[:, None]
    assert _watch(lambda: torch.gather(x, 0, mask.nonzero()[:, :1].expand(-1, 3)), 4) is None  # (11, 3)
    # (and the watch still sees the real thing)
    assert _watch(lambda: x[o().tolist()], 4) is not None


# (mutation review, round 43) kills B20 (entries of a part of an order, e.g. ``for p in order.split(2): for i in p``, not tagged)
def test_the_watch_sees_entries_of_the_parts_of_an_order():
    x, lengths = torch.randn(4, 3), torch.tensor([3, 3, 3, 3])
    o = lambda: torch.argsort(lengths)  # noqa: E731
    assert _watch(lambda: torch.stack([x[i] for p in o().split(2) for i in p]), 4) is not None
    assert _watch(lambda: torch.stack([x[p[0]] for p in o().chunk(4)]), 4) is not None


# (mutation review, round 43) kills B14; and a bug it found: a 1-element part of an order given to ``select`` (``x.select(0, p)`` for ``p`` in
# ``order.split(1)``) reordered the batch unseen
def test_the_watch_sees_select_by_a_one_element_part_of_an_order():
    x, lengths = torch.randn(4, 3), torch.tensor([3, 1, 2, 4])
    assert _watch(lambda: torch.stack([x.select(0, p) for p in torch.argsort(lengths).split(1)]), 4) is not None


# (mutation review, round 43) kills D03 (an RNN of one layer with dropout= set taken as drawing), D04 (CPU SDPA dropout reported),
#   D05 (SDPA's own-kernel dropout off the CPU never reported; a meta tensor stands for an accelerator)
def test_draw_watch_fused_rnn_of_one_layer_and_sdpa_by_device():
    x = torch.randn(3, 5, 4)
    with pytest.warns(UserWarning):  # (torch: dropout with one layer draws nothing)
        one = nn.LSTM(4, 4, num_layers=1, dropout=0.5, batch_first=True)
    assert _draw_found(lambda x: one(x), x) is None
    assert _draw_found(lambda x: F.scaled_dot_product_attention(x, x, x, dropout_p=0.3), x) is None  # (CPU: as vmap)
    m = torch.empty(3, 5, 4, device="meta")
    assert "scaled_dot_product_attention with dropout_p=0.3" in _draw_found(
        lambda x: F.scaled_dot_product_attention(x, x, x, dropout_p=0.3), m)
    assert _draw_found(lambda x: F.scaled_dot_product_attention(x, x, x), m) is None


# (mutation review, round 43) kills D06 (torch.rrelu's default taken as training), D12 ("uniform_" out of _DRAWS_LIKE), D13 ("normal_"),
#   D14 ("rand_like"), D17 (every leaf of the batch taken as the batch's, whatever its first size),
#   D18 (randint's size read from its keyword only), D23 (the location names torch's frame, not the model's)
def test_draw_watch_each_listed_draw_and_where_it_points():
    import os
    x = torch.randn(3, 5, 4)
    pos = torch.randn(5, 4)
    assert _draw_found(lambda x: torch.rrelu(pos), x) is None  # (torch.rrelu's training defaults to False)
    assert "rrelu" in _draw_found(lambda x: x + F.rrelu(pos, training=True), x)
    assert "uniform_" in _draw_found(lambda x: x + torch.empty(5, 4).uniform_(), x)
    assert "normal_" in _draw_found(lambda x: x + pos.clone().normal_(), x)
    assert "rand_like" in _draw_found(lambda x: x + torch.rand_like(pos), x)
    assert _draw_found(lambda x: x + torch.randint(0, 10, (3, 5, 4)), x) is None  # (B rows: one per example)
    assert "randint(size=(5, 4))" in _draw_found(lambda x: x + torch.randint(0, 10, (5, 4)), x)
    # a leaf of the batch with another first size (a shared table passed in the batch) is not the batch's
    watch = DrawWatch(3, {"x": x, "table": pos})
    with torch.no_grad(), watch:
        F.dropout(pos, 0.3)
    assert "does not come from the batch" in watch.found
    # the reported place is the model's line (this file), not torch's dropout module
    found = _draw_found(lambda x: x + nn.Dropout(0.1)(pos), x)
    assert os.path.basename(__file__) in found, found


# (mutation review, round 43) kills D07 (normal(size=...) of B rows vs other sizes swapped), D08 (a factory of B rows not marked fragile),
#   D10 (a (T, B, d) read as batch-first at T = B not marked fragile), D16 (fixed_sizes ignored)
def test_draw_watch_marks_verdicts_that_rest_on_a_size_meeting_b_as_fragile():
    def watch_of(fn, x, fixed=()):
        w = DrawWatch(x.shape[0], {"x": x}, fixed)
        with torch.no_grad(), w:
            fn(x)
        return w

    x = torch.randn(3, 5, 4)
    w = watch_of(lambda x: x + torch.normal(0.0, 1.0, size=(3, 5, 4)), x)
    assert w.found is None and w.fragile
    w = watch_of(lambda x: x + torch.normal(0.0, 1.0, size=(5, 4)), x)
    assert "normal(size=(5, 4))" in w.found
    w = watch_of(lambda x: x + torch.rand(3, 5, 4), x)
    assert w.found is None and w.fragile
    w = watch_of(lambda x: F.dropout(x, 0.3), x)
    assert w.found is None and not w.fragile
    sq = torch.randn(3, 3, 4)  # (B, T, d) with T = B: a time-major tensor would read the same
    w = watch_of(lambda x: F.dropout(x, 0.3), sq)
    assert w.found is None and w.fragile
    assert watch_of(lambda x: x, x, fixed={3, 7}).fragile and not watch_of(lambda x: x, x, fixed={5, 4}).fragile


# (mutation review, round 43) kills D22 ("feature_alpha_dropout_" out of _DROPOUTS: DropoutOff leaves it dropping, DrawWatch misses it)
def test_the_in_place_feature_alpha_dropout_is_a_dropout():
    from pdpsgd.batch_order import DropoutOff

    t = torch.randn(4, 6, 5)
    with DropoutOff():
        assert torch.equal(torch.feature_alpha_dropout_(t.clone(), 0.5, True), t)
    assert not torch.equal(torch.feature_alpha_dropout_(t.clone(), 0.5, True), t)
    x, pos = torch.randn(3, 5, 4), torch.randn(2, 5, 4)
    assert "feature_alpha_dropout_" in _draw_found(lambda x: torch.feature_alpha_dropout_(pos.clone(), 0.5, True), x)


# (mutation review, round 43) kills D09 (randperm not reported), D15 (a tensor written with the batch's rows by ``t[...] = x`` not followed:
#   ``__setitem__`` returns None, so only the in-place marking of its target follows it)
def test_draw_watch_randperm_and_a_buffer_filled_by_setitem():
    x = torch.randn(3, 5, 4)
    assert "randperm" in _draw_found(lambda x: x[torch.randperm(3)], x)
    buf = torch.zeros(3, 5, 4)

    def filled(x):
        buf[:] = x
        return buf.bernoulli_(0.5)
    assert _draw_found(filled, x) is None
