#!/usr/bin/env bash
# GPU run (one CUDA device, < 8 min): exactness checks on the CUDA path (compiled fused noise),
# then the benchmark at GPT-2-small size (12 layers, width 768, vocab 50257, T=256, B=8); then, time
# permitting, a bf16-autocast timing, gpu_profile.py and the small configs' timings (diagnostics).
# Usage: bash benchmarks/gpu.sh            (from the repository root; on the lent machines torch is in
#        /opt/torch/.venv: PATH=/opt/torch/.venv/bin:$PATH bash benchmarks/gpu.sh)
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
# diagnostics, each only while the whole run stays under 8 minutes
left() { echo $(( 450 - ($(date +%s) - start) )); }
if [ "$(left)" -gt 60 ]; then
  echo "== the same with bf16 torch.autocast around the model call (time only) =="
  timeout "$(left)" python benchmarks/bench.py --device cuda --configs gpt2small-256 --reps 5 --fused --compile --amp \
    --variants nonprivate,bk,opacus,opacus_ghost --no-memory 2>&1 | grep -E "^timing|^\|"
fi
if [ "$(left)" -gt 60 ]; then
  echo "== where a bk step's time goes (host syncs, phases, top kernels) =="
  timeout "$(left)" python benchmarks/gpu_profile.py --config gpt2small-256 --reps 5 2>&1 | grep -v USDT | head -60
fi
if [ "$(left)" -gt 60 ]; then
  echo "== the issue's small CPU configs on this GPU (time only; launch-bound) =="
  timeout "$(left)" python benchmarks/bench.py --device cuda --configs gpt2-128,gpt2-32,gpt2-512,bert-128 --reps 7 \
    --variants nonprivate,bk,auto --no-memory 2>&1 | grep -E "^timing"
fi
echo "== done in $(( $(date +%s) - start ))s: exactness rc=$check_rc, benchmark rc=$bench_rc =="
exit $(( check_rc != 0 || bench_rc != 0 ))
