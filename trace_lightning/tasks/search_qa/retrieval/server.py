"""A retrieval service speaking the Search-R1 API, on FastAPI and uvicorn.

``POST /retrieve`` with ``{"queries": [...], "topk": k, "return_scores": true}`` answers
``{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}``; with
``"return_scores": false`` each hit is the bare document ``{"id", "contents"}``. ``contents``
is FlashRAG's ``'"' + title + '"\\n' + text``. ``topk`` defaults to 3 and ``return_scores``
to true (Search-R1's defaults). ``GET /health`` answers ``{"status": "ok", "documents": n,
"max_queries": q, "max_query_chars": c, "topk_max": k, "max_body_bytes": b,
"max_response_bytes": r}``: clients fit their batches to it.

Refusals carry a JSON body ``{"error": "..."}`` naming the limit and its flag: 400 for a
body that is not JSON or has a wrong field, 411 without a Content-Length, 413 for a request
over a size limit (body bytes, number of queries, query length) or whose answer would pass
``--max-response-bytes`` (encoded hit by hit, dropped as soon as it would), 404 for an
unknown path, 405 for a wrong method, 503 on a connection beyond ``--max-connections``, 500
if retrieval itself fails. HTTP that does not parse gets uvicorn's 400 (text). The server
keeps serving after any of them.

Serving: ``--event-loops`` uvicorn servers (httptools, uvloop where installed) share the
listening socket, each on a thread of its own; they accept connections (the kernel queues
``--backlog``), read requests and answer them, and a connection costs a file descriptor, no
thread. A request's parsing, search and encoding run in a pool of ``--workers`` threads, so
the loops stay free for the other connections. A connection silent for ``--idle-timeout-s``
while the server waits for its bytes (before a request, midway through one, or between
kept-alive ones) is closed without an answer. docs/retrieval_server.md has the details.

Run it with ``trace-lightning-retriever --corpus PATH --port 8000``. It checks its flags and
binds the port before building the index (a wiki-18 index takes a while), and listens only once
the index is ready: until then connections are refused, which clients retry.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import resource
import socket
import threading
from collections.abc import Callable, Sized
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from typing import NoReturn

import uvicorn
from fastapi import FastAPI, Request, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from trace_lightning.tasks.search_qa.retrieval import Passage, Retriever
from trace_lightning.tasks.search_qa.retrieval.bm25 import BM25Retriever, default_cache_dir

log = logging.getLogger(__name__)

SPARE_FILES = 64  # file descriptors kept beside --max-connections (the index, logs, libraries)
SHUTDOWN_GRACE_S = 5.0  # on shutdown, answers under way get this long to finish
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
        workers: threads that parse, search and encode requests (a connection holds none).
        event_loops: threads each running an event loop (uvicorn) that accepts connections
            and answers their requests; several keep up on cores shared with busy processes.
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
    workers: int = 4
    event_loops: int = 4
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


def json_response(status: int, payload: object, close: bool = False) -> Response:
    """``payload`` as JSON with ``status``; ``close`` ends the connection after the answer."""
    return Response(json.dumps(payload).encode(), status, media_type="application/json",
                    headers={"Connection": "close"} if close else None)


def answer(retriever: Retriever, limits: Limits, body: bytes) -> tuple[int, bytes]:
    """A ``/retrieve`` body -> (status, JSON answer): one request's work, run in a worker."""
    try:
        queries, topk, return_scores = parse_retrieve_request(body, limits)
        try:
            results = retriever.search(queries, topk) if queries else []
        except Exception as e:  # keep serving; the client sees a 500 and may retry
            log.exception("retrieval failed")
            return 500, json.dumps({"error": f"retrieval failed: {type(e).__name__}: "
                                             f"{e}"}).encode()
        return 200, b"".join(encode_results(results, return_scores, topk,
                                            limits.max_response_bytes))
    except RequestError as e:
        return e.status, json.dumps({"error": str(e)}).encode()


