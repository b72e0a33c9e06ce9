import os
import sys

import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile(
    "ci",
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# a longer, randomised search for a developer's own run: HYPOTHESIS_PROFILE=deep python -m pytest ...
# (the profile, and ``pytest_collection_modifyitems`` below scales the tests' own max_examples by DEEP_FACTOR)
DEEP_FACTOR = 15
settings.register_profile(
    "deep",
    max_examples=12 * DEEP_FACTOR,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fast_paths_on_tiny_models(monkeypatch):
    """Tests run tiny models: let the clipped sum's zero-row check act at their sizes too (in use it
    is not tried below ``ACTIVE_ROWS_MIN_WORK`` multiply-adds, where it cannot pay), so the exactness
    tests keep reaching that path. ``test_active_rows_not_tried_on_small_layers`` checks the gate
    (``test_sym_gram_levels_at_the_default_thresholds`` the symmetric Grams' one)."""
    import pdpsgd.bookkeeping as bk

    monkeypatch.setattr(bk, "ACTIVE_ROWS_MIN_WORK", 0)
    # likewise the symmetric block Grams (``_SymGram``, in use from T = 128): from T = 4, blocks of
    # ≥ 2 rows, so the exactness tests' sequence lengths take both the full and the block Grams
    monkeypatch.setattr(bk, "SYM_MIN_T", 4)
    monkeypatch.setattr(bk, "SYM_BLOCK_MIN", 2)
    # and the row-blocked clipped sums of wide layers (``_tmm``, in use from 4096 output rows): from
    # 6 rows, in blocks of 5 (a last, shorter block included), so the tiny models' heads take it
    monkeypatch.setattr(bk, "SUM_BLOCK_MIN_ROWS", 6)
    monkeypatch.setattr(bk, "SUM_BLOCK_ROWS", 5)


def pytest_collection_modifyitems(config, items):
    """Under HYPOTHESIS_PROFILE=deep: each hypothesis test's own ``@settings(max_examples=n)``
    becomes n × DEEP_FACTOR, with a new random draw each run (CI's profile leaves them as written)."""
    if os.environ.get("HYPOTHESIS_PROFILE") != "deep":
        return
    done = set()  # (a parametrized test's items share one function: scale it once)
    for item in items:
        fn = getattr(item, "obj", None)
        own = getattr(fn, "_hypothesis_internal_use_settings", None)
        if own is not None and id(fn) not in done:
            done.add(id(fn))
            fn._hypothesis_internal_use_settings = settings(
                own, max_examples=own.max_examples * DEEP_FACTOR, derandomize=False, deadline=None)
