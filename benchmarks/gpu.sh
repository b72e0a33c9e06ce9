#!/usr/bin/env bash
# GPU run (one CUDA device, < 8 min): exactness checks on the CUDA path (compiled fused noise),
# then the benchmark at GPT-2-small size (12 layers, width 768, vocab 50257, T=256, B=8).
# Usage: bash benchmarks/gpu.sh            (from the repository root)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
echo "== exactness on CUDA =="
timeout 150 python benchmarks/gpu_check.py
check_rc=$?
echo "== benchmark: GPT-2 small, T=256, B=8 (time: interleaved medians; memory: max_memory_allocated per process) =="
timeout 310 python benchmarks/bench.py --device cuda --configs gpt2small-256 --reps 5 --fused --compile \
  --variants nonprivate,bk,auto,vmap,opacus,opacus_ghost --json "${OUT:-.}/gpu_bench.json"
bench_rc=$?
echo "== done in $(( $(date +%s) - start ))s: exactness rc=$check_rc, benchmark rc=$bench_rc =="
exit $(( check_rc != 0 || bench_rc != 0 ))
