"""A retrieval service speaking the Search-R1 API, on the standard library's HTTP server.

``POST /retrieve`` with ``{"queries": [...], "topk": k, "return_scores": true}`` answers
``{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}``; with
``"return_scores": false`` each hit is the bare document ``{"id", "contents"}``. ``contents``
is FlashRAG's ``'"' + title + '"\\n' + text``. ``topk`` defaults to 3 and ``return_scores``
to true (Search-R1's defaults). ``GET /health`` answers ``{"status": "ok", "documents": n,
"max_queries": q, "max_query_chars": c, "topk_max": k, "max_body_bytes": b,
"max_response_bytes": r}``: clients fit their batches to it.

Refusals carry a JSON body ``{"error": "..."}`` that names the limit and its flag: 400 for a
body that is not JSON or has a wrong field (a ``topk`` that is not an integer in range: a
float, a bool, an integer of 5,000 digits), 411/400 for a missing or malformed
Content-Length, 413 for a request over a size limit (body bytes, number of queries, query
length) or whose answer would pass ``--max-response-bytes`` (the answer is encoded hit by
hit and dropped as soon as it would, so no request holds more than that), 404 for an unknown
path, 503 when ``--max-connections`` connections are open already, 500 if retrieval itself
fails. The server keeps serving after any of them.

Connections (:class:`RetrievalServer`): the kernel queues up to ``--backlog`` of them before
they are accepted; an accepted one waits in a selector, costing a file descriptor and no
thread, until its request's first bytes arrive (closed if none come within
``--idle-timeout-s``); then one of ``--workers`` threads reads the request, answers it and
closes the connection (HTTP/1.0: one request per connection). So the server runs
``--workers`` + 2 threads however many clients connect, and a worker waits at most
``--idle-timeout-s`` for each read of a stalled request. docs/retrieval_server.md says what
a client can rely on.

Run it with ``trace-lightning-retriever --corpus PATH --port 8000``. It checks its flags and
binds the port before building the index (a wiki-18 index takes a while), and listens only once
the index is ready: until then connections are refused, which clients retry.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import queue
import resource
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Sized
from dataclasses import asdict, dataclass, fields
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import NoReturn

from trace_lightning.tasks.search_qa.retrieval import Passage, Retriever
from trace_lightning.tasks.search_qa.retrieval.bm25 import BM25Retriever, default_cache_dir

log = logging.getLogger(__name__)

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
        workers: threads that read, search and answer requests (one connection each).
        backlog: connections the kernel queues before the server accepts them (capped by
            the system's net.core.somaxconn).
        max_connections: most connections open at once, answering or waiting for their
            request; more are answered 503 at once.
        idle_timeout_s: seconds a connection may stay silent, before its request or while
            sending it, before it is closed.
    """

    max_queries: int = 512
    max_query_chars: int = 2000
    topk_max: int = 100
    max_body_bytes: int = 8 << 20
    max_response_bytes: int = 8 << 20
    workers: int = 32
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


