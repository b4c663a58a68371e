"""trace-lightning: TRACE tree rollout allocation for RL on LLM agents, on Lightning.

Layout, by part (one small module per idea):

    tree.py        the rollout tree: the one data model from sampling to loss
    data.py        TraceDataModule: the engine, the RL step and validation each epoch
    learner.py     what the DataModule asks of the LightningModule (the Learner protocol)
    cli.py         the `trace-lightning` LightningCLI
    math/          the pure math: allocation solvers, advantages, the loss, calibration
    allocation/    who gets how many rollouts: allocators and the prefix planner, the
                   shared success predictor, its features, each prompt's history
    rollout/       sampling: the agent loop (agent), one RL step (step), validation
                   rollouts, the engines (vLLM, transformers) and their checked weight sync
    tasks/         what the agent does: the Task / TaskData seam (base), search QA
                   (Search-R1 format, EM/F1, QA loaders, BM25 and the retrieval server, the
                   generated demo world) and arithmetic with a calculator (calc)
    training/      the update: TraceModule, tree packing and its attention, mini-batches,
                   FSDP strategies, checkpoints and the policy's export
    collectives, logs, jsonl, hub, models: gathers across ranks, scalars to the loggers,
    JSONL files, policy paths and hub ids, the tiny Qwen3 and tokenizer built here
    numpy_simd.py  numpy held to its AVX2 paths, so every x86-64 CPU gets the same results

Where to change the task, the allocation rule, the advantage or the engine:
docs/extending.md.
"""

from trace_lightning.numpy_simd import pin_numpy_simd

# Before numpy loads: its AVX2 paths on every x86-64 CPU, so ties break alike everywhere.
pin_numpy_simd()

__version__ = "0.1.0"
