"""trace-lightning: TRACE tree rollout allocation for RL on LLM search agents, on Lightning.

Layout (one small module per idea):
    tree         the rollout tree: the one data model from sampling to loss
    environment  the search agent's format, parsing, observations and reward
    retrieval/   BM25 index, Search-R1 retrieval server and HTTP client
    datasets     QA JSONL loading (our schema and FlashRAG's)
    engines/     rollout engines (vLLM, transformers) and checked weight sync
    rollout      the agent loop that grows trees
    allocation   TRACE's root and prefix solvers (pure functions)
    allocators   uniform / random_tree / prompt / trace / oracle budget plans
    predictor    the shared success predictor V(H) and its featurisers
    calibration  Brier, ECE, rank correlation, reliability curves
    advantage    tree-aware advantages (Tree-GRPO, TreePO, per-segment, GRPO)
    loss         clipped surrogate, token log-probs, predictor loss
    packing      token-budget micro-batches
    collect      one RL step: candidates -> allocation -> trees -> sequences
    data         TraceDataModule (rollouts each epoch)
    module       TraceModule (policy + predictor, the update)
    cli          the `trace-lightning` LightningCLI
    demo/        the generated multi-hop demo world and its warm start
"""

__version__ = "0.1.0"
