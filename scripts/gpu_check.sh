#!/usr/bin/env bash
# One device run on the lent GPU machine: (1) the demo under Lightning FSDP on one GPU with
# the HF engine (the image has no vllm), (2) benchmarks/gpu.py. Carry .whl (jsonargparse,
# docstring_parser, typeshed_client, bm25s wheels) and a prepared demo copied to
# .devshare/world (both ignored by git).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
W=.devshare/world
VAL='[{"name":"demo_heldout","path":".devshare/world/eval_qa.jsonl","corpus":".devshare/world/eval_corpus.jsonl","limit":50}]'
start=$(date +%s)
timeout 200 python3 -m trace_lightning.cli fit --config configs/demo.yaml --config configs/demo_gpu.yaml \
  --data.engine.kind=hf --data.demo=null --model.policy_path=$W/model \
  --data.train=$W/train_qa.jsonl --data.corpus=$W/train_corpus.jsonl --data.val="$VAL" \
  --data.allocator.roots=32 --data.candidates_per_step=64 \
  --trainer.max_epochs=2 --trainer.default_root_dir=/tmp/fit --trainer.logger.init_args.save_dir=/tmp/fit \
  > /tmp/fit.log 2>&1
echo "FIT_EXIT $? after $(( $(date +%s) - start )) s"
grep -E "Error|error|Traceback|stopped" /tmp/fit.log | grep -v Warning | tail -15
cp /tmp/fit.log $OUT/fit.log
python3 - <<'PY'
import glob
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
for d in sorted(glob.glob("/tmp/fit/tensorboard/version_*"))[-1:]:
    ea = EventAccumulator(d, size_guidance={"scalars": 0}); ea.Reload()
    for t in sorted(ea.Tags()["scalars"]):
        if t.split("/")[0] in ("perf", "train", "val", "alloc", "predictor") :
            print(t, [round(e.value, 5) for e in ea.Scalars(t)][:6])
PY
ls /tmp/fit/tensorboard/version_0/checkpoints 2>/dev/null
python3 benchmarks/gpu.py --compile --budget-s 200 --out $OUT/gpu.json 2>&1 | tail -45
