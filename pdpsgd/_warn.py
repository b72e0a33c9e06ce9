"""Warnings that point at the user's line: the call into pdpsgd, not a frame inside it (or torch)."""
from __future__ import annotations

import os
import sys
import warnings
from typing import Type

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn(message: str, category: Type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the frame that made the outermost call into pdpsgd.

    A warning raised in a forward hook or deep in the engine would otherwise name a line of torch
    or of pdpsgd; this names the user's ``dp_step(...)`` (or accountant, ...) call, so that the
    usual filters by module and the "once per location" rule apply to the user's code. Code run
    wholly inside pdpsgd (``pdpsgd train``) gets its outermost frame's caller, as the warnings
    module reads a stack level past the top."""
    frame, level, outer = sys._getframe(0), 1, 1
    while frame is not None:
        if os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
            outer = level
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=outer + 1)
