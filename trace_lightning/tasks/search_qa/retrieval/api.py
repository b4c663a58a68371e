"""The Search-R1 retrieval API's requests and answers, checked against a server's limits.

``POST /retrieve`` with ``{"queries": [...], "topk": k, "return_scores": true}`` answers
``{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}``; with
``"return_scores": false`` each hit is the bare document ``{"id", "contents"}``. ``contents``
is FlashRAG's ``'"' + title + '"\\n' + text``. ``topk`` defaults to 3 and ``return_scores``
to true (Search-R1's defaults). ``GET /health`` answers ``{"status": "ok", "documents": n,
"max_queries": q, "max_query_chars": c, "topk_max": k, "max_body_bytes": b,
"max_response_bytes": r}``: clients fit their batches to it.

:class:`Limits` are ``trace-lightning-retriever``'s flags; :func:`parse_retrieve_request`
checks a ``/retrieve`` body against them and :func:`encode_results` writes the answer within
``--max-response-bytes``, raising :class:`RequestError` (an HTTP status and a message that
names the flag: 400 or 413) for what they refuse. ``server.py`` serves them over HTTP.
"""

from __future__ import annotations

import json
import math
import resource
from dataclasses import asdict, dataclass, fields

from trace_lightning.tasks.search_qa.retrieval import Passage

SPARE_FILES = 64  # file descriptors kept beside --max-connections (the index, logs, libraries)
_SHAPE = "{\"queries\": [str, ...], \"topk\": int}"


@dataclass(frozen=True)
class Limits:
    """What one server takes; each field is the ``trace-lightning-retriever`` flag of the
    same name (``max_queries`` is ``--max-queries``).

    Args:
        max_queries: most queries in one request.
        max_query_chars: longest query, in characters.
        topk_max: largest topk a request may ask.
        max_body_bytes: largest request body, in bytes.
        max_response_bytes: largest answer, in bytes; a request whose answer would be larger
            is refused with 413 (ask fewer queries per request or a smaller topk).
        workers: threads, each an event loop (uvicorn) that accepts connections and reads,
            searches and answers their requests (a connection waiting holds no thread).
        backlog: connections the kernel queues before the server accepts them (capped by
            the system's net.core.somaxconn).
        max_connections: most connections open at once; a request on a connection beyond
            them is answered 503.
        idle_timeout_s: seconds a connection may stay silent while the server waits for its
            bytes (before its request, while sending it, or between requests) before it is
            closed.
    """

    max_queries: int = 512
    max_query_chars: int = 2000
    topk_max: int = 100
    max_body_bytes: int = 8 << 20
    max_response_bytes: int = 8 << 20
    workers: int = 8
    backlog: int = 1024
    max_connections: int = 512
    idle_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "float" and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{flag(f.name)} ({value}) must be a finite number > 0")
            if f.type == "int" and value < 1:
                raise ValueError(f"{flag(f.name)} ({value}) must be >= 1")
        files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if files != resource.RLIM_INFINITY and self.max_connections + SPARE_FILES > files:
            raise ValueError(f"--max-connections ({self.max_connections}) needs "
                             f"{self.max_connections + SPARE_FILES} file descriptors, and this "
                             f"process may open {files} (ulimit -n): lower --max-connections "
                             f"to {max(files - SPARE_FILES, 1)} or raise ulimit -n")

    def advertised(self) -> dict[str, int]:
        """The limits a request must fit, announced on ``/health``."""
        return {k: v for k, v in asdict(self).items()
                if k in ("max_queries", "max_query_chars", "topk_max", "max_body_bytes",
                         "max_response_bytes")}


def flag(name: str) -> str:
    """``max_queries`` -> ``--max-queries``."""
    return "--" + name.replace("_", "-")


class RequestError(Exception):
    """A refused request: HTTP status and the message for the ``error`` field."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_retrieve_request(body: bytes, limits: Limits) -> tuple[list[str], int, bool]:
    """Validate a ``/retrieve`` body -> (queries, topk, return_scores); RequestError if bad."""
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, f"body is not JSON ({e}); send {_SHAPE}") from None
    except RecursionError:  # "[[[[...": the parser gives up, the server must not
        raise RequestError(400, f"body nests JSON arrays or objects too deeply to parse; send "
                                f"{_SHAPE}") from None
    except ValueError as e:  # an integer of over 4,300 digits: Python will not convert it
        raise RequestError(400, f"body holds a number too long to read ({e}); \"topk\" is an "
                                f"integer in [1, {limits.topk_max}]") from None
    if not isinstance(payload, dict):
        raise RequestError(400, f"body is a JSON {type(payload).__name__}; send an object "
                                f"{_SHAPE}")
    queries = payload.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise RequestError(400, f"\"queries\" must be a list of strings, got "
                                f"{json.dumps(queries)[:100]}")
    if len(queries) > limits.max_queries:
        raise RequestError(413, f"{len(queries)} queries in one request; this server takes at "
                                f"most {limits.max_queries} (--max-queries): split the batch")
    for i, query in enumerate(queries):
        if len(query) > limits.max_query_chars:
            raise RequestError(413, f"queries[{i}] has {len(query)} characters; this server "
                                    f"takes at most {limits.max_query_chars} (--max-query-chars)")
    topk = payload.get("topk", 3)
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= limits.topk_max:
        raise RequestError(400, f"\"topk\" must be an integer in [1, {limits.topk_max}] "
                                f"(--topk-max), got {json.dumps(topk)[:50]}")
    return_scores = payload.get("return_scores", True)
    if not isinstance(return_scores, bool):
        raise RequestError(400, f"\"return_scores\" must be true or false, got "
                                f"{json.dumps(return_scores)[:50]}")
    return queries, topk, return_scores


def encode_results(results: list[list[Passage]], return_scores: bool, topk: int,
                   max_bytes: int) -> list[bytes]:
    """The ``/retrieve`` answer as JSON, one piece per query, never more than ``max_bytes``
    of it: RequestError(413) as soon as the answer would pass that.

    ``b"".join(pieces)`` is ``{"result": [[hit, ...], ...]}`` with json.dumps's separators,
    and ``size`` counts its bytes so far, the closing ``]}`` included.
    """
    pieces, size = [b'{"result": ['], len(b'{"result": [' b"]}")
    for i, hits in enumerate(results):
        size += len(b", " if i else b"") + len(b"[]")
        items = []
        for p in hits:
            doc = {"id": p.id, "contents": p.contents}
            items.append(json.dumps({"document": doc, "score": p.score} if return_scores
                                    else doc).encode())
            size += len(items[-1]) + (len(b", ") if len(items) > 1 else 0)
            if size > max_bytes:
                break
        if size > max_bytes:
            raise RequestError(413, f"the answer to {len(results)} queries with topk {topk} is "
                                    f"over {max_bytes} bytes, the most this server sends "
                                    f"(--max-response-bytes): send fewer queries per request "
                                    f"or a smaller topk, or raise the server's "
                                    f"--max-response-bytes")
        pieces.append((b", [" if i else b"[") + b", ".join(items) + b"]")
    pieces.append(b"]}")
    return pieces
