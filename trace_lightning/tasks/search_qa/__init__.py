"""Search QA: the Search-R1 agent format, EM/F1 rewards, QA data loaders, BM25 and the
retrieval server, and the generated demo world (``SearchQAData``, ``SearchEnvironment``).
"""

from trace_lightning.tasks.search_qa.data import SearchQAData
from trace_lightning.tasks.search_qa.environment import SearchEnvironment

__all__ = ["SearchEnvironment", "SearchQAData"]
