"""Client of the Search-R1 retrieval API (``POST /retrieve``), standard library only.

Request: ``{"queries": [...], "topk": k, "return_scores": true}``. Accepted answers:
``{"result": [[{"document": {...}, "score": s}, ...], ...]}`` and the bare form
``{"result": [[{...}, ...], ...]}`` (score None), where a document is ``{"id", "contents"}``
(FlashRAG) or ``{"id", "title", "text"}``.

Failures: connection errors, timeouts, 5xx answers and the temporary 4xx ones (408, 429)
are retried ``retries`` times with exponential backoff (``backoff_s``, doubled each time, at
most ``MAX_BACKOFF_S``), each retry logged as a warning, then raise :class:`RetrieverError`
with advice that fits the last failure; any other 4xx answer is the caller's fault and raises
at once with the server's message. In ``search``, a refused or reset connection (a server
restarting mid-training) is retried further, until ``reconnect_wait_s`` seconds have passed
since the request began; ``check`` does not wait for it. An attempt is given up once
``timeout_s`` has passed and the answer is not complete (checked between reads, each of which
waits at most ``timeout_s``, so a server that trickles its answer cannot hold a call), so one
request takes at most about ``max((retries + 1) * 2 * timeout_s + sum(backoffs),
reconnect_wait_s + 2 * timeout_s)`` seconds.

``check`` reads the limits a ``trace-lightning-retriever`` announces on ``/health``: it
shrinks ``batch_size`` to the server's ``max_queries`` and refuses a ``max_query_chars`` above
the server's. A server that answers more passages than ``topk`` is refused (it ignores topk).
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import time
import urllib.error
import urllib.parse
import urllib.request

from trace_lightning.tasks.search_qa.retrieval import Passage

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 5.0
RETRIED_4XX = (408, 429)  # Request Timeout, Too Many Requests: try again later
_FIX = ("start one with `trace-lightning-retriever --corpus PATH --port PORT`, or set "
        "`--data.task.init_args.retriever_url` to a running server")


class RetrieverError(RuntimeError):
    """The retrieval service failed or refused; ``status`` is the HTTP status if one came."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class _Transient(Exception):
    """A failed attempt worth retrying. ``kind`` picks the retry policy and the advice:
    "timeout", "reconnect" (connection refused or reset: the server may be restarting),
    "connect" (any other connection error), "busy" (HTTP 408, 429) or "server" (5xx)."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def _server_message(body: bytes) -> str:
    """The ``error`` field of a JSON error body, else the body's first 300 characters."""
    text = body.decode("utf-8", errors="replace")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text[:300]
    return str(data.get("error", data)) if isinstance(data, dict) else text[:300]


def _read_by(response: http.client.HTTPResponse, deadline: float) -> bytes:
    """The response body, or TimeoutError once ``time.monotonic()`` passes ``deadline``."""
    parts = []
    while chunk := response.read1(1 << 16):  # what has arrived, at most one socket read
        parts.append(chunk)
        if time.monotonic() > deadline:
            raise TimeoutError("answer not complete by the deadline")
    return b"".join(parts)


