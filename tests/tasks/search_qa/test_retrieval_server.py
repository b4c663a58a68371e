"""The Search-R1 retrieval API over real HTTP on 127.0.0.1: server, client, limits, failures."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from launch import free_port
from trace_lightning.tasks.search_qa.datasets import load_qa
from trace_lightning.tasks.search_qa.retrieval import (BM25Retriever, HTTPRetriever, Passage,
                                                      RetrieverError)
from trace_lightning.tasks.search_qa.retrieval.server import make_server, serve_in_thread
from builders import search_datamodule

LIMITS = {"max_queries": 8, "max_query_chars": 200, "topk_max": 20}


@pytest.fixture(scope="module")
def wiki_retriever(shared_data, tmp_path_factory) -> BM25Retriever:
    return BM25Retriever(str(shared_data / "2wikimultihopqa" / "corpus.jsonl"),
                         cache_dir=str(tmp_path_factory.mktemp("bm25-2wiki")))


@pytest.fixture(scope="module")
def server_url(wiki_retriever):
    server, url = serve_in_thread(wiki_retriever, **LIMITS)
    yield url
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def questions(shared_data) -> list[str]:
    return [e.question for e in load_qa(shared_data / "2wikimultihopqa" / "dev.jsonl", limit=10)]


def post(url: str, body: bytes, path: str = "/retrieve") -> tuple[int, dict]:
    """Raw POST -> (status, parsed JSON body), 4xx/5xx included."""
    request = urllib.request.Request(url + path, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def serve_handler(handler: type[BaseHTTPRequestHandler]):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_client_results_equal_in_process_results(wiki_retriever, server_url, questions):
    client = HTTPRetriever(server_url, batch_size=4)  # 10 queries -> requests of 4, 4, 2
    client.check()
    remote = client.search(questions, 5)
    assert remote == wiki_retriever.search(questions, 5)  # ids, titles, texts and scores
    assert all(len(ps) == 5 and ps[0].score > 0 for ps in remote)
    # a URL ending in /retrieve (Search-R1 configs) is accepted too
    assert HTTPRetriever(server_url + "/retrieve").search(questions[:1], 2) == [remote[0][:2]]
    assert client.search([], 3) == []


def test_response_shapes_with_and_without_scores(wiki_retriever, server_url, questions):
    status, scored = post(server_url, json.dumps(
        {"queries": questions[:2], "topk": 3, "return_scores": True}).encode())
    assert status == 200 and len(scored["result"]) == 2
    hit = scored["result"][0][0]
    assert set(hit) == {"document", "score"} and set(hit["document"]) == {"id", "contents"}
    best = wiki_retriever.search(questions[:1], 1)[0][0]
    assert hit["document"]["contents"] == f'"{best.title}"\n{best.text}'
    assert hit["score"] == pytest.approx(best.score)
    status, bare = post(server_url, json.dumps(
        {"queries": questions[:2], "topk": 3, "return_scores": False}).encode())
    assert status == 200
    assert bare["result"] == [[h["document"] for h in hits] for hits in scored["result"]]
    with urllib.request.urlopen(server_url + "/health", timeout=10) as response:
        assert json.loads(response.read()) == {"status": "ok", "documents": 1294, **LIMITS,
                                               "max_body_bytes": 8 << 20,
                                               "max_response_bytes": 8 << 20}


@pytest.mark.parametrize("body, status, message", [
    (b"{not json", 400, "not JSON"),
    (b"[1, 2]", 400, "JSON list"),
    (json.dumps({"topk": 3}).encode(), 400, '"queries" must be a list of strings'),
    (json.dumps({"queries": "one string"}).encode(), 400, '"queries" must be a list'),
    (json.dumps({"queries": ["q"] * 9}).encode(), 413, "9 queries in one request; this server "
                                                       "takes at most 8"),
    (json.dumps({"queries": ["x" * 201]}).encode(), 413, "201 characters"),
    (json.dumps({"queries": ["q"], "topk": 21}).encode(), 400, "[1, 20]"),
    (json.dumps({"queries": ["q"], "topk": 0}).encode(), 400, "[1, 20]"),
    (json.dumps({"queries": ["q"], "topk": "3"}).encode(), 400, "topk"),
    (json.dumps({"queries": ["q"], "return_scores": "yes"}).encode(), 400, "return_scores"),
    # the parser's recursion limit: a RecursionError, which once dropped the connection
    (b"[" * 100_000 + b"]" * 100_000, 400, "nests JSON arrays or objects too deeply"),
    # an integer of over 4,300 digits: json raised ValueError, which dropped the connection
    (b'{"queries": ["q"], "topk": ' + b"9" * 5001 + b"}", 400, "number too long to read"),
    (b'{"queries": ["q"], "topk": -' + b"9" * 5001 + b"}", 400, "number too long to read"),
    (b'{"queries": ["q"], "topk": ' + b"9" * 4000 + b"}", 400, "[1, 20]"),
    (b'{"queries": ["q"], "topk": 1e400}', 400, "got Infinity"),
    (b'{"queries": ["q"], "topk": NaN}', 400, "got NaN"),
    (b'{"queries": ["q"], "topk": 3.0}', 400, "got 3.0"),
    (b'{"queries": ["q"], "topk": true}', 400, "got true"),
    (b'{"queries": ["q"], "topk": null}', 400, "got null"),
    (b'{"queries": ["q"], "topk": [3]}', 400, "got [3]"),
    (b'{"queries": [1e400]}', 400, '"queries" must be a list of strings'),
    (b'{"queries": ["q"], "return_scores": 1}', 400, "return_scores"),
])
def test_bad_requests_are_refused_and_the_server_keeps_serving(server_url, questions, body,
                                                               status, message):
    got_status, got = post(server_url, body)
    assert got_status == status and message in got["error"]
    ok_status, ok = post(server_url, json.dumps({"queries": questions[:1], "topk": 2}).encode())
    assert ok_status == 200 and len(ok["result"][0]) == 2


def test_unknown_path_is_404_and_a_wrong_method_405(server_url):
    assert post(server_url, b"{}", path="/search")[0] == 404
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(server_url + "/nothing", timeout=10)
    assert info.value.code == 404 and "unknown path" in json.loads(info.value.read())["error"]
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(server_url + "/retrieve", timeout=10)  # GET
    assert info.value.code == 405 and info.value.headers["Allow"] == "POST"
    assert json.loads(info.value.read())["error"] == ("GET '/retrieve' is not served; use POST "
                                                      "/retrieve or GET /health")
    assert post(server_url, b"{}", path="/health") == (405, {
        "error": "POST '/health' is not served; use POST /retrieve or GET /health"})


def test_client_raises_a_4xx_at_once_with_the_servers_message(server_url):
    client = HTTPRetriever(server_url, retries=5, backoff_s=2.0)
    start = time.monotonic()
    with pytest.raises(RetrieverError, match=r"HTTP 400: \"topk\" must be an integer in \[1, 20\]"):
        client.search(["q"], 50)
    assert time.monotonic() - start < 2.0  # not retried: no 2 s backoff was slept


def test_server_that_is_down_fails_after_retries_in_bounded_time():
    url = f"http://127.0.0.1:{free_port()}"
    client = HTTPRetriever(url, timeout_s=1.0, retries=2, backoff_s=0.05, reconnect_wait_s=0)
    start = time.monotonic()
    with pytest.raises(RetrieverError) as info:
        client.search(["who"], 3)
    elapsed = time.monotonic() - start
    # 3 attempts of at most timeout_s each, backoffs 0.05 + 0.1, plus slack for a busy machine
    assert elapsed < 3 * 1.0 + 0.15 + 2.0
    message = str(info.value)
    assert url in message and "3 attempt(s)" in message and "cannot connect" in message
    assert "trace-lightning-retriever --corpus" in message
    assert "--data.task.init_args.retriever_url" in message
    with pytest.raises(RetrieverError, match="3 attempt"):
        client.check()


LEE = {"id": "7", "contents": '"Lee Mantle"\nLee Mantle was a Senator.'}  # a Search-R1 document


def send_json(handler: BaseHTTPRequestHandler, status: int, payload: object) -> None:
    """A stub server's answer: ``payload`` as JSON with ``status``."""
    body = json.dumps(payload).encode()
    handler.send_response(status)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class SlowHandler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        time.sleep(1.5)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_slow_server_times_out():
    server, url = serve_handler(SlowHandler)
    try:
        client = HTTPRetriever(url, timeout_s=0.3, retries=1, backoff_s=0.05)
        start = time.monotonic()
        with pytest.raises(RetrieverError, match=r"2 attempt\(s\).*no answer within "
                                                 r"timeout_s=0.3 s") as info:
            client.search(["who"], 3)
        # a server that answers too slowly is up: the fix is more time, not starting one
        assert "--data.task.init_args.retriever_timeout_s" in str(info.value)
        assert "Is the server running" not in str(info.value)
        assert time.monotonic() - start < 2 * 0.3 + 0.05 + 1.0
    finally:
        server.shutdown()
        server.server_close()