def make_app(retriever: Retriever, limits: Limits, pool: ThreadPoolExecutor,
             open_connections: Callable[[], int]) -> FastAPI:
    """The Search-R1 API over ``retriever``: requests are checked against ``limits`` and
    answered in ``pool``; ``open_connections()`` counts the server's open connections."""
    n_documents = len(retriever) if isinstance(retriever, Sized) else None
    app = FastAPI(title="trace-lightning-retriever", openapi_url=None, docs_url=None,
                  redoc_url=None, redirect_slashes=False)

    def full() -> Response | None:
        """503 when this request's connection is one over ``--max-connections``."""
        if open_connections() <= limits.max_connections:
            return None
        return json_response(503, {"error": f"{limits.max_connections} connections are open, "
                                            f"the most this server takes (--max-connections): "
                                            f"retry later, or raise the server's "
                                            f"--max-connections"}, close=True)

    async def health() -> Response:
        return full() or json_response(200, {"status": "ok", "documents": n_documents,
                                             **limits.advertised()})

    async def retrieve(request: Request) -> Response:
        if refusal := full():
            return refusal
        length = request.headers.get("content-length")
        if length is None:
            return json_response(411, {"error": "Content-Length header missing; send the "
                                                "body's length"})
        if int(length) > limits.max_body_bytes:  # digits: the HTTP parser refuses others
            # the body stays unread, so the connection is closed after the answer
            return json_response(413, {"error": f"body of {length[:50]} bytes; this server "
                                                f"takes at most {limits.max_body_bytes} "
                                                f"(--max-body-bytes)"}, close=True)
        try:
            body = await request.body()
        except ClientDisconnect:  # gone, or closed for --idle-timeout-s: no one to answer
            return Response(status_code=400)
        status, content = await asyncio.get_running_loop().run_in_executor(
            pool, answer, retriever, limits, body)
        return Response(content, status, media_type="application/json")

    for path in ("/health", "/health/"):
        app.add_api_route(path, health, methods=["GET"])
    for path in ("/retrieve", "/retrieve/"):
        app.add_api_route(path, retrieve, methods=["POST"])

    @app.exception_handler(HTTPException)
    async def no_route(request: Request, e: HTTPException) -> Response:
        """404 (unknown path) and 405 (wrong method) with the JSON error body."""
        path = request.url.path
        message = {404: f"unknown path {path!r}; use POST /retrieve or GET /health",
                   405: f"{request.method} {path!r} is not served; use POST /retrieve or "
                        f"GET /health"}.get(e.status_code, str(e.detail))
        return Response(json.dumps({"error": message}).encode(), e.status_code,
                        headers=e.headers, media_type="application/json")

    return app


class IdleTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing a connection silent for ``timeout_keep_alive``
    seconds whenever the server waits for its bytes: uvicorn times only the wait between two
    requests on a kept-alive connection, this also the wait before the first request and
    within one (headers or body sent in part), so a client that stalls is closed unanswered.
    """

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._time_silence()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # stops the timer
        self._time_silence()

    def _time_silence(self) -> None:
        cycle = self.cycle  # the request read or answered last; None before the first
        if self.transport.is_closing() or (
                cycle is not None and not cycle.response_complete and not cycle.more_body):
            return  # the whole request is in: the server is answering it
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                            self.timeout_keep_alive_handler)


class RetrievalServer:
    """A socket bound to the server's address and, once :func:`listen` has run, the event
    loops that serve it (uvicorn servers sharing the socket) and the search threads.

    ``serve_forever`` runs the loops, one in the calling thread and the others in threads of
    their own, until ``shutdown`` (called from another thread, or a signal when it runs in
    the main thread); ``server_close`` releases the port and the search threads.
    """

    def __init__(self, sock: socket.socket, limits: Limits):
        self.socket, self.limits = sock, limits
        self.server_address: tuple[str, int] = sock.getsockname()[:2]
        self.loops: list[uvicorn.Server] = []
        self.pool: ThreadPoolExecutor | None = None
        self.serving, self._stopped = False, threading.Event()

    def open_connections(self) -> int:
        return sum(len(loop.server_state.connections) for loop in self.loops)

    def serve_forever(self) -> None:
        if not self.loops:
            raise RuntimeError("listen(server, retriever) first")
        self.serving = True
        # each loop closes its socket when it stops: each gets a copy of the listening one
        threads = [threading.Thread(target=loop.run, kwargs={"sockets": [self.socket.dup()]},
                                    name=f"retriever-loop-{i}", daemon=True)
                   for i, loop in enumerate(self.loops[1:], 1)]
        for thread in threads:
            thread.start()
        try:
            self.loops[0].run(sockets=[self.socket.dup()])
        finally:
            for loop in self.loops:
                loop.should_exit = True
            for thread in threads:
                thread.join()
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop ``serve_forever`` and wait for it (answers under way get SHUTDOWN_GRACE_S)."""
        for loop in self.loops:
            loop.should_exit = True
        if self.serving:
            self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def bind(host: str, port: int, limits: Limits) -> RetrievalServer:
    """A server bound to ``host:port`` but not yet listening (connections are refused, so
    clients retry) and without a retriever: :func:`listen` gives it both. OSError if a server
    listens on the port already. Binding does not reserve it: with ``SO_REUSEADDR`` (set, so
    a restart reuses the port at once) another socket may still bind it and listen first,
    and then :func:`listen` raises."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return RetrievalServer(sock, limits)


def listen(server: RetrievalServer, retriever: Retriever) -> None:
    """Start listening on a :func:`bind` server's socket (connections queue in the backlog
    until ``serve_forever`` accepts them) and build its app, search threads and loops."""
    limits = server.limits
    server.socket.listen(limits.backlog)
    server.pool = ThreadPoolExecutor(limits.workers, thread_name_prefix="retriever-worker")
    config = uvicorn.Config(
        make_app(retriever, limits, server.pool, server.open_connections),
        http=IdleTimeoutProtocol, ws="none", lifespan="off", log_config=None, access_log=False,
        proxy_headers=False, backlog=limits.backlog,
        timeout_keep_alive=limits.idle_timeout_s,  # type: ignore[arg-type]  (a float works)
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,  # type: ignore[arg-type]
        log_level="warning")  # ours says when it serves; uvicorn's warnings stay
    server.loops = [uvicorn.Server(config) for _ in range(limits.event_loops)]


def make_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 8000,
                **limits: float) -> RetrievalServer:
    """A bound and listening (not yet serving) server; ``port=0`` picks a free port;
    ``limits`` are :class:`Limits` fields (ValueError naming the flag of a bad one)."""
    server = bind(host, port, Limits(**limits))
    listen(server, retriever)
    return server


def serve_in_thread(retriever: Retriever, host: str = "127.0.0.1", port: int = 0,
                    **limits: float) -> tuple[RetrievalServer, str]:
    """Serve from a daemon thread -> (server, base url); ``port=0`` picks a free port.

    Stop it with ``server.shutdown(); server.server_close()``.
    """
    server = make_server(retriever, host, port, **limits)
    server.serving = True  # before the thread runs: shutdown() waits for it from now on
    threading.Thread(target=server.serve_forever, name="retriever-server", daemon=True).start()
    bound_host, bound_port = server.server_address
    return server, f"http://{bound_host}:{bound_port}"


def main(argv: list[str] | None = None) -> None:
    """Console entry ``trace-lightning-retriever``: BM25 over a corpus, served until Ctrl-C."""
    parser = argparse.ArgumentParser(prog="trace-lightning-retriever",
                                     description="Serve BM25 retrieval over a corpus JSONL with "
                                                 "the Search-R1 API (POST /retrieve).")
    parser.add_argument("--corpus", required=True,
                        help='corpus JSONL: {"id","title","text"} or {"id","contents"} lines')
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1; 0.0.0.0 exposes it)")
    parser.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    parser.add_argument("--cache-dir", default=None,
                        help=f"folder for the cached index (default {default_cache_dir()}: "
                             f"$XDG_CACHE_HOME/trace-lightning/bm25, else "
                             f"~/.cache/trace-lightning/bm25)")
    parser.add_argument("--k1", type=float, default=0.9, help="BM25 k1")
    parser.add_argument("--b", type=float, default=0.4, help="BM25 b")
    limits = parser.add_argument_group(
        "limits", "what one request may ask, and how many connections are served at once; "
                  "GET /health announces the first five")
    for name, kind, text in (
            ("topk_max", int, "largest topk a request may ask"),
            ("max_queries", int, "most queries per request"),
            ("max_query_chars", int, "longest query, in characters"),
            ("max_body_bytes", int, "largest request body, in bytes"),
            ("max_response_bytes", int, "largest answer, in bytes: a request whose answer "
                                        "would be larger is refused with 413"),
            ("workers", int, "threads that parse, search and encode requests (a "
                             "connection holds none)"),
            ("event_loops", int, "threads that each run an event loop accepting connections "
                                 "and answering their requests"),
            ("backlog", int, "connections the kernel queues before they are accepted "
                             "(capped by net.core.somaxconn)"),
            ("max_connections", int, "most connections open at once; a request on one more "
                                     "is answered 503"),
            ("idle_timeout_s", float, "seconds a connection may stay silent before or while "
                                      "sending its request, or between two requests")):
        limits.add_argument(flag(name), type=kind, default=getattr(Limits, name),
                            help=f"{text} (default %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    def fail(message: str) -> NoReturn:
        parser.exit(2, f"{parser.prog}: {message}\n")

    # flags and the port first: building a large index (wiki-18) takes a long while
    if not (math.isfinite(args.k1) and args.k1 >= 0):
        fail(f"--k1 ({args.k1}) must be a finite number >= 0; Pyserini's default is 0.9")
    if not 0 <= args.b <= 1:
        fail(f"--b ({args.b}) must be in [0, 1]; Pyserini's default is 0.4")
    if not 0 <= args.port <= 65535:
        fail(f"--port ({args.port}) must be in [0, 65535] (0 picks a free port)")
    try:
        server_limits = Limits(**{f.name: getattr(args, f.name) for f in fields(Limits)})
    except ValueError as e:
        fail(str(e))
    try:
        server = bind(args.host, args.port, server_limits)
    except OSError as e:
        fail(f"cannot listen on {args.host}:{args.port} ({e.strerror or e}); is another server "
             f"on that port? Pick another with --port (0 picks a free one), or check --host")
    try:
        retriever = BM25Retriever(args.corpus, cache_dir=args.cache_dir, k1=args.k1, b=args.b)
    except (ValueError, OSError) as e:  # a bad corpus: not JSON lines, missing, a directory
        server.server_close()
        fail(str(e))
    try:
        listen(server, retriever)
    except OSError as e:  # another server took the port while the index was built
        server.server_close()
        fail(f"cannot listen on {args.host}:{args.port} ({e.strerror or e}); another server "
             f"started on that port while the index was built (it is cached now, so a restart "
             f"is quick): pick another with --port, or stop the other one")
    host, port = server.server_address
    log.info("serving %d passages of %s at http://%s:%d/retrieve (index %s, %s; %d event "
             "loops, %d workers, backlog %d, at most %d connections)", len(retriever),
             args.corpus, host, port, retriever.index_dir,
             "loaded from cache" if retriever.loaded_from_cache else "built",
             server_limits.event_loops, server_limits.workers, server_limits.backlog,
             server_limits.max_connections)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