class HTTPRetriever:
    """Search over HTTP against a Search-R1-style retrieval server.

    Args:
        url: server address, e.g. http://127.0.0.1:8000 (a trailing /retrieve is accepted).
        timeout_s: seconds to wait for one request (connect and answer).
        retries: extra attempts after a connection error, timeout or 5xx answer.
        backoff_s: sleep before the first retry; doubled per retry, capped at 5 s.
        batch_size: most queries per request; longer query lists are split.
        reconnect_wait_s: while the server refuses or drops connections (a restart), keep
            retrying until this many seconds have passed since the request began.
    """

    def __init__(self, url: str, timeout_s: float = 10.0, retries: int = 2,
                 backoff_s: float = 0.2, batch_size: int = 64, reconnect_wait_s: float = 30.0):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"retriever url (--data.task.init_args.retriever_url) {url!r} is "
                             f"not an http(s) address; give the server's, e.g. "
                             f"http://127.0.0.1:8000 (`trace-lightning-retriever`)")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"retriever timeout_s (--data.task.init_args.retriever_timeout_s) is "
                             f"{timeout_s}; it must be a finite number of seconds > 0, e.g. 10")
        if retries < 0:
            raise ValueError(f"retriever retries (--data.task.init_args.retriever_retries) is "
                             f"{retries}; it must be >= 0 (0: no retry), e.g. 2")
        for name, value in (("backoff_s", backoff_s),
                            ("reconnect_wait_s (--data.task.init_args.retriever_reconnect_wait_s)",
                             reconnect_wait_s)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"retriever {name} is {value}; it must be a finite number "
                                 f"of seconds >= 0")
        if batch_size < 1:
            raise ValueError(f"HTTPRetriever batch_size is {batch_size}; it must be >= 1")
        base = url.rstrip("/")
        if base.endswith("/retrieve"):
            base = base[: -len("/retrieve")]
        self.url = base
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.batch_size, self.reconnect_wait_s = batch_size, reconnect_wait_s

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
        """Top ``topk`` passages per query, best first, in ``batch_size`` requests."""
        if isinstance(queries, str) or not all(isinstance(q, str) for q in queries):
            raise TypeError(f"search expects a list of query strings, got {queries!r:.200}")
        results: list[list[Passage]] = []
        for start in range(0, len(queries), self.batch_size):
            chunk = list(queries[start:start + self.batch_size])
            data = self._request("/retrieve", {"queries": chunk, "topk": topk,
                                               "return_scores": True}, self.reconnect_wait_s)
            results.extend(self._parse(data, len(chunk), topk))
        return results

    def check(self, topk: int = 1, *, max_query_chars: int | None = None) -> None:
        """Fail fast: raise RetrieverError unless the server answers ``/health`` and a
        one-query search for ``topk`` passages (the run's ``--data.task.init_args.env.topk``: a
        server may refuse more, e.g. ``trace-lightning-retriever --topk-max``), and unless it
        takes queries of ``max_query_chars`` characters (the run's
        ``--data.task.init_args.env.max_query_chars``; None: not checked) where ``/health`` says
        how long a query it takes.

        A server without ``/health`` (404, e.g. Search-R1's own) is checked by the search
        alone. A refused connection is not waited for (``reconnect_wait_s``): nothing is lost
        by failing before the run starts. ValueError for a ``topk`` or ``max_query_chars``
        below 1, before the server is asked.
        """
        for flag, value in (("topk", topk), ("max_query_chars", max_query_chars)):
            if value is not None and value < 1:
                raise ValueError(f"--data.task.init_args.env.{flag} ({value}) must be >= 1")
        try:
            health = self._request("/health", None, 0.0)
        except RetrieverError as e:
            if e.status != 404:
                raise
            health = None
        limits = health if isinstance(health, dict) else {}
        most = limits.get("max_queries")
        if isinstance(most, int) and 1 <= most < self.batch_size:
            log.info("retriever %s takes at most %d queries per request: sending batches of "
                     "%d instead of %d", self.url, most, most, self.batch_size)
            self.batch_size = most
        longest = limits.get("max_query_chars")
        if isinstance(longest, int) and max_query_chars is not None and longest < max_query_chars:
            raise RetrieverError(f"retriever {self.url} takes queries of at most {longest} "
                                 f"characters (its --max-query-chars), but the run sends up to "
                                 f"{max_query_chars} (--data.task.init_args.env.max_query_chars); "
                                 f"the first longer query would be refused (HTTP 413) mid-run: "
                                 f"lower --data.task.init_args.env.max_query_chars to {longest}, "
                                 f"or raise the server's --max-query-chars to {max_query_chars}")
        try:
            self._parse(self._request("/retrieve", {"queries": ["test"], "topk": topk,
                                                    "return_scores": True}, 0.0), 1, topk)
        except RetrieverError as e:
            if e.status not in (400, 413):  # a refusal that may be about topk
                raise
            raise RetrieverError(f"{e}; the run searches with topk {topk} "
                                 f"(--data.task.init_args.env.topk): lower it, or raise the "
                                 f"server's limit",
                                 status=e.status) from None

    # -- internals ------------------------------------------------------------------------

    def _request(self, path: str, payload: dict | None, reconnect_wait_s: float) -> object:
        """GET (payload None) or POST JSON; retries transient failures, and refused or reset
        connections until ``reconnect_wait_s`` has passed; returns parsed JSON."""
        url = self.url + path
        data = None if payload is None else json.dumps(payload).encode()
        start, attempts = time.monotonic(), 0
        while True:
            attempts += 1
            try:
                return self._attempt(url, data)
            except _Transient as e:
                failure = e
            # the exponent capped: 2.0 ** 1024 overflows a float after ~1,000 reconnect tries
            delay = min(self.backoff_s * 2.0 ** min(attempts - 1, 32), MAX_BACKOFF_S)
            if attempts > self.retries:
                if failure.kind != "reconnect":
                    break
                delay = max(delay, 0.1)  # backoff_s=0 must not spin for reconnect_wait_s
                if time.monotonic() - start + delay > reconnect_wait_s:
                    break
            log.warning("retriever %s: %s; retrying in %.2f s (attempt %d)", url, failure,
                        delay, attempts + 1)
            time.sleep(delay)
        if failure.kind == "timeout":
            fix = (f"If the server is busy (a large index, a batch of {self.batch_size} "
                   f"queries), allow it more: timeout_s "
                   f"(--data.task.init_args.retriever_timeout_s) or retries "
                   f"(--data.task.init_args.retriever_retries)")
        elif failure.kind == "busy":
            fix = ("The server is overloaded: allow it more retries "
                   "(--data.task.init_args.retriever_retries) or give it fewer clients")
        elif failure.kind == "server":
            fix = "The server (or a proxy before it) answered but failed: see its log for the cause"
        else:
            fix = f"Is the server running? {_FIX}"
        raise RetrieverError(f"retriever {url} failed after {attempts} attempt(s) "
                             f"(timeout_s={self.timeout_s}, retries={self.retries}, "
                             f"reconnect_wait_s={reconnect_wait_s}); last failure: {failure}. "
                             f"{fix}")

    def _attempt(self, url: str, data: bytes | None) -> object:
        """One request -> parsed JSON; _Transient for a failure worth retrying, RetrieverError
        for a refusal (4xx other than 408/429) or a body that is not JSON."""
        request = urllib.request.Request(
            url, data=data, method="GET" if data is None else "POST",
            headers={"Content-Type": "application/json", "Accept": "application/json"})
        deadline = time.monotonic() + self.timeout_s
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = _read_by(response, deadline)
        except urllib.error.HTTPError as e:
            try:
                message = _server_message(e.read())
            except (OSError, http.client.HTTPException) as read_error:
                message = f"(its body could not be read: {read_error})"
            if e.code in RETRIED_4XX:
                raise _Transient(f"HTTP {e.code}: {message}", "busy") from None
            if 400 <= e.code < 500:
                hint = (f"; is {self.url} a Search-R1 retriever (POST /retrieve)? check "
                        f"--data.task.init_args.retriever_url" if e.code in (404, 405) else "")
                raise RetrieverError(f"retriever {url} refused the request with HTTP "
                                     f"{e.code}: {message}{hint}", status=e.code) from None
            raise _Transient(f"HTTP {e.code}: {message[:200]}", "server") from None
        except TimeoutError:
            raise _Transient(f"no answer within timeout_s={self.timeout_s} s", "timeout") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise _Transient(f"no answer within timeout_s={self.timeout_s} s",
                                 "timeout") from None
            kind = "reconnect" if isinstance(e.reason, ConnectionError) else "connect"
            raise _Transient(f"cannot connect ({e.reason})", kind) from None
        except (OSError, http.client.HTTPException) as e:
            kind = "reconnect" if isinstance(e, ConnectionError) else "connect"
            raise _Transient(f"connection failed ({type(e).__name__}: {e})", kind) from None
        try:
            return json.loads(body)
        except json.JSONDecodeError as e:
            raise RetrieverError(f"retriever {url} answered with a body that is not JSON "
                                 f"({e}): {body[:200]!r}; is {self.url} a retrieval "
                                 f"server?") from None

    def _parse(self, data: object, n_queries: int, topk: int) -> list[list[Passage]]:
        """``{"result": [[{"document": doc, "score": s} | doc, ...], ...]}`` -> passages, at
        most ``topk`` per query."""
        result = data.get("result") if isinstance(data, dict) else None
        if not isinstance(result, list) or len(result) != n_queries:
            raise RetrieverError(f"retriever {self.url}/retrieve answered {str(data)[:200]!r}; "
                                 f"expected {{\"result\": [...]}} with one list per query "
                                 f"({n_queries})")
        out = []
        for i, hits in enumerate(result):
            if not isinstance(hits, list):
                raise RetrieverError(f"retriever {self.url}/retrieve: result[{i}] is not a "
                                     f"list ({str(hits)[:200]!r})")
            if len(hits) > topk:
                raise RetrieverError(f"retriever {self.url}/retrieve answered {len(hits)} "
                                     f"passages in result[{i}] for topk {topk}: the server "
                                     f"ignores topk, and the observations would change; use a "
                                     f"server that honours it (`trace-lightning-retriever`)")
            passages = []
            for j, hit in enumerate(hits):
                where = f"retriever {self.url}/retrieve result[{i}][{j}]"
                scored = isinstance(hit, dict) and isinstance(hit.get("document"), dict)
                score = hit.get("score") if scored else None
                try:
                    score = None if score is None else float(score)
                except (ValueError, TypeError):
                    raise RetrieverError(f"{where} has a \"score\" that is not a number "
                                         f"({str(score)[:50]!r}); a scored hit is "
                                         f"{{\"document\": {{...}}, \"score\": float}}") from None
                try:
                    passages.append(Passage.from_record(hit["document"] if scored else hit, where,
                                                        score))
                except (ValueError, TypeError) as e:
                    raise RetrieverError(str(e)) from None
            out.append(passages)
        return out
