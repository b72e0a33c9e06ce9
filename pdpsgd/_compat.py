"""Scoped compatibility shims for running user models under ``torch.func.vmap``.

Nothing here is applied at import time; each shim is a context manager that restores what it
changed on exit, so the user's modules and libraries are never left modified.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Callable, Dict, Iterable, Iterator, Tuple

import torch


_HOLD_LOCK = threading.Lock()
_HOLDS: Dict[Any, list] = {}  # key -> [holders, the value before the first]


@contextlib.contextmanager
def held(settings: Iterable[Tuple[Any, Callable[[], Any], Callable[[Any], None], Any]]) -> Iterator[None]:
    """Process-wide values set for the block: ``settings`` of (key, get, put, value). Counted per key
    under one lock: the first holder saves ``get()`` and puts ``value``, the last one to leave puts the
    saved value back, in whatever order threads enter and leave (each saving and restoring on its own
    had one thread keep another's replacement as "the original", and put it back for good)."""
    settings = list(settings)
    with _HOLD_LOCK:
        for key, get, put, value in settings:
            h = _HOLDS.get(key)
            if h is None:
                _HOLDS[key] = [1, get()]
                put(value)
            else:
                h[0] += 1
    try:
        yield
    finally:
        with _HOLD_LOCK:
            for key, _, put, _ in settings:
                h = _HOLDS[key]
                h[0] -= 1
                if h[0] == 0:
                    del _HOLDS[key]
                    put(h[1])


def value_before_hold(key: Any, get: Callable[[], Any]) -> Any:
    """The value ``key`` had before the holds now open on it (``get()`` when none is)."""
    with _HOLD_LOCK:
        h = _HOLDS.get(key)
        return get() if h is None else h[1]


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
    with held([("mha_fastpath", backend.get_fastpath_enabled, backend.set_fastpath_enabled, False)]):  # (process-wide)
        yield


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
    # (held: with two threads stepping at once, each had saved the other's replacement as "the
    # original", and the last to leave put it back for good; round 34)
    with held([(("is_tracing", mod), lambda: mod.is_tracing, lambda v: setattr(mod, "is_tracing", v),
                _always_tracing)]):
        yield
