"""Scoped compatibility shims for running user models under ``torch.func.vmap``.

Nothing here is applied at import time; each shim is a context manager that restores what it
changed on exit, so the user's modules and libraries are never left modified.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator


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
    original = mod.is_tracing

    def is_tracing(tensor=None) -> bool:  # noqa: ANN001 - mirrors transformers' signature
        return True

    mod.is_tracing = is_tracing
    try:
        yield
    finally:
        mod.is_tracing = original