class BareDocumentsHandler(BaseHTTPRequestHandler):
    """A Search-R1-style server: no /health, bare documents, 500 on its first request."""

    calls = 0

    def do_POST(self):  # noqa: N802
        type(self).calls += 1
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if type(self).calls == 1:
            send_json(self, 500, {"error": "index still loading"})
        else:
            send_json(self, 200, {"result": [[LEE] for _ in request["queries"]]})

    def do_GET(self):  # noqa: N802
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_bare_documents_are_accepted_and_5xx_is_retried():
    server, url = serve_handler(BareDocumentsHandler)
    try:
        client = HTTPRetriever(url, retries=2, backoff_s=0.01)
        assert client.search(["who", "what"], 3) == [
            [Passage(id="7", title="Lee Mantle", text="Lee Mantle was a Senator.", score=None)]] * 2
        assert BareDocumentsHandler.calls == 2  # the 500 was retried once
        client.check()  # /health is 404 here: falls back to a one-query retrieve
        assert BareDocumentsHandler.calls == 3
    finally:
        server.shutdown()
        server.server_close()


def test_console_entry_serves_a_corpus(shared_data, tmp_path):
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "trace_lightning.tasks.search_qa.retrieval.server", "--corpus",
         str(shared_data / "2wikimultihopqa" / "corpus.jsonl"), "--port", str(port),
         "--cache-dir", str(tmp_path), "--topk-max", "7"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        client = HTTPRetriever(f"http://127.0.0.1:{port}", timeout_s=2.0, retries=8,
                               backoff_s=0.5)  # up to ~25 s for the process to start
        client.check()
        (hits,) = client.search(["Silas Hardy English cricketer"], 7)
        assert hits[0].title == "Silas Hardy" and len(hits) == 7
        with pytest.raises(RetrieverError, match=r"\[1, 7\]"):
            client.search(["Silas Hardy"], 8)
        # the run's topk is checked before any work: the flag to change is named
        client.check(topk=7)
        with pytest.raises(RetrieverError,
                           match=r"\[1, 7\].*topk 8 \(--data.task.init_args.env.topk\)"):
            client.check(topk=8)
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_environment_cuts_queries_to_what_the_server_takes(server_url):
    from trace_lightning.tasks.search_qa.environment import SearchEnvironment
    from trace_lightning.models import train_tokenizer
    from trace_lightning.tasks.search_qa.tiny_policy import AGENT_TAGS

    tokenizer = train_tokenizer(["who directed the film", " ".join(AGENT_TAGS)], 300,
                                AGENT_TAGS)
    query = "who directed " + "the film " * 30  # 283 characters; this server takes 200
    client = HTTPRetriever(server_url)
    with pytest.raises(RetrieverError, match="HTTP 413"):
        client.search([query], 2)
    env = SearchEnvironment(tokenizer, client, topk=2, use_chat_template=False,
                            max_query_chars=LIMITS["max_query_chars"])
    ((ids, text),) = env.observe([query])
    assert ids and "Doc 1(Title:" in text


