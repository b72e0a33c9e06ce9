"""Warnings that point at the user's line: the call into pdpsgd, not a frame inside it (or torch)."""
from __future__ import annotations

import os
import sys
import warnings
from typing import Type

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_ENTRY_POINTS = frozenset(_PACKAGE + name for name in ("cli.py", "__main__.py"))


def warn(message: str, category: Type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the frame that made the outermost call into pdpsgd.

    A warning raised in a forward hook or deep in the engine would otherwise name a line of torch
    or of pdpsgd; this names the user's ``dp_step(...)`` (or accountant, ...) call, so that the
    usual filters by module and the "once per location" rule apply to the user's code. Code run
    wholly inside pdpsgd (``pdpsgd train``, ``python -m pdpsgd``: the outermost pdpsgd frame is
    the command line's) gets the pdpsgd line that warned, not ``<frozen runpy>`` or the console
    script."""
    frame, level, outer, outer_file = sys._getframe(0), 1, 1, ""
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(_PACKAGE):
            outer, outer_file = level, path
        frame, level = frame.f_back, level + 1
    if outer_file in _ENTRY_POINTS:
        outer = 1  # the caller of warn()
    warnings.warn(message, category, stacklevel=outer + 1)
