"""Regenerate every paper-reproduction table and plot: ``python paper_repro/run_all.py --quick``.

Runs each script in its own process (``--smoke`` | ``--quick`` | ``--full``), in order, and writes
``<out>/run_all.{md,json}`` with each script's wall time and exit status. Exit status 1 if any
script failed (the others still run). ``--only t2_utility,audit`` runs a subset.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import environment, parse_mode  # noqa: E402

SCRIPTS = ["audit", "t1_time", "t2_utility", "t3_mia", "bk_complexity", "bk_throughput", "bk_utility"]


def main(argv=None):
    a = parse_mode(__doc__.splitlines()[0], argv,
                   extra=lambda p: p.add_argument("--only", default="", help="comma-separated subset of " + ",".join(SCRIPTS)))
    chosen = [s for s in SCRIPTS if not a.only or s in a.only.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)
    results = []
    t_all = time.time()
    for name in chosen:
        t = time.time()
        cmd = [sys.executable, str(HERE / f"{name}.py"), f"--{a.mode}", "--out", str(a.out), "--seed", str(a.seed)]
        print(f"== {name} ({' '.join(cmd[2:])})", flush=True)
        log = a.out / f"{name}.log"
        with open(log, "w") as f:
            p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        dt = time.time() - t
        results.append({"script": name, "seconds": round(dt, 1), "ok": p.returncode == 0, "returncode": p.returncode})
        print(f"   {'ok' if p.returncode == 0 else 'FAILED'} in {dt:.0f} s (log: {log})", flush=True)
        if p.returncode == 0 and a.mode != "smoke":
            log.unlink(missing_ok=True)  # keep logs of failures only
    total = time.time() - t_all
    env = environment()
    lines = [f"# run_all --{a.mode}", "", f"Total {total:.0f} s ({total / 60:.1f} min) on {env['cpu_threads']} CPU thread(s), "
             f"torch {env['torch']}, book-keeping engine available: {env['bk_available']}.", "",
             "| script | seconds | status |", "|---|---|---|"]
    lines += [f"| {r['script']} | {r['seconds']:.0f} | {'ok' if r['ok'] else 'FAILED (exit %d)' % r['returncode']} |" for r in results]
    (a.out / "run_all.md").write_text("\n".join(lines) + "\n")
    (a.out / "run_all.json").write_text(json.dumps({"mode": a.mode, "total_s": total, "environment": env,
                                                    "scripts": results}, indent=1))
    print("\n".join(lines))
    if a.mode != "smoke" and a.out.resolve() in ((HERE / "results").resolve(), (HERE / "results" / "full").resolve()):
        import readme

        print("README:", readme.main())
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