def test_datamodule_gives_the_client_its_timeout_and_retries(server_url):

    dm = search_datamodule(train="unused.jsonl", retriever_url=server_url,
                         retriever_timeout_s=42.0, retriever_retries=5)
    client = dm.task._retriever(None)
    assert isinstance(client, HTTPRetriever) and (client.timeout_s, client.retries) == (42.0, 5)


class TrickleHandler(BaseHTTPRequestHandler):
    """Answers 200 at once, then its 40-byte body one byte every 0.2 s (8 s in all)."""

    def do_POST(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", "40")
        self.end_headers()
        try:
            for _ in range(40):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.2)
        except OSError:
            pass  # the client gave up

    def log_message(self, *args):
        pass


def test_a_trickling_answer_is_given_up_at_the_timeout():
    """Each read returns within the socket timeout, so only a deadline over the whole answer
    stops a server that sends one byte at a time."""
    server, url = serve_handler(TrickleHandler)
    try:
        client = HTTPRetriever(url, timeout_s=0.5, retries=0)
        start = time.monotonic()
        with pytest.raises(RetrieverError, match=r"no answer within timeout_s=0.5 s"):
            client.search(["who"], 3)
        assert time.monotonic() - start < 3.0  # the whole body would take 8 s
    finally:
        server.shutdown()
        server.server_close()


