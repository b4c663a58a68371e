# trace-lightning on multi-GPU nodes: CUDA, the project with its GPU extra (vLLM 0.32.0, the
# release the engine adapter was tested with), the `trace-lightning` CLI as the entry point,
# and TensorBoard.
#   docker build -t trace-lightning .
# Host: NVIDIA driver 580 or newer. torch 2.13.0's and vLLM 0.32.0's wheels are built for
# CUDA 13.0 and bring its libraries; this base image's CUDA 13.0 makes the NVIDIA container
# runtime refuse an older driver at `docker run` instead of failing at the first kernel.
# configs/hotpotqa_qwen3.yaml reads data/hotpotqa/train.jsonl, data/hotpotqa/dev.jsonl and
# data/2wikimultihopqa/dev.jsonl relative to /work, and searches through the retriever at
# 127.0.0.1:8000; the retriever serves data/wiki18/wiki-18.jsonl (docs/gpu.md). Both
# containers share the host's network, so that address reaches it. The retriever caches its
# BM25 index (wiki-18's 21M passages: a long first build) in its default cache folder,
# /root/.cache/trace-lightning/bm25; the mounted $PWD/cache keeps it across containers, so
# only the first start builds it. The hub cache mount keeps the Qwen/Qwen3-8B download:
#   docker run -d --network host -v $PWD/data:/work/data \
#       -v $PWD/cache:/root/.cache/trace-lightning \
#       --entrypoint trace-lightning-retriever trace-lightning \
#       --corpus data/wiki18/wiki-18.jsonl --port 8000
#   docker run --gpus all --ipc=host --network host -v $PWD/data:/work/data \
#       -v $PWD/runs:/work/runs -v $HOME/.cache/huggingface:/root/.cache/huggingface \
#       trace-lightning fit --config configs/hotpotqa_qwen3.yaml
#   TensorBoard from the same image, on the runs the trainer writes (http://<host>:6006):
#   docker run -d --network host -v $PWD/runs:/work/runs --entrypoint tensorboard \
#       trace-lightning --logdir runs/hotpotqa_qwen3 --bind_all --port 6006
#   (without host networking: both on a network of your own, `docker network create tl`
#    and --network tl, the retriever with --name retriever and --host 0.0.0.0 (it binds
#    127.0.0.1 by default), the trainer with
#    --data.task.init_args.retriever_url http://retriever:8000, TensorBoard with -p 6006:6006.
#    An export of a checkpoint: --entrypoint trace-lightning-export)
FROM nvidia/cuda:13.0.0-cudnn-runtime-ubuntu24.04

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
# the retriever's port and TensorBoard's (documentation: host networking needs neither)
EXPOSE 8000 6006
ENTRYPOINT ["trace-lightning"]
CMD ["--help"]
