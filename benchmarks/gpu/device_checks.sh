#!/usr/bin/env bash
# Every check that needs a CUDA GPU, as one command for a lent GPU machine whose image has a CUDA
# torch but not commfuse's pure-Python dependencies (carried as wheels) and nothing installable:
#   1. the GPU mode (benchmarks/run.py --gpu): runtime streams on NCCL world size 1, Inductor
#      regions for CUDA, DHelix's second stream, the compute model against measured kernels;
#   2. the tests that skip without CUDA (side stream with events, NCCL communicator pool);
#   3. every example under torchrun on one GPU (NCCL world size 1), as a user launches it.
# Run from the repository root; results go to $OUT (default gpu-out/), at most 6 files.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
site=$(mktemp -d)
python -c "import sys; sys.path.insert(0, '.'); from pathlib import Path; \
from benchmarks.gpu.wheels import ensure_wheels; print(ensure_wheels(target=Path('$site')))"
export PYTHONPATH="$site:$PWD"

timeout 150 python benchmarks/run.py --gpu 2>&1 | tee "$out/gpu.log"
cp benchmarks/results/gpu-*.json benchmarks/results/gpu-*.md "$out/" 2>/dev/null

timeout 90 python -m pytest -p no:cacheprovider -v -rs -o addopts="" \
  tests/test_lagom.py::test_nccl_pool_group_created_with_cta_bounds \
  tests/test_lowering.py::test_cuda_side_stream_runs_with_events tests/test_torch_private.py \
  2>&1 | tee "$out/gputests.log"

for ex in quickstart llama_tp_sp simple_fsdp moe_ep; do
  echo "=== torchrun --nproc-per-node 1 examples/$ex.py" >> "$out/examples.log"
  timeout 90 torchrun --nproc-per-node 1 "examples/$ex.py" > "$out/$ex.tmp" 2>&1
  rc=$?
  # what the example printed and, on a failure, the error itself (torchrun's summary names no cause)
  grep -v "Warning\|warnings.warn" "$out/$ex.tmp" | grep -E "Error|step|loss|matches|->" | tail -20 >> "$out/examples.log"
  echo "=== $ex exit $rc" >> "$out/examples.log"
  rm -f "$out/$ex.tmp"
done
cat "$out/examples.log"