class BusyOnceHandler(BaseHTTPRequestHandler):
    """429 (Too Many Requests) on its first request, then an answer."""

    calls = 0

    def do_POST(self):  # noqa: N802
        type(self).calls += 1
        n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["queries"])
        if type(self).calls == 1:
            send_json(self, 429, {"error": "slow down"})
        else:
            send_json(self, 200, {"result": [[LEE]] * n})

    def log_message(self, *args):
        pass


def test_429_is_retried_like_a_5xx():
    server, url = serve_handler(BusyOnceHandler)
    try:
        assert len(HTTPRetriever(url, retries=1, backoff_s=0.01).search(["who"], 1)) == 1
        assert BusyOnceHandler.calls == 2
    finally:
        server.shutdown()
        server.server_close()


def test_check_fits_the_batch_to_the_servers_max_queries(server_url, questions):
    """The server takes 8 queries per request (LIMITS) and says so on /health; a client
    batching 64 would be refused (413) at its first large search, mid-run."""
    client = HTTPRetriever(server_url)
    with pytest.raises(RetrieverError, match="HTTP 413"):
        client.search(questions, 2)  # 10 queries in one request
    client.check(2)
    assert client.batch_size == LIMITS["max_queries"]
    assert len(client.search(questions, 2)) == len(questions)


def test_a_stalled_request_does_not_hold_a_server_thread(wiki_retriever):
    """A client that promises a 100-byte body and sends 10, that connects and sends
    nothing, or that keeps its connection open after an answer, is dropped after the idle
    timeout (here 0.5 s) instead of holding its file descriptor forever."""
    server, url = serve_in_thread(wiki_retriever, idle_timeout_s=0.5, **LIMITS)
    try:
        with socket.create_connection(server.server_address[:2], timeout=10) as s:
            s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"queries\"")
            start = time.monotonic()
            assert s.recv(1024) == b""  # closed by the server, no answer
            assert time.monotonic() - start < 5.0
        with socket.create_connection(server.server_address[:2], timeout=10) as s:
            assert s.recv(1024) == b""  # never sent a byte
        with socket.create_connection(server.server_address[:2], timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 200")  # kept alive, then silent
            start = time.monotonic()
            assert s.recv(1024) == b""
            assert time.monotonic() - start < 5.0
    finally:
        server.shutdown()
        server.server_close()


def test_an_answer_the_client_does_not_read_is_dropped(wiki_retriever, questions):
    """An answer larger than the socket buffers waits in the server's while the client
    reads nothing; after --idle-timeout-s (here 0.5 s) without a byte read it is dropped and
    the connection reset, so a client that stops reading holds no memory."""
    server, url = serve_in_thread(wiki_retriever, idle_timeout_s=0.5,
                                  max_response_bytes=64 << 20)
    body = json.dumps({"queries": [questions[i % 10] for i in range(160)], "topk": 100})
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect
            s.settimeout(10)
            s.connect(server.server_address)
            s.sendall(f"POST /retrieve HTTP/1.0\r\nContent-Length: {len(body)}\r\n\r\n"
                      f"{body}".encode())
            answer = s.recv(4096)
            length = int(re.search(rb"content-length: (\d+)", answer, re.I).group(1))
            # an answer larger than the socket buffers (a few MB here)
            assert answer.startswith(b"HTTP/1.1 200") and length > 10 << 20
            time.sleep(3.0)  # reads nothing: the server gives up after 0.5 s
            try:
                while chunk := s.recv(1 << 20):
                    answer += chunk
            except ConnectionResetError:
                pass
            assert len(answer) < length
        assert len(HTTPRetriever(url).search(questions[:1], 1)[0]) == 1  # still serving
    finally:
        server.shutdown()
        server.server_close()


def test_port_in_use_names_the_flag(shared_data, tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        error = retriever_main_error(["--corpus", str(shared_data / "hotpotqa" / "corpus.jsonl"),
                                      "--cache-dir", str(tmp_path), "--port", str(port)], capsys)
        assert re.match(rf"trace-lightning-retriever: cannot listen on 127.0.0.1:{port}.*--port",
                        error)


def retriever_main_error(argv: list[str], capsys) -> str:
    """Run ``trace-lightning-retriever`` in process; it must exit with status 2 -> stderr."""
    from trace_lightning.tasks.search_qa.retrieval.server import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--topk-max", "0"], "--topk-max (0) must be >= 1"),
    (["--max-body-bytes", "-1"], "--max-body-bytes (-1) must be >= 1"),
    (["--max-response-bytes", "0"], "--max-response-bytes (0) must be >= 1"),
    (["--workers", "0"], "--workers (0) must be >= 1"),
    (["--backlog", "0"], "--backlog (0) must be >= 1"),
    (["--idle-timeout-s", "0"], "--idle-timeout-s (0.0) must be a finite number > 0"),
    (["--idle-timeout-s", "inf"], "--idle-timeout-s (inf) must be a finite number > 0"),
    (["--max-connections", "100000000"], r"--max-connections (100000000) needs 100000064 "
                                         r"file descriptors, and this process may open"),
    (["--k1", "-1"], "--k1 (-1.0) must be a finite number >= 0"),
    (["--k1", "nan"], "--k1 (nan) must be a finite number >= 0"),
    (["--b", "1.5"], "--b (1.5) must be in [0, 1]"),
    (["--port", "70000"], "--port (70000) must be in [0, 65535]"),
])
def test_retriever_flags_are_checked_before_the_corpus_is_read(tmp_path, capsys, flags,
                                                               message):
    """A bad flag fails at once, not after building the index (long on wiki-18): with a
    corpus that does not exist, the error is still the flag's."""
    error = retriever_main_error(["--corpus", str(tmp_path / "nope.jsonl"), "--port", "0",
                                  *flags], capsys)
    assert error.startswith(f"trace-lightning-retriever: {message}")


