#!/usr/bin/env bash
# Builds what the prepared GPU check (scripts/gpu_check.sh) carries to the device machine,
# in two folders git ignores (.gitignore: /.whl/, /.devshare/):
#   .whl/             wheels of the packages the GPU image lacks: jsonargparse and what
#                     LightningCLI's docstring parsing needs (docstring_parser,
#                     typeshed_client), and bm25s (the demo's retriever); pure Python, the
#                     versions this checkout's .venv was tested with
#   .devshare/world/  a prepared demo world: its policy (model/), questions and corpora
# Usage, from the checkout's root:
#   scripts/gpu_prepare.sh [WORLD]     # WORLD: a prepared demo (default runs/demo/world)
# Then one device call (at most 8 minutes; see scripts/gpu_check.sh).
set -euo pipefail
WORLD=${1:-runs/demo/world}
PY=${PYTHON:-.venv/bin/python}
if [[ ! -f "$WORLD/manifest.json" ]]; then
  echo "scripts/gpu_prepare.sh: $WORLD/manifest.json not found: WORLD ($WORLD) must be a" \
       "prepared demo world (trace-lightning fit --config configs/demo.yaml prepares" \
       "runs/demo/world); pass another one as the first argument" >&2
  exit 2
fi
rm -rf .whl .devshare/world
mkdir -p .whl .devshare/world
# pure-Python wheels: any platform's pip finds the same files
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp -d .whl jsonargparse==4.53.0 docstring_parser==0.18.0 \
  typeshed_client==2.15.0 bm25s==0.3.16
cp -r "$WORLD/model" .devshare/world/model
cp "$WORLD"/manifest.json "$WORLD"/train_qa.jsonl "$WORLD"/train_corpus.jsonl \
   "$WORLD"/eval_qa.jsonl "$WORLD"/eval_corpus.jsonl .devshare/world/
du -sh .whl .devshare
echo "ready: carry [\".whl\", \".devshare\"] (64 MiB at most with the working tree)"