def make_handler(retriever: Retriever, limits: Limits,
                 n_documents: int | None) -> type[BaseHTTPRequestHandler]:
    """A request handler class bound to one retriever and its limits."""

    class Handler(BaseHTTPRequestHandler):
        server_version = "trace-lightning-retriever"
        # seconds each read may wait: a client that promised a body and sent less holds its
        # worker this long, not forever
        timeout = limits.idle_timeout_s
        disable_nagle_algorithm = True  # headers and body leave at once, not after an ACK

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") == "/health":
                self._send(200, {"status": "ok", "documents": n_documents,
                                 **limits.advertised()})
            else:
                self._send(404, {"error": f"unknown path {self.path!r}; use POST /retrieve or "
                                          f"GET /health"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path.rstrip("/") != "/retrieve":
                self._send(404, {"error": f"unknown path {self.path!r}; use POST /retrieve"})
                return
            try:
                queries, topk, return_scores = parse_retrieve_request(self._read_body(), limits)
            except RequestError as e:
                self._send(e.status, {"error": str(e)})
                return
            try:
                results = retriever.search(queries, topk) if queries else []
            except Exception as e:  # keep serving; the client sees a 500 and may retry
                log.exception("retrieval failed")
                self._send(500, {"error": f"retrieval failed: {type(e).__name__}: {e}"})
                return
            try:
                pieces = encode_results(results, return_scores, topk, limits.max_response_bytes)
            except RequestError as e:
                self._send(e.status, {"error": str(e)})
                return
            self._send_pieces(200, pieces)

        def _read_body(self) -> bytes:
            length = self.headers.get("Content-Length")
            if length is None:
                raise RequestError(411, "Content-Length header missing; send the body's length")
            # isdigit alone takes "²", which int() refuses
            if not (length.isascii() and length.isdigit()):
                raise RequestError(400, f"Content-Length header invalid ({length[:50]!r}); "
                                        f"send the body's length in bytes")
            if len(length) > 18 or int(length) > limits.max_body_bytes:
                # the body stays unread, so this connection cannot be reused
                self.close_connection = True
                raise RequestError(413, f"body of {length[:50]} bytes; this server takes at "
                                        f"most {limits.max_body_bytes} (--max-body-bytes)")
            return self.rfile.read(int(length))

        def _send(self, status: int, payload: dict) -> None:
            self._send_pieces(status, [json.dumps(payload).encode()])

        def _send_pieces(self, status: int, pieces: list[bytes]) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(sum(len(p) for p in pieces)))
            self.end_headers()
            for piece in pieces:  # no joined copy: an answer is held once
                self.wfile.write(piece)

        def log_message(self, format: str, *args) -> None:  # noqa: A002
            log.debug("%s %s", self.address_string(), format % args)

    return Handler


class RetrievalServer(HTTPServer):
    """An HTTP server with a listen backlog, a waiting room and a fixed pool of workers.

    ``serve_forever`` accepts connections and hands them to the waiting room, one thread
    that holds them in a selector until their first bytes arrive (or closes them after
    ``idle_timeout_s``), then queues them for the ``workers`` threads. Connections over
    ``max_connections`` are answered 503 at once. :func:`listen` starts the threads;
    ``server_close`` stops them.
    """

    def __init__(self, address: tuple[str, int], limits: Limits):
        self.limits = limits
        self.request_queue_size = limits.backlog  # socketserver's listen() backlog
        super().__init__(address, BaseHTTPRequestHandler, bind_and_activate=False)
        self._arrivals: queue.SimpleQueue = queue.SimpleQueue()  # accepted, for the room
        self._ready: queue.SimpleQueue = queue.SimpleQueue()  # with bytes, for the workers
        self._wake_read, self._wake_write = socket.socketpair()
        self._open, self._open_lock = 0, threading.Lock()
        self._started = False

    def server_activate(self) -> None:
        super().server_activate()
        self._started = True
        threading.Thread(target=self._waiting_room, name="retriever-waiting-room",
                         daemon=True).start()
        for i in range(self.limits.workers):
            threading.Thread(target=self._work, name=f"retriever-worker-{i}",
                             daemon=True).start()

    def process_request(self, request: socket.socket, client_address: tuple) -> None:
        with self._open_lock:
            full = self._open >= self.limits.max_connections
            if not full:
                self._open += 1
        if full:
            self._refuse(request)
            return
        try:  # most clients send at once: their request is here already, or they closed
            request.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:  # nothing yet: the waiting room holds it
            self._arrivals.put((request, client_address))
            self._wake_write.send(b"\0")
            return
        except OSError:
            pass  # reset: a worker finds out and closes it
        self._ready.put((request, client_address))

    def server_close(self) -> None:
        super().server_close()
        if not self._started:  # bound, never listening: no thread to stop
            self._wake_read.close()
            self._wake_write.close()
            return
        self._arrivals.put(None)  # the waiting room closes what it holds, stops the workers
        try:
            self._wake_write.send(b"\0")
        except OSError:
            pass  # closed twice

    def _refuse(self, request: socket.socket) -> None:
        """503 to a connection over ``max_connections``, without reading its request."""
        body = json.dumps({"error": f"{self.limits.max_connections} connections are open, the "
                                    f"most this server takes (--max-connections): retry "
                                    f"later, or raise the server's --max-connections"}).encode()
        try:
            request.settimeout(1.0)
            request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: "
                            b"application/json\r\nContent-Length: %d\r\n\r\n%s"
                            % (len(body), body))
        except OSError:
            pass  # the client left first
        self.shutdown_request(request)

    def _release(self, request: socket.socket) -> None:
        self.shutdown_request(request)
        with self._open_lock:
            self._open -= 1

    def _waiting_room(self) -> None:
        """Hold accepted connections until they are readable, then queue them for a worker;
        close those silent for ``idle_timeout_s``. Ends at ``server_close``."""
        selector = selectors.DefaultSelector()
        selector.register(self._wake_read, selectors.EVENT_READ)
        waiting: OrderedDict[socket.socket, float] = OrderedDict()  # deadlines, in order
        try:
            while True:
                timeout = (max(0.0, next(iter(waiting.values())) - time.monotonic())
                           if waiting else None)
                for key, _ in selector.select(timeout):
                    if key.fileobj is not self._wake_read:
                        selector.unregister(key.fileobj)
                        del waiting[key.fileobj]
                        self._ready.put((key.fileobj, key.data))
                        continue
                    self._wake_read.recv(4096)
                    while not self._arrivals.empty():
                        arrival = self._arrivals.get()
                        if arrival is None:
                            return
                        request, address = arrival
                        selector.register(request, selectors.EVENT_READ, address)
                        waiting[request] = time.monotonic() + self.limits.idle_timeout_s
                now = time.monotonic()
                while waiting and next(iter(waiting.values())) <= now:
                    request, _ = waiting.popitem(last=False)
                    selector.unregister(request)
                    self._release(request)
        finally:
            for request in waiting:
                self._release(request)
            for _ in range(self.limits.workers):  # after every connection queued for them
                self._ready.put(None)
            selector.close()
            self._wake_read.close()
            self._wake_write.close()

    def _work(self) -> None:
        """Answer queued connections, one request each, until ``server_close``."""
        while (item := self._ready.get()) is not None:
            request, address = item
            try:
                self.finish_request(request, address)
            except OSError as e:  # the client left mid-answer
                log.info("connection from %s ended early: %s", address[0], e)
            except Exception:
                log.exception("request from %s failed", address[0])
            finally:
                self._release(request)


