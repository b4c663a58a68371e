"""A retrieval service speaking the Search-R1 API, on FastAPI and uvicorn.

``POST /retrieve`` and ``GET /health`` as ``api.py`` describes them; refusals carry a JSON
body ``{"error": "..."}`` naming the limit and its flag: 400 for a body that is not JSON or has a
wrong field, 411 without a Content-Length, 413 for a request over a size limit or whose
answer would pass ``--max-response-bytes``, 404 for an unknown path, 405 for a wrong method,
503 on a connection beyond ``--max-connections``, 500 if retrieval itself fails. HTTP that
does not parse gets uvicorn's 400 (text). The server keeps serving after any of them.

Serving: ``--workers`` threads each run an event loop, a uvicorn server (httptools, uvloop
where installed), all on the one listening socket; a loop accepts connections and reads,
searches and answers their requests, and a connection costs a file descriptor, no thread.
The search runs in the loop's own thread: while it does, that loop's other connections wait
and the other loops accept the new ones. A connection silent for ``--idle-timeout-s`` while
the server waits for its bytes, or for it to read an answer, is closed.
docs/retrieval_server.md has the details.

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
import socket
import threading
from collections.abc import Callable, Sized
from dataclasses import fields
from typing import NoReturn

import uvicorn
from fastapi import FastAPI, Request, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from trace_lightning.tasks.search_qa.retrieval import Retriever
from trace_lightning.tasks.search_qa.retrieval.api import (Limits, RequestError, encode_results,
                                                           flag, parse_retrieve_request)
from trace_lightning.tasks.search_qa.retrieval.bm25 import BM25Retriever, default_cache_dir

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # on shutdown, answers under way get this long to finish


def json_response(status: int, payload: object, close: bool = False) -> Response:
    """``payload`` as JSON with ``status``; ``close`` ends the connection after the answer."""
    return Response(json.dumps(payload).encode(), status, media_type="application/json",
                    headers={"Connection": "close"} if close else None)


def answer(retriever: Retriever, limits: Limits, body: bytes) -> tuple[int, bytes]:
    """A ``/retrieve`` body -> (status, JSON answer): parsed, searched and encoded."""
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


def make_app(retriever: Retriever, limits: Limits,
             open_connections: Callable[[], int]) -> FastAPI:
    """The Search-R1 API over ``retriever``, its requests checked against ``limits``;
    ``open_connections()`` counts the server's open connections.

    The routes take the raw request (``add_route``, no dependency injection or pydantic
    model): the body is checked by :func:`parse_retrieve_request`, whose 400 and 413 answers
    name the limit and its flag, where a model would answer 422.
    """
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

    async def health(request: Request) -> Response:
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
        # in this loop's thread: the loop is a worker, and the other loops serve meanwhile;
        # a thread pool would cross threads twice a request and queue behind the GIL
        status, content = answer(retriever, limits, body)
        return Response(content, status, media_type="application/json")

    for path in ("/health", "/health/"):
        app.add_route(path, health, methods=["GET"])
    for path in ("/retrieve", "/retrieve/"):
        app.add_route(path, retrieve, methods=["POST"])

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
    An answer the client stops reading is dropped after as long without progress, so it
    holds no memory past that.
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

    def pause_writing(self) -> None:  # the answer fills the buffer: the client must read it
        super().pause_writing()
        self.loop.call_later(self.timeout_keep_alive, self._check_reading,
                             self.transport.get_write_buffer_size())

    def _check_reading(self, unsent: int) -> None:
        if not self.flow.write_paused:  # sent, or the connection is gone
            return
        if self.transport.get_write_buffer_size() >= unsent:  # not a byte read meanwhile
            self.transport.abort()  # close() would wait for the buffer to be sent
            return
        self.loop.call_later(self.timeout_keep_alive, self._check_reading,
                             self.transport.get_write_buffer_size())


class RetrievalServer:
    """A socket bound to the server's address and, once :func:`listen` has run, the event
    loops that serve it: ``--workers`` uvicorn servers sharing the socket.

    ``serve_forever`` runs them, one in the calling thread and the others in threads of
    their own, until ``shutdown`` (called from another thread, or a signal when it runs in
    the main thread); ``server_close`` releases the port.
    """

    def __init__(self, sock: socket.socket, limits: Limits):
        self.socket, self.limits = sock, limits
        self.server_address: tuple[str, int] = sock.getsockname()[:2]
        self.loops: list[uvicorn.Server] = []
        self.serving, self._stopped = False, threading.Event()

    def open_connections(self) -> int:  # over all loops
        return sum(len(loop.server_state.connections) for loop in self.loops)

    def serve_forever(self) -> None:
        if not self.loops:
            raise RuntimeError("listen(server, retriever) first")
        self.serving = True
        # each loop closes its socket when it stops: each gets a copy of the listening one
        threads = [threading.Thread(target=loop.run, kwargs={"sockets": [self.socket.dup()]},
                                    name=f"retriever-worker-{i}", daemon=True)
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
    until ``serve_forever`` accepts them) and build its app and its event loops."""
    limits = server.limits
    server.socket.listen(limits.backlog)
    config = uvicorn.Config(
        make_app(retriever, limits, server.open_connections),
        http=IdleTimeoutProtocol, ws="none", lifespan="off", log_config=None, access_log=False,
        proxy_headers=False, backlog=limits.backlog,
        timeout_keep_alive=limits.idle_timeout_s,  # type: ignore[arg-type]  (a float works)
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,  # type: ignore[arg-type]
        log_level="warning")  # ours says when it serves; uvicorn's warnings stay
    server.loops = [uvicorn.Server(config) for _ in range(limits.workers)]


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
            ("workers", int, "threads, each an event loop that accepts connections and "
                             "reads, searches and answers their requests (a connection "
                             "waiting for its request holds none)"),
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
    log.info("serving %d passages of %s at http://%s:%d/retrieve (index %s, %s; %d workers, "
             "backlog %d, at most %d connections)", len(retriever), args.corpus, host, port,
             retriever.index_dir, "loaded from cache" if retriever.loaded_from_cache else "built",
             server_limits.workers, server_limits.backlog, server_limits.max_connections)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
