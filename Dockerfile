# trace-lightning on multi-GPU nodes: CUDA, the project with its GPU extra (vLLM), and the
# `trace-lightning` CLI as the entry point.
#   docker build -t trace-lightning .
# configs/hotpotqa_qwen3.yaml reads data/hotpotqa/train.jsonl, data/hotpotqa/dev.jsonl and
# data/2wikimultihopqa/dev.jsonl relative to /work, and searches through the retriever at
# 127.0.0.1:8000; the retriever serves data/wiki18/wiki-18.jsonl (docs/gpu.md). Both
# containers share the host's network, so that address reaches it; the hub cache mount
# keeps the Qwen/Qwen3-8B download across runs:
#   docker run -d --network host -v $PWD/data:/work/data \
#       --entrypoint trace-lightning-retriever trace-lightning \
#       --corpus data/wiki18/wiki-18.jsonl --port 8000
#   docker run --gpus all --ipc=host --network host -v $PWD/data:/work/data \
#       -v $PWD/runs:/work/runs -v $HOME/.cache/huggingface:/root/.cache/huggingface \
#       trace-lightning fit --config configs/hotpotqa_qwen3.yaml
#   (without host networking: both on a network of your own, `docker network create tl`
#    and --network tl, the retriever with --name retriever and --host 0.0.0.0 (it binds
#    127.0.0.1 by default), the trainer with --data.retriever_url http://retriever:8000.
#    An export of a checkpoint: --entrypoint trace-lightning-export)
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

# build-essential and python3-dev: Triton (under vLLM and torch.compile) compiles a small C
# driver module with `cc` against Python.h the first time it runs; the runtime image has neither
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        python3-dev build-essential git \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /opt/trace-lightning
COPY pyproject.toml README.md ./
COPY trace_lightning trace_lightning
COPY callbacks callbacks
COPY configs configs
RUN pip install '.[gpu]'

# the configs beside the runs, so `fit --config configs/...` reads as in a checkout (a
# mounted /work/configs of your own takes their place)
WORKDIR /work
COPY configs configs
ENTRYPOINT ["trace-lightning"]
CMD ["--help"]
