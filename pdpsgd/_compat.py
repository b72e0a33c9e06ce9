"""Scoped compatibility shims for running user models under ``torch.func.vmap``.

Nothing here is applied at import time; each shim is a context manager that restores what it
changed on exit, so the user's modules and libraries are never left modified.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator

import torch


_FASTPATH_LOCK = threading.Lock()
_FASTPATH = [True, 0]  # (the flag before the first block, blocks open)


@contextlib.contextmanager
def mha_fastpath_off() -> Iterator[None]:
    """torch's ``nn.MultiheadAttention`` / ``nn.TransformerEncoder`` fast path off for the block.

    In eval mode, with no gradient asked for (a no-grad probe; inside ``vmap(grad(...))``, where
    the parameters do not look as if they require grad), that path turns a padded batch into a
    nested tensor, which neither ``vmap`` nor a shape probe can read ("NestedTensorImpl doesn't
    support sizes"). Off, the layers compute the same function by their ordinary ops, as in
    training."""
    backend = getattr(torch.backends, "mha", None)
    if backend is None or not hasattr(backend, "set_fastpath_enabled"):  # pragma: no cover - old torch
        yield
        return
    # (a process-wide flag: counted under a lock, so that threads entering and leaving in any order
    # put back the value from before the first of them)
    with _FASTPATH_LOCK:
        if _FASTPATH[1] == 0:
            _FASTPATH[0] = backend.get_fastpath_enabled()
            backend.set_fastpath_enabled(False)
        _FASTPATH[1] += 1
    try:
        yield
    finally:
        with _FASTPATH_LOCK:
            _FASTPATH[1] -= 1
            if _FASTPATH[1] == 0:
                backend.set_fastpath_enabled(_FASTPATH[0])


_TRACING_LOCK = threading.Lock()
_TRACING: dict = {"depth": 0, "orig": None, "mod": None}


def _always_tracing(tensor=None) -> bool:  # noqa: ANN001 - mirrors transformers' signature
    return True


@contextlib.contextmanager
def transformers_vmap_compat() -> Iterator[None]:
    """Make Hugging Face ``transformers`` mask code vmap-safe for the duration of the block.

    transformers (5.x) skips building an attention mask when ``padding_mask.all()`` is true:
    a data-dependent Python branch that ``vmap`` cannot run ("vmap: ... data-dependent control
    flow"). It already skips that shortcut while *tracing* (compile/export). Inside this block we
    report "tracing" to those checks, so the mask is always materialised. The mask built is the
    same one, only never skipped, so results are unchanged (tested against the naive loop).
    """
    mod = sys.modules.get("transformers.masking_utils")
    if mod is None or not hasattr(mod, "is_tracing"):
        yield
        return
    # reference-counted under a lock: with two threads stepping at once, each had saved the other's
    # replacement as "the original" and the last to leave put it back for good (round 34)
    with _TRACING_LOCK:
        if _TRACING["depth"] == 0:
            _TRACING["orig"], _TRACING["mod"] = mod.is_tracing, mod
            mod.is_tracing = _always_tracing
        _TRACING["depth"] += 1
    try:
        yield
    finally:
        with _TRACING_LOCK:
            _TRACING["depth"] -= 1
            if _TRACING["depth"] == 0:
                _TRACING["mod"].is_tracing = _TRACING["orig"]
                _TRACING["orig"] = _TRACING["mod"] = None
