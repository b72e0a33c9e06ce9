"""MPNet's relative attention bias, looked up per example while the engine captures.

``MPNetEncoder.compute_position_bias(x)`` looks its bias table (an nn.Embedding of num_buckets × H) up
on (T, T) relative-position buckets, (T, T) -> (T, T, H), and returns it permuted and expanded over
the batch, (B, H, T, T), for every layer's attention scores. As with T5 (``t5_relative_bias``), the
lookup's ids are batch-free, so the embedding's own call cannot be split by example (without this
adapter: the exact vmap fallback, a second vmapped forward + backward of the whole model).

While the engine captures, this adapter replaces the encoder's ``compute_position_bias``: it runs the
model's own method once with the table lookup intercepted, checks that the result is that lookup
permuted and expanded to the batch (values equal, and the map's adjoint on a probe gradient is the
permutation's of the batch's sum), then looks the buckets up again expanded to (B, T, T), through the
embedding itself (whose rule then gives each example's ``Index`` use), and returns (B, H, T, T): the
same values. Anything else (not one (T, T) lookup, other shapes or values, per-example position ids)
and it returns the original method's result: the table then takes the exact fallback, as before.
"""
from __future__ import annotations

import torch
from torch import nn

from .base import CaptureAdapter
from .t5_relative_bias import _Lookup, adjoint_probe, run_with_lookup

__all__ = ["MPNetRelativeBiasAdapter", "is_mpnet_encoder"]


def is_mpnet_encoder(module: nn.Module) -> bool:
    """transformers' ``MPNetEncoder`` (by its module and name: no import of transformers on this per-call path),
    with its bias table an nn.Embedding."""
    kind = type(module)
    return kind.__name__ == "MPNetEncoder" and kind.__module__ == "transformers.models.mpnet.modeling_mpnet" \
        and isinstance(module._modules.get("relative_attention_bias"), nn.Embedding)


class MPNetRelativeBiasAdapter(CaptureAdapter):
    """``compute_position_bias`` with the lookup batched: the same (B, H, T, T) values, see the module docstring."""

    name = "mpnet_relative_bias"
    method = "compute_position_bias"

    def wrap(self, module: nn.Module, batch_size: int):
        original = type(module).compute_position_bias

        def compute_position_bias(*args, **kwargs):
            emb, stub, ref = run_with_lookup(module, original, args, kwargs)  # ref: (B, H, T, T)
            batched = _batched(emb, stub, ref, batch_size)
            return batched if batched is not None else original(module, *args, **kwargs)

        return compute_position_bias


def _batched(emb: nn.Embedding, stub: _Lookup, ref, B: int):
    """The lookup again on the buckets expanded to (B, T, T), through ``emb``, as (B, H, T, T); None if ``ref``
    is not exactly one (Tq, Tk) lookup, permuted to (H, Tq, Tk) and expanded to the batch."""
    if len(stub.seen) != 1 or not isinstance(ref, torch.Tensor):
        return None
    ids, looked = stub.seen[0]  # (Tq, Tk), (Tq, Tk, H)
    if ids.dim() != 2 or ids.is_floating_point() \
            or tuple(ref.shape) != (B, looked.shape[2], ids.shape[0], ids.shape[1]):
        return None
    want = looked.permute(2, 0, 1).unsqueeze(0).expand(ref.shape)  # (Tq, Tk, H) -> (B, H, Tq, Tk)
    if ref.dtype != want.dtype or not torch.equal(ref.detach(), want.detach()):
        return None
    if looked.requires_grad:  # the map's adjoint on a probe gradient: the batch's sum, permuted back
        if not ref.requires_grad:
            return None  # the model cut the bias off the gradient: so must we (fallback)
        probe = adjoint_probe(ref)
        (back,) = torch.autograd.grad(ref, looked, probe, allow_unused=True)
        if back is None or not bool(torch.isfinite(back).all()) \
                or not torch.equal(back, probe.sum(0).permute(1, 2, 0)):
            return None
    out = emb(ids.unsqueeze(0).expand(B, *ids.shape))  # (B, Tq, Tk) -> (B, Tq, Tk, H), captured per example
    return out.permute(0, 3, 1, 2).contiguous()  # (B, H, Tq, Tk)
