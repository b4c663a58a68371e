"""Retrieval for the search agent: one interface, an in-process BM25 index and an HTTP client.

Every retriever answers ``search(queries, topk)`` with one list of :class:`Passage` per
query, best first. Two implementations:

- :class:`BM25Retriever` (``bm25.py``): a bm25s index over a corpus JSONL, cached on disk.
- :class:`HTTPRetriever` (``client.py``): a client of the Search-R1 retrieval API, served
  by ``trace-lightning-retriever`` (``server.py``) or any Search-R1/FlashRAG server.

Corpora come in two forms, both accepted everywhere: ours, ``{"id", "title", "text"}``, and
FlashRAG/Search-R1's ``{"id", "contents"}`` with ``contents = '"' + title + '"\\n' + text``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

DOCUMENT_FORMS = '{"id", "title", "text"} or {"id", "contents"}'


@dataclass
class Passage:
    """One retrieved (or corpus) passage; ``score`` is None where the source gives none."""

    id: str
    title: str
    text: str
    score: float | None = None

    @property
    def contents(self) -> str:
        """The FlashRAG/Search-R1 form: ``'"' + title + '"\\n' + text``."""
        return f'"{self.title}"\n{self.text}'

    @classmethod
    def from_contents(cls, id: str, contents: str, score: float | None = None) -> Passage:
        """Parse the FlashRAG form back into title and text.

        The title is the first line without its enclosing quotes (a title may hold quotes
        itself, e.g. ``""Weird Al" Yankovic"``). A ``contents`` whose first line is not
        quoted keeps everything as text and an empty title, so nothing is lost.
        """
        first, sep, rest = contents.partition("\n")
        if sep and len(first) >= 2 and first.startswith('"') and first.endswith('"'):
            return cls(id=id, title=first[1:-1], text=rest, score=score)
        return cls(id=id, title="", text=contents, score=score)

    @classmethod
    def from_record(cls, record: object, where: str, score: float | None = None) -> Passage:
        """A document in either form -> Passage; ``where`` names the record in errors."""
        if not isinstance(record, dict):
            raise ValueError(f"{where} is a JSON {type(record).__name__}, not an object; "
                             f"a document is {DOCUMENT_FORMS}")
        doc_id = record.get("id")
        if isinstance(doc_id, int) and not isinstance(doc_id, bool):
            doc_id = str(doc_id)
        if not isinstance(doc_id, str) or not doc_id:
            raise ValueError(f"{where} has no string \"id\" (got {doc_id!r}); a document is "
                             f"{DOCUMENT_FORMS}")
        if isinstance(record.get("contents"), str):
            return cls.from_contents(doc_id, record["contents"], score)
        title, text = record.get("title"), record.get("text")
        if isinstance(title, str) and isinstance(text, str):
            return cls(id=doc_id, title=title, text=text, score=score)
        raise ValueError(f"{where} (id {doc_id!r}) has neither a string \"contents\" nor string "
                         f"\"title\" and \"text\" (keys: {sorted(record)}); a document is "
                         f"{DOCUMENT_FORMS}")


class Retriever(Protocol):
    """Anything the environment can send ``<search>`` queries to."""

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
        """Top ``topk`` passages for each query, best first (``result[i]`` for ``queries[i]``)."""
        ...


# The implementations import Passage from this package, so they come after its definition.
from trace_lightning.tasks.search_qa.retrieval.bm25 import BM25Retriever, load_corpus  # noqa: E402
from trace_lightning.tasks.search_qa.retrieval.client import HTTPRetriever, RetrieverError  # noqa: E402

__all__ = ["DOCUMENT_FORMS", "BM25Retriever", "HTTPRetriever", "Passage", "Retriever",
           "RetrieverError", "load_corpus"]
