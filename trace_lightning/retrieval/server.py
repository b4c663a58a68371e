"""A retrieval service speaking the Search-R1 API, on the standard library's HTTP server.

``POST /retrieve`` with ``{"queries": [...], "topk": k, "return_scores": true}`` answers
``{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}``; with
``"return_scores": false`` each hit is the bare document ``{"id", "contents"}``. ``contents``
is FlashRAG's ``'"' + title + '"\\n' + text``. ``topk`` defaults to 3 and ``return_scores``
to true (Search-R1's defaults). ``GET /health`` answers ``{"status": "ok", "documents": n,
"max_queries": q, "max_query_chars": c, "topk_max": k}``: clients fit their batches to it.

Refusals carry a JSON body ``{"error": "..."}`` that says what was wrong: 400 for a body
that is not JSON or has wrong fields or a ``topk`` out of range, 413 for a request over a
size limit (body bytes, number of queries, query length), 404 for an unknown path, 500 if
retrieval itself fails. The server keeps serving after any of them.

Run it with ``trace-lightning-retriever --corpus PATH --port 8000``. It checks its flags and
binds the port before building the index (a wiki-18 index takes a while), and listens only once
the index is ready: until then connections are refused, which clients retry.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import threading
from collections.abc import Sized
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NoReturn

from trace_lightning.retrieval import Retriever
from trace_lightning.retrieval.bm25 import BM25Retriever

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 60.0


class RequestError(Exception):
    """A refused request: HTTP status and the message for the ``error`` field."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_retrieve_request(body: bytes, max_queries: int, max_query_chars: int,
                           topk_max: int) -> tuple[list[str], int, bool]:
    """Validate a ``/retrieve`` body -> (queries, topk, return_scores); RequestError if bad."""
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, f"body is not JSON ({e}); send "
                                f"{{\"queries\": [str, ...], \"topk\": int}}") from None
    except RecursionError:  # "[[[[...": the parser gives up, the server must not
        raise RequestError(400, "body nests JSON arrays or objects too deeply to parse; send "
                                "{\"queries\": [str, ...], \"topk\": int}") from None
    if not isinstance(payload, dict):
        raise RequestError(400, f"body is a JSON {type(payload).__name__}; send an object "
                                f"{{\"queries\": [str, ...], \"topk\": int}}")
    queries = payload.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise RequestError(400, f"\"queries\" must be a list of strings, got "
                                f"{json.dumps(queries)[:100]}")
    if len(queries) > max_queries:
        raise RequestError(413, f"{len(queries)} queries in one request; this server takes at "
                                f"most {max_queries} (--max-queries): split the batch")
    for i, query in enumerate(queries):
        if len(query) > max_query_chars:
            raise RequestError(413, f"queries[{i}] has {len(query)} characters; this server "
                                    f"takes at most {max_query_chars} (--max-query-chars)")
    topk = payload.get("topk", 3)
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= topk_max:
        raise RequestError(400, f"\"topk\" must be an integer in [1, {topk_max}] "
                                f"(--topk-max), got {json.dumps(topk)[:50]}")
    return_scores = payload.get("return_scores", True)
    if not isinstance(return_scores, bool):
        raise RequestError(400, f"\"return_scores\" must be true or false, got "
                                f"{json.dumps(return_scores)[:50]}")
    return queries, topk, return_scores


