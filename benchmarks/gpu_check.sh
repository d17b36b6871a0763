#!/usr/bin/env bash
# The GPU checks of issue 34 as one script: bash benchmarks/gpu_check.sh [--dry-run]
#
# On one GPU (sized for < 8 minutes on an H100), from the repository root, output in $OUT
# (default reports/gpu_check/):
#   1. every test in tests/kernels on CUDA, Triton compiling for real (TRITON_INTERPRET unset);
#   2. benchmarks/quant_kernels.py (goal: bit-plane GEMV at 3 bits >= 2x fp16 matmul, batch 1, 7B shapes);
#   3. benchmarks/sparse_kernels.py;
#   4. the training loop on the full preset's largest rung, bf16 autocast + torch.compile: tokens/s, MFU;
#   5. the downstream scorer's packed-tree path on CUDA against the CPU on the same items;
#   6. DDP on 1 GPU against the plain loop.
# Each step's log is $OUT/<step>.log; the numbers are in $OUT/*.json and *.csv; $OUT/summary.txt
# lists each step's status and time. The script goes on after a failed step and exits 1 at the end.
#
# --dry-run: everything that needs no CUDA, on the CPU at small sizes (kernel tests in Triton's
# interpreter, the benchmarks' CPU modes, the three checks of benchmarks/gpu_check.py at tiny sizes),
# to check the script where no GPU is (~2-4 minutes on 2 cores).
#
# PYTHON names the interpreter (default: python3). Packages the GPU image lacks (polars, pyyaml, ...)
# travel as wheels in .whl/ (see the device notes); when .whl/ exists they are installed to /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
PY=${PYTHON:-python3}
OUT=${OUT:-reports/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
if [[ -d .whl ]] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
FAILED=()
: > "$OUT/summary.txt"

step() {  # step <name> <timeout seconds> <command...>
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  local status=ok
  [[ $rc -ne 0 ]] && { status="FAILED (exit $rc$([[ $rc -eq 124 ]] && echo ', timed out'))"; FAILED+=("$name"); }
  printf '%-12s %-32s %4ds\n' "$name" "$status" $((SECONDS - t0)) | tee -a "$OUT/summary.txt"
}

if [[ $DRY -eq 1 ]]; then
  export CUDA_VISIBLE_DEVICES=""
  export TRITON_INTERPRET=1
  step env 60 $PY -c "import torch, sys; print('dry run on CPU: torch', torch.__version__, 'python', sys.version.split()[0])"
  step kernels 600 $PY -m pytest tests/kernels -q -x -p no:cacheprovider
  step quant 300 $PY benchmarks/quant_kernels.py --out "$OUT" --repeats 3 --no-sweep
  step sparse 300 $PY benchmarks/sparse_kernels.py --out "$OUT" --lengths 512 --budgets 0.25 --repeats 2 --gemv-repeats 3
  step train 300 $PY benchmarks/gpu_check.py train --dry-run --out "$OUT"
  step scorer 300 $PY benchmarks/gpu_check.py scorer --dry-run --out "$OUT"
  step ddp1 300 $PY benchmarks/gpu_check.py ddp1 --dry-run --out "$OUT"
else
  unset TRITON_INTERPRET
  step env 60 bash -c "nvidia-smi; $PY -c \"import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())\""
  step kernels 150 $PY -m pytest tests/kernels -q -p no:cacheprovider
  step quant 100 $PY benchmarks/quant_kernels.py --out "$OUT" --budget-s 45
  step sparse 80 $PY benchmarks/sparse_kernels.py --out "$OUT"
  step train 120 $PY benchmarks/gpu_check.py train --out "$OUT"
  step scorer 40 $PY benchmarks/gpu_check.py scorer --out "$OUT"
  step ddp1 60 $PY benchmarks/gpu_check.py ddp1 --out "$OUT"
fi

echo "== summary ($OUT/summary.txt)"; cat "$OUT/summary.txt"
if [[ ${#FAILED[@]} -gt 0 ]]; then
  echo "failed: ${FAILED[*]}"
  exit 1
fi
