# trace-lightning on multi-GPU nodes: CUDA, the project with its GPU extra (vLLM), and the
# `trace-lightning` CLI as the entry point.
#   docker build -t trace-lightning .
#   docker run --gpus all --ipc=host -v $PWD/runs:/work/runs trace-lightning \
#       fit --config configs/hotpotqa_qwen3.yaml
#   (the retriever: --entrypoint trace-lightning-retriever; an export of a checkpoint:
#    --entrypoint trace-lightning-export)
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv git \
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
