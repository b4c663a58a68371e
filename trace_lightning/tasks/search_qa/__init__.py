"""Search QA: the Search-R1 agent format, EM/F1 rewards, QA data loaders, BM25 and the
retrieval server, and the generated demo world.
"""
