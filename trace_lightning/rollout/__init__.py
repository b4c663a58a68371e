"""Sampling: the agent loop that grows rollout trees, one RL step, validation rollouts and
the engines (vLLM, transformers) with their checked weight sync.
"""
