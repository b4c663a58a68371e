"""Who gets how many rollouts: the allocation strategies, the prefix planner, the shared
success predictor, its features and each prompt's history.
"""