def bind(host: str, port: int, limits: Limits) -> RetrievalServer:
    """A server bound to ``host:port`` but not yet listening (connections are refused, so
    clients retry) and without a handler: :func:`listen` gives it both. OSError if a server
    listens on the port already. Binding does not reserve it: with ``SO_REUSEADDR`` (set, so
    a restart reuses the port at once) another socket may still bind it and listen first,
    and then :func:`listen` raises."""
    server = RetrievalServer((host, port), limits)
    try:
        server.server_bind()
    except BaseException:
        server.server_close()
        raise
    return server


def listen(server: RetrievalServer, retriever: Retriever) -> None:
    """Give a :func:`bind` server its retriever, start listening and start its threads."""
    n_documents = len(retriever) if isinstance(retriever, Sized) else None
    server.RequestHandlerClass = make_handler(retriever, server.limits, n_documents)
    server.server_activate()


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
    threading.Thread(target=server.serve_forever, name="retriever-server", daemon=True).start()
    bound_host, bound_port = server.server_address[:2]
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
            ("workers", int, "threads that answer requests (a connection waiting for its "
                             "request holds none)"),
            ("backlog", int, "connections the kernel queues before they are accepted "
                             "(capped by net.core.somaxconn)"),
            ("max_connections", int, "most connections open at once; more are answered 503"),
            ("idle_timeout_s", float, "seconds a connection may stay silent before or while "
                                      "sending its request")):
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
    host, port = server.server_address[:2]
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