def test_a_taken_port_is_named_before_the_corpus_is_read(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        error = retriever_main_error(["--corpus", str(tmp_path / "nope.jsonl"),
                                      "--port", str(port)], capsys)
    assert error.startswith(f"trace-lightning-retriever: cannot listen on 127.0.0.1:{port}")


def test_a_port_taken_while_the_index_is_built_is_one_line(tmp_path, capsys, monkeypatch):
    """Binding does not reserve the port (SO_REUSEADDR): a server that starts listening on it
    while our index is built makes our listen fail; that is a message, not a traceback."""
    from trace_lightning.tasks.search_qa.retrieval import server as server_module

    (tmp_path / "c.jsonl").write_text('{"id": "1", "title": "A", "text": "alpha beta"}\n')
    port = free_port()
    other = socket.socket()
    real = server_module.BM25Retriever

    def build_while_another_starts(*args, **kwargs):
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", port))
        other.listen()
        return real(*args, **kwargs)

    monkeypatch.setattr(server_module, "BM25Retriever", build_while_another_starts)
    try:
        error = retriever_main_error(["--corpus", str(tmp_path / "c.jsonl"), "--port", str(port),
                                      "--cache-dir", str(tmp_path / "cache")], capsys)
    finally:
        other.close()
    assert error.startswith(f"trace-lightning-retriever: cannot listen on 127.0.0.1:{port}")
    assert "another server started on that port while the index was built" in error


@pytest.mark.parametrize("corpus, message", [
    ("bad.jsonl", r"corpus .*bad\.jsonl line 2 is not JSON"),
    ("nope.jsonl", r"corpus .*nope\.jsonl does not exist"),
    (".", r"corpus .* is a directory, not a file"),
])
def test_a_bad_corpus_is_one_line_and_frees_the_port(tmp_path, capsys, corpus, message):
    """No traceback: the message names the file and why; the port bound before the index was
    built is released."""
    (tmp_path / "bad.jsonl").write_text('{"id": "1", "title": "A", "text": "alpha"}\nnot json\n')
    port = free_port()
    error = retriever_main_error(["--corpus", str(tmp_path / corpus), "--port", str(port),
                                  "--cache-dir", str(tmp_path / "cache")], capsys)
    assert re.match(f"trace-lightning-retriever: {message}", error)
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))