def make_handler(retriever: Retriever, max_queries: int, max_query_chars: int, topk_max: int,
                 max_body_bytes: int, n_documents: int | None) -> type[BaseHTTPRequestHandler]:
    """A request handler class bound to one retriever and its limits."""
    limits = {"max_queries": max_queries, "max_query_chars": max_query_chars,
              "topk_max": topk_max}

    class Handler(BaseHTTPRequestHandler):
        server_version = "trace-lightning-retriever"
        # seconds a connection may stall (a client that promised a body and sent less);
        # without it such a client holds its thread forever
        timeout = IDLE_TIMEOUT_S

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") == "/health":
                self._send(200, {"status": "ok", "documents": n_documents, **limits})
            else:
                self._send(404, {"error": f"unknown path {self.path!r}; use POST /retrieve or "
                                          f"GET /health"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path.rstrip("/") != "/retrieve":
                self._send(404, {"error": f"unknown path {self.path!r}; use POST /retrieve"})
                return
            try:
                queries, topk, return_scores = parse_retrieve_request(
                    self._read_body(), max_queries, max_query_chars, topk_max)
            except RequestError as e:
                self._send(e.status, {"error": str(e)})
                return
            try:
                results = retriever.search(queries, topk) if queries else []
            except Exception as e:  # keep serving; the client sees a 500 and may retry
                log.exception("retrieval failed")
                self._send(500, {"error": f"retrieval failed: {type(e).__name__}: {e}"})
                return
            out = []
            for hits in results:
                docs = [{"id": p.id, "contents": p.contents} for p in hits]
                out.append([{"document": d, "score": p.score} for d, p in zip(docs, hits)]
                           if return_scores else docs)
            self._send(200, {"result": out})

        def _read_body(self) -> bytes:
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                raise RequestError(411 if length is None else 400,
                                   f"Content-Length header missing or invalid ({length!r})")
            if int(length) > max_body_bytes:
                # the body stays unread, so this connection cannot be reused
                self.close_connection = True
                raise RequestError(413, f"body of {length} bytes; this server takes at most "
                                        f"{max_body_bytes} (--max-body-bytes)")
            return self.rfile.read(int(length))

        def _send(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # noqa: A002
            log.debug("%s %s", self.address_string(), format % args)

    return Handler


def check_limits(max_queries: int, max_query_chars: int, topk_max: int,
                 max_body_bytes: int) -> None:
    """ValueError naming the flag of a limit below 1."""
    for name, value in (("max_queries", max_queries), ("max_query_chars", max_query_chars),
                        ("topk_max", topk_max), ("max_body_bytes", max_body_bytes)):
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} ({value}) must be >= 1")


def bind(host: str, port: int) -> ThreadingHTTPServer:
    """A server bound to ``host:port`` but not yet listening (connections are refused, so
    clients retry) and without a handler: :func:`listen` gives it both. OSError if a server
    listens on the port already. Binding does not reserve it: with ``SO_REUSEADDR`` (set, so
    a restart reuses the port at once) another socket may still bind it and listen first,
    and then :func:`listen` raises."""
    server = ThreadingHTTPServer((host, port), BaseHTTPRequestHandler, bind_and_activate=False)
    try:
        server.server_bind()
    except BaseException:
        server.server_close()
        raise
    return server


def listen(server: ThreadingHTTPServer, retriever: Retriever, max_queries: int,
           max_query_chars: int, topk_max: int, max_body_bytes: int) -> None:
    """Give a :func:`bind` server its retriever and (checked) limits and start listening."""
    n_documents = len(retriever) if isinstance(retriever, Sized) else None
    server.RequestHandlerClass = make_handler(retriever, max_queries, max_query_chars, topk_max,
                                              max_body_bytes, n_documents)
    server.server_activate()


def make_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 8000,
                max_queries: int = 512, max_query_chars: int = 2000, topk_max: int = 100,
                max_body_bytes: int = 8 << 20) -> ThreadingHTTPServer:
    """A bound and listening (not yet serving) threaded server; ``port=0`` picks a free port."""
    check_limits(max_queries, max_query_chars, topk_max, max_body_bytes)
    server = bind(host, port)
    listen(server, retriever, max_queries, max_query_chars, topk_max, max_body_bytes)
    return server


def serve_in_thread(retriever: Retriever, host: str = "127.0.0.1", port: int = 0,
                    **limits: int) -> tuple[ThreadingHTTPServer, str]:
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
                        help="folder for the cached index (default beside the corpus if "
                             "writable, else ~/.cache/trace-lightning/bm25)")
    parser.add_argument("--k1", type=float, default=0.9, help="BM25 k1")
    parser.add_argument("--b", type=float, default=0.4, help="BM25 b")
    parser.add_argument("--topk-max", type=int, default=100, help="largest topk a request may ask")
    parser.add_argument("--max-queries", type=int, default=512, help="most queries per request")
    parser.add_argument("--max-query-chars", type=int, default=2000,
                        help="longest query, in characters")
    parser.add_argument("--max-body-bytes", type=int, default=8 << 20,
                        help="largest request body, in bytes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    limits = (args.max_queries, args.max_query_chars, args.topk_max, args.max_body_bytes)

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
        check_limits(*limits)
    except ValueError as e:
        fail(str(e))
    try:
        server = bind(args.host, args.port)
    except OSError as e:
        fail(f"cannot listen on {args.host}:{args.port} ({e.strerror or e}); is another server "
             f"on that port? Pick another with --port (0 picks a free one), or check --host")
    try:
        retriever = BM25Retriever(args.corpus, cache_dir=args.cache_dir, k1=args.k1, b=args.b)
    except (ValueError, OSError) as e:  # a bad corpus: not JSON lines, missing, a directory
        server.server_close()
        fail(str(e))
    try:
        listen(server, retriever, *limits)
    except OSError as e:  # another server took the port while the index was built
        server.server_close()
        fail(f"cannot listen on {args.host}:{args.port} ({e.strerror or e}); another server "
             f"started on that port while the index was built (it is cached now, so a restart "
             f"is quick): pick another with --port, or stop the other one")
    host, port = server.server_address[:2]
    log.info("serving %d passages of %s at http://%s:%d/retrieve (index %s, %s)", len(retriever),
             args.corpus, host, port, retriever.index_dir,
             "loaded from cache" if retriever.loaded_from_cache else "built")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
