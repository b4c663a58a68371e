"""trace-lightning: TRACE tree rollout allocation for RL on LLM search agents, on Lightning.

Layout (one small module per idea):
    tree         the rollout tree: the one data model from sampling to loss
    environment  the search agent's format, parsing and observations
    reward       EM / F1 over gold aliases (SQuAD normalisation)
    retrieval/   BM25 index, Search-R1 retrieval server and HTTP client
    datasets     QA JSONL loading (our schema and FlashRAG's); jsonl: line-by-line reading
    hub          a policy path or hub id as a local directory
    engines/     rollout engines (vLLM, transformers) and checked weight sync
    rollout      the agent loop that grows trees
    allocation   TRACE's root and prefix solvers (pure functions)
    allocators   uniform / random_tree / prompt / trace / oracle budget plans
    features     prefix features for the predictor (policy hidden states, bag of tokens)
    predictor    the shared success predictor V(H): model, targets, replay, fit
    history      each prompt's past outcomes as a prior for its root prediction
    calibration  Brier, ECE, rank correlation, reliability curves
    advantage    tree-aware advantages (Tree-GRPO, TreePO, per-segment, GRPO)
    loss         clipped surrogate, token log-probs, predictor loss
    packing      token-budget micro-batches
    collect      one RL step: candidates -> allocation -> trees -> sequences
    collectives  gathers and broadcast across ranks (module and data module)
    logs         scalars straight to the loggers at Lightning's step (once per RL step)
    data         TraceDataModule (rollouts each epoch); data_config: its typed sections
    validation   validation rows (QA scores per trajectory), sampled afresh each pass
    module       TraceModule (policy + predictor, the update)
    cli          the `trace-lightning` LightningCLI
    export       the trained policy as a Hugging Face directory
    strategies   TraceFSDPStrategy (fp32 buffers and reductions), CPUFSDPStrategy
    models       a tiny Qwen3 and a BPE tokenizer trained here
    demo/        the generated multi-hop demo world and its warm start
"""

__version__ = "0.1.0"