def serve_answer(status: int, payload: object):
    """A stub server answering every request with ``status`` and ``payload`` as JSON."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.do_GET()

        def do_GET(self):  # noqa: N802
            send_json(self, status, payload)

        def log_message(self, *args):
            pass

    return serve_handler(Handler)


def test_a_5xx_points_at_the_servers_log_not_at_starting_it():
    server, url = serve_answer(500, {"error": "retrieval failed: MemoryError: " + "x" * 500})
    try:
        client = HTTPRetriever(url, retries=1, backoff_s=0.01)
        with pytest.raises(RetrieverError) as info:
            client.search(["who"], 3)
        message = str(info.value)
        assert "2 attempt(s)" in message and "HTTP 500: retrieval failed: MemoryError" in message
        assert "see its log" in message and "Is the server running" not in message
        assert "x" * 200 not in message  # the body's first 200 characters only
    finally:
        server.shutdown()
        server.server_close()


def test_a_wrong_path_names_the_url_flag_not_topk(server_url):
    """A 404 (e.g. a URL with an extra path) is not about topk: it names
    --data.task.init_args.retriever_url."""
    client = HTTPRetriever(server_url + "/api")
    with pytest.raises(RetrieverError, match=r"HTTP 404.*Search-R1 retriever.*check "
                                             r"--data.task.init_args.retriever_url"):
        client.search(["who"], 3)
    with pytest.raises(RetrieverError) as info:
        client.check(3)
    assert "--data.task.init_args.retriever_url" in str(info.value)
    assert "--data.task.init_args.env.topk" not in str(info.value)
    server, url = serve_answer(405, {"error": "method not allowed"})
    try:
        with pytest.raises(RetrieverError, match=r"HTTP 405.*--data.task.init_args.retriever_url"):
            HTTPRetriever(url).search(["who"], 3)
    finally:
        server.shutdown()
        server.server_close()


def test_a_score_that_is_not_a_number_is_named():
    server, url = serve_answer(200, {"result": [[{"document": LEE, "score": "high"}]]})
    try:
        with pytest.raises(RetrieverError, match=rf"retriever {url}/retrieve result\[0\]\[0\] "
                                                 r"has a \"score\" that is not a number "
                                                 r"\('high'\)"):
            HTTPRetriever(url).search(["who"], 3)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0])
def test_a_timeout_that_is_not_a_finite_positive_number_names_the_flag(value):
    with pytest.raises(ValueError, match=rf"timeout_s "
                                         rf"\(--data.task.init_args.retriever_timeout_s\) "
                                         rf"is {value}; it must be a finite number"):
        HTTPRetriever("http://127.0.0.1:1", timeout_s=value)
    with pytest.raises(ValueError, match=r"reconnect_wait_s "
                                         r"\(--data.task.init_args.retriever_reconnect_wait_s"
                                         r"\) is nan"):
        HTTPRetriever("http://127.0.0.1:1", reconnect_wait_s=float("nan"))


def test_search_waits_for_a_restarting_server(wiki_retriever, caplog):
    """A retriever restarted mid-training refuses connections for a while: search retries
    past ``retries`` (here 0) for up to reconnect_wait_s, warning each time, and gets the
    answer once the server is back."""
    port = free_port()
    started = []
    timer = threading.Timer(1.0, lambda: started.append(
        serve_in_thread(wiki_retriever, port=port, **LIMITS)[0]))
    timer.start()
    try:
        client = HTTPRetriever(f"http://127.0.0.1:{port}", retries=0, backoff_s=0.05,
                               reconnect_wait_s=20)
        start = time.monotonic()
        (hits,) = client.search(["Silas Hardy English cricketer"], 2)
        assert hits[0].title == "Silas Hardy" and time.monotonic() - start >= 0.9
        retries = [r for r in caplog.records if r.levelname == "WARNING"]
        assert retries and "Connection refused" in retries[0].getMessage()
        assert "retrying in" in retries[0].getMessage()
    finally:
        timer.join()
        for server in started:
            server.shutdown()
            server.server_close()


def test_a_server_that_stays_down_is_given_up_after_reconnect_wait_s():
    client = HTTPRetriever(f"http://127.0.0.1:{free_port()}", retries=0, backoff_s=0.05,
                           reconnect_wait_s=1.0)
    start = time.monotonic()
    with pytest.raises(RetrieverError, match=r"reconnect_wait_s=1.0\); last failure: cannot "
                                             r"connect.*Is the server running"):
        client.search(["who"], 3)
    assert 0.5 < time.monotonic() - start < 3.0


def test_a_long_reconnect_wait_backs_off_without_overflow(monkeypatch):
    """Two hours of refused connections on a fake clock: over 1,400 tries at the 5 s cap
    (2 ** 1024 overflowed a float after about 1,000), then the error, not an OverflowError."""
    from trace_lightning.tasks.search_qa.retrieval import client as client_module

    clock = [0.0]
    monkeypatch.setattr(client_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(client_module.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    client = HTTPRetriever(f"http://127.0.0.1:{free_port()}", retries=0, reconnect_wait_s=7200)
    with pytest.raises(RetrieverError, match=r"reconnect_wait_s=7200"):
        client.search(["who"], 3)
    assert 7190 < clock[0] <= 7200


class DropsFirstHandler(BaseHTTPRequestHandler):
    """Closes its first connection without an answer (a server going down), then answers."""

    calls = 0

    def do_POST(self):  # noqa: N802
        type(self).calls += 1
        n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["queries"])
        if type(self).calls == 1:
            self.close_connection = True
            return
        send_json(self, 200, {"result": [[LEE]] * n})

    def log_message(self, *args):
        pass


def test_a_dropped_connection_is_retried_past_retries():
    server, url = serve_handler(DropsFirstHandler)
    try:
        client = HTTPRetriever(url, retries=0, backoff_s=0.01, reconnect_wait_s=5)
        assert len(client.search(["who"], 1)) == 1 and DropsFirstHandler.calls == 2
    finally:
        server.shutdown()
        server.server_close()


def test_check_refuses_a_server_that_takes_shorter_queries_than_the_run(server_url):
    """The server takes queries of 200 characters (LIMITS) and says so on /health; a run
    cutting queries at 2000 would pass a one-query check and meet HTTP 413 mid-run."""
    client = HTTPRetriever(server_url)
    with pytest.raises(RetrieverError) as info:
        client.check(2, max_query_chars=2000)
    message = str(info.value)
    assert "at most 200 characters (its --max-query-chars)" in message
    assert "up to 2000 (--data.task.init_args.env.max_query_chars)" in message
    assert ("lower --data.task.init_args.env.max_query_chars to 200, or raise the server's "
            "--max-query-chars to 2000") in message
    client.check(2, max_query_chars=200)  # the server's own limit fits
    client.check(2)  # None: not checked


def test_check_says_topk_must_be_at_least_1_not_to_lower_it(server_url):
    client = HTTPRetriever(server_url)
    with pytest.raises(ValueError, match=r"^--data.task.init_args.env.topk \(0\) must be >= 1$"):
        client.check(0)
    with pytest.raises(ValueError,
                       match=r"^--data.task.init_args.env.max_query_chars \(0\) must be >= 1$"):
        client.check(3, max_query_chars=0)


def test_a_server_that_ignores_topk_is_refused():
    """A server answering 5 passages for topk 3 would silently change the observations."""
    server, url = serve_answer(200, {"result": [[{"document": LEE, "score": 1.0}] * 5]})
    try:
        client = HTTPRetriever(url)
        with pytest.raises(RetrieverError, match=rf"^retriever {url}/retrieve answered 5 "
                                                 rf"passages in result\[0\] for topk 3: the "
                                                 rf"server ignores topk"):
            client.search(["who"], 3)
        with pytest.raises(RetrieverError, match="the server ignores topk"):
            client.check(3)
        assert len(client.search(["who"], 5)[0]) == 5  # as many as asked is fine
    finally:
        server.shutdown()
        server.server_close()


def raw_request(address: tuple[str, int], request: bytes) -> tuple[int, bytes]:
    """Send ``request`` bytes on a fresh connection -> (status, body); the server closes it."""
    with socket.create_connection(address, timeout=10) as s:
        s.sendall(request)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.mark.parametrize("length, status, message", [
    # a length uvicorn's HTTP parser refuses, before the app: its 400, in text
    ("\u00b2", 400, "Invalid HTTP request"),  # "²".isdigit(), but int("²") fails
    ("-5", 400, "Invalid HTTP request"),
    ("1" + "0" * 30, 400, "Invalid HTTP request"),  # over 2 ** 64
    ("9" * 5001, 400, "Invalid HTTP request"),
    # a length the server checks: JSON naming the limit
    (str((8 << 20) + 1), 413, "body of 8388609 bytes; this server takes at most 8388608 "
                              "(--max-body-bytes)"),
    (None, 411, "Content-Length header missing"),
])
def test_a_bad_content_length_is_a_4xx(server_url, questions, length, status, message):
    host, port = urllib.parse.urlsplit(server_url).netloc.split(":")
    request = b"POST /retrieve HTTP/1.0\r\n" + (
        b"\r\n" if length is None  # no body either: bytes after the headers are a new request
        else b"Content-Length: " + length.encode("latin-1") + b"\r\n\r\n{}")
    got, body = raw_request((host, int(port)), request)
    assert got == status
    assert message in (body.decode() if status == 400 else json.loads(body)["error"])
    ok_status, ok = post(server_url, json.dumps({"queries": questions[:1], "topk": 2}).encode())
    assert ok_status == 200 and len(ok["result"][0]) == 2


def test_an_answer_over_max_response_bytes_is_413(wiki_retriever, questions):
    """The answer is JSON encoded hit by hit; one of exactly --max-response-bytes is sent,
    one byte more is refused, naming the flag and the fix, and the server keeps serving."""
    request = json.dumps({"queries": questions[:3], "topk": 4}).encode()
    hits = wiki_retriever.search(questions[:3], 4)
    expected = json.dumps({"result": [[{"document": {"id": p.id, "contents": p.contents},
                                        "score": p.score} for p in ps] for ps in hits]}).encode()
    for max_response_bytes, status in ((len(expected), 200), (len(expected) - 1, 413)):
        server, url = serve_in_thread(wiki_retriever, max_response_bytes=max_response_bytes)
        try:
            got, body = raw_request(server.server_address[:2], (
                f"POST /retrieve HTTP/1.0\r\nContent-Length: {len(request)}\r\n\r\n"
                ).encode() + request)
            assert got == status
            if status == 200:
                assert body == expected  # byte for byte json.dumps's answer
            else:
                assert json.loads(body)["error"] == (
                    f"the answer to 3 queries with topk 4 is over {max_response_bytes} bytes, "
                    f"the most this server sends (--max-response-bytes): send fewer queries "
                    f"per request or a smaller topk, or raise the server's --max-response-bytes")
                assert len(HTTPRetriever(url).search(questions[:1], 1)[0]) == 1
            with urllib.request.urlopen(url + "/health", timeout=10) as response:
                assert json.loads(response.read())["max_response_bytes"] == max_response_bytes
        finally:
            server.shutdown()
            server.server_close()


def test_many_connections_at_once_are_all_answered(wiki_retriever, questions):
    """100 clients connect at once, before the server accepts any: the listen backlog
    (5 before) holds them all, so none is dropped or waits out a SYN retransmit, and a
    fixed pool of workers answers every one correctly."""
    server = make_server(wiki_retriever, port=0)
    sockets, serving = [], threading.Thread(target=server.serve_forever, daemon=True)
    try:
        for _ in range(100):  # a backlog of 5 left the 7th connect hanging until timeout
            sockets.append(socket.create_connection(server.server_address[:2], timeout=5))
        for i, s in enumerate(sockets):
            body = json.dumps({"queries": [questions[i % len(questions)]], "topk": 2}).encode()
            s.sendall(f"POST /retrieve HTTP/1.0\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                      + body)
        serving.start()
        expected = wiki_retriever.search(questions, 2)
        for i, s in enumerate(sockets):
            s.settimeout(10)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.split()[1] == b"200"
            ids = [hit["document"]["id"] for hit in json.loads(body)["result"][0]]
            assert ids == [p.id for p in expected[i % len(questions)]]
    finally:
        for s in sockets:
            s.close()
        if serving.is_alive():  # shutdown() waits for a serve_forever that never began
            server.shutdown()
        server.server_close()


def test_idle_connections_hold_no_thread_and_do_not_delay_requests(wiki_retriever, questions):
    """100 connections that send nothing (a thread each would be 100 threads) cost no
    thread: the server runs its --workers threads (here 2), each an event loop, and a real
    request is answered while they wait."""
    before = set(threading.enumerate())
    server, url = serve_in_thread(wiki_retriever, workers=2)
    idle = []
    try:
        for _ in range(100):
            idle.append(socket.create_connection(server.server_address[:2], timeout=5))
        # connections are accepted in order, so this answer comes after all 100 were
        (hits,) = HTTPRetriever(url, timeout_s=10, retries=0).search(questions[:1], 2)
        assert len(hits) == 2
        started = set(threading.enumerate()) - before
        assert len(started) == 2
    finally:
        for s in idle:
            s.close()
        server.shutdown()
        server.server_close()


def test_connections_over_max_connections_are_answered_503(wiki_retriever, questions):
    server, url = serve_in_thread(wiki_retriever, max_connections=3, workers=1)
    idle = []
    try:
        for _ in range(3):
            idle.append(socket.create_connection(server.server_address[:2], timeout=5))
        status, body = raw_request(server.server_address[:2], b"GET /health HTTP/1.0\r\n\r\n")
        assert status == 503
        assert json.loads(body)["error"] == (
            "3 connections are open, the most this server takes (--max-connections): retry "
            "later, or raise the server's --max-connections")
        for s in idle:
            s.close()
        # the client retries a 503 until the closed connections are released
        client = HTTPRetriever(url, retries=10, backoff_s=0.05)
        assert len(client.search(questions[:1], 2)[0]) == 2
    finally:
        for s in idle:
            s.close()
        server.shutdown()
        server.server_close()


def test_help_documents_every_limit(capsys):
    from trace_lightning.tasks.search_qa.retrieval.server import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in ("--workers", "--backlog", "--max-connections", "--idle-timeout-s",
                 "--max-response-bytes", "--max-body-bytes", "--topk-max", "--cache-dir"):
        assert name in text
    assert "(default 8)" in text and "(default 1024)" in text  # workers, backlog
    assert "$XDG_CACHE_HOME/trace-lightning/bm25" in text
