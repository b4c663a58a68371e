#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py): one call of at most 8 minutes on one
# H100 or H200 whose image has torch but no vLLM, jsonargparse or bm25s.
#   1. here: scripts/gpu_prepare.sh            (wheels into .whl/, a demo world into
#                                               .devshare/world; both ignored by git)
#   2. one device call, from the checkout's root:
#        run(command="bash scripts/gpu_check.sh", carry=[".whl", ".devshare"], timeout_s=480)
#   3. here: cp <files_at>/gpu.json docs/results/gpu.json   (gpu_check.log beside it)
# It runs the demo under FSDP with the HF engine for 2 steps, packed against per-leaf loss
# and gradients (float32 and bfloat16, FlexAttention compiled), and the packed update's
# tokens/s, MFU and peak memory at a Qwen3-0.6B shape on 8,192-token rows, counting
# recompiles (TORCH_LOGS=recompiles prints each one to the log). Exit 0 only if all passed.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TORCH_LOGS=recompiles
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# 470 s for the check; the install and the copy back take the rest of the 8 minutes
timeout 470 python3 benchmarks/gpu_check.py --world .devshare/world --out "$OUT/gpu.json" \
  --budget-s 400 --fit-timeout-s 200 2>&1 | tee "$OUT/gpu_check.log" | grep -v "^Rollout"
