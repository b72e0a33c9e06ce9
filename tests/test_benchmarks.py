"""Smoke runs of the benchmark scripts on the CPU at toy size, so that they do not rot between the
sessions that time them. In particular ``benchmarks/gpu.sh``'s parts (``gpu_check.py``,
``bench.py --fused --compile``, ``gpu_profile.py``) have dry runs on the CPU: a GPU, when one is
lent, is lent for minutes, and a script that fails there wastes them. Nothing here is timed or
compared: each script must run to the end and print its table."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args, env=None, timeout=600):
    e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    res = subprocess.run([sys.executable, *args], cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{args} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout


def test_gpu_sh_parses():
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu.sh")], check=True)


def test_gpu_check_dry_run_on_cpu():
    out = _run(["benchmarks/gpu_check.py"], env={"PDPSGD_DEVICE": "cpu"})
    assert "gpu checks: 0 failures" in out and "FAIL" not in out


def test_bench_fused_compiled_all_variants_tiny():
    pytest.importorskip("opacus")
    out = _run(["benchmarks/bench.py", "--configs", "tiny", "--reps", "1", "--fused", "--compile", "--no-memory",
                "--variants", "nonprivate,bk,auto,vmap,opacus,opacus_ghost"])
    for v in ("nonprivate", "bk", "auto", "vmap", "opacus", "opacus_ghost"):
        assert f"| {v} |" in out, out


def test_gpu_profile_dry_run_on_cpu():
    out = _run(["benchmarks/gpu_profile.py", "--config", "tiny", "--device", "cpu", "--reps", "1"])
    assert "pdpsgd:noise_scale" in out


def test_phases_and_noise_bench_run():
    out = _run(["benchmarks/phases.py", "--configs", "tiny", "--steps", "1", "--threads", "2", "--clock", "wall"])
    assert "ghost norms" in out
    out = _run(["benchmarks/noise_bench.py", "--reps", "1"])
    assert "native" in out or "torch" in out


def test_noise_overlap_runs():
    from pdpsgd import native_rng

    if not native_rng.available():
        pytest.skip("the native noise kernel does not build here")
    out = _run(["benchmarks/noise_overlap.py", "--configs", "tiny", "--reps", "1"])
    assert "noise at SCHED_IDLE" in out and "step, then noise" in out


def test_guard_cost_runs_and_a_step_keeps_the_structure():
    out = _run(["benchmarks/guard_cost.py", "--configs", "tiny", "--reps", "3"])
    assert "structure unchanged by a step: True" in out and "model_structure" in out


def test_families_speed_runs_with_every_parameter_on_the_rules():
    """Round 53's and 54's families (here MPNet and SqueezeBERT, the quickest): nothing on the fallback."""
    out = _run(["benchmarks/families_speed.py", "mpnet", "squeezebert", "--reps", "1"])
    assert out.count("bk × np") == 2 and out.count("fallback: 0/") == 2, out
