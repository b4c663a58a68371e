"""Retrieval benchmark: BM25 recall and queries per second, or the server under load.

Recall (the default): query = the question; hit@k = any supporting title among the top k
passages, on HotpotQA and 2Wiki dev. Throughput is measured for the in-process index (one
batched call over all questions) and for the HTTP server on 127.0.0.1 through the client
(requests of ``--batch-size`` queries). Prints a table, then one JSON line with every figure.

    python benchmarks/retrieval.py [--data ../shared/data] [--limit 500]

Load (``--clients N``): starts ``trace-lightning-retriever`` in its own process on
``--dataset``'s corpus (HotpotQA's 13,182 passages by default) at 127.0.0.1 with its default
limits, then N client processes (as separate as trainer ranks) each send one request at a
time (``--queries-per-request`` dev questions, ``--topk``, a new connection per request, as
the trainer's client does) for ``--duration-s`` seconds or ``--max-requests`` requests in
all, whichever ends first. An error is any answer other than a 200 with one result list per
query, or a failed connection; nothing is retried. Reported: requests/s, p50/p99 latency of
the answered requests, errors by kind, the server's RSS idle before (after a warm-up of 2N
requests), at peak (sampled every 50 ms) and idle 2 s after, and the connections the kernel
dropped for a full listen backlog meanwhile (TcpExt ListenOverflows: any server's on the
machine). Targets (issue 28): 0 errors, p99 <= 10 x p50, and the RSS after within 5% of the
RSS before. The JSON line also goes to ``--out`` (default docs/results/retrieval.json).

    python benchmarks/retrieval.py --clients 64 --duration-s 20   # ~40 s with the start

``--server-from DIR`` runs the server from another checkout of this repository (e.g. ``git
worktree add /tmp/before HEAD~1``), so two servers are compared under the same load; the line
records whose code served (``server_from``, and ``server_commit`` in every line).

``--quick`` (a test runs it): recall over the first 50 questions per dataset, or with
``--clients`` at most 3 s of load; its line goes to ``--out`` only.

On a small machine the clients share the cores with the server: the latencies include the
clients' own waits for a core.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import queue
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from trace_lightning.tasks.search_qa.datasets import load_qa
from trace_lightning.tasks.search_qa.retrieval import BM25Retriever, HTTPRetriever
from trace_lightning.tasks.search_qa.retrieval.server import serve_in_thread

sys.path.insert(0, str(Path(__file__).resolve().parent))
import provenance  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DATASETS = {"hotpotqa": ("hotpotqa/dev_distractor.jsonl", "hotpotqa/corpus.jsonl"),
            "2wikimultihopqa": ("2wikimultihopqa/dev.jsonl", "2wikimultihopqa/corpus.jsonl")}
KS = (1, 5, 10)
OUT = provenance.RESULTS / "retrieval.json"
RECALL_OUT = provenance.RESULTS / "retrieval_recall.json"
START_TIMEOUT_S = 600.0  # building an index the first time; a cached one loads in seconds
REQUEST_TIMEOUT_S = 10.0
RSS_TOLERANCE = 0.05  # "back to idle": within 5% of the RSS before the load


def bench(name: str, data: Path, limit: int | None, batch_size: int,
          cache_dir: str | None) -> dict:
    qa_file, corpus_file = DATASETS[name]
    examples = load_qa(data / qa_file, limit=limit)
    questions = [e.question for e in examples]

    start = time.perf_counter()
    retriever = BM25Retriever(str(data / corpus_file), cache_dir=cache_dir)
    index_s = time.perf_counter() - start

    start = time.perf_counter()
    results = retriever.search(questions, max(KS))
    local_s = time.perf_counter() - start
    recall = {k: sum(any(p.title in e.extras["supporting_titles"] for p in ps[:k])
                     for e, ps in zip(examples, results)) / len(examples) for k in KS}

    server, url = serve_in_thread(retriever)
    try:
        client = HTTPRetriever(url, batch_size=batch_size)
        client.check()
        start = time.perf_counter()
        remote = client.search(questions, max(KS))
        http_s = time.perf_counter() - start
    finally:
        server.shutdown()
        server.server_close()
    if remote != results:
        raise RuntimeError(f"{name}: the server's results differ from the in-process index's")

    return {"dataset": name, "queries": len(questions), "passages": len(retriever),
            "index_s": round(index_s, 2), "index_from_cache": retriever.loaded_from_cache,
            **{f"recall@{k}": round(recall[k], 4) for k in KS},
            "qps_inprocess": round(len(questions) / local_s, 1),
            "qps_http": round(len(questions) / http_s, 1), "http_batch": batch_size}


def recall_main(args: argparse.Namespace) -> dict:
    rows = [bench(name, args.data, args.limit, args.batch_size, args.cache_dir)
            for name in DATASETS]
    header = (f"{'dataset':<16} {'queries':>7} {'passages':>8} {'index s':>8} {'R@1':>6} "
              f"{'R@5':>6} {'R@10':>6} {'qps local':>10} {'qps http':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        index = f"{r['index_s']:.2f}{'c' if r['index_from_cache'] else ''}"
        print(f"{r['dataset']:<16} {r['queries']:>7} {r['passages']:>8} {index:>8} "
              f"{r['recall@1']:>6.3f} {r['recall@5']:>6.3f} {r['recall@10']:>6.3f} "
              f"{r['qps_inprocess']:>10.0f} {r['qps_http']:>9.0f}")
    print("(index s: build time, or load time when marked c = loaded from cache; "
          f"http: requests of {args.batch_size} queries on 127.0.0.1)")
    return {"benchmark": "retrieval", "results": rows}


# -- load -----------------------------------------------------------------------------------

def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def listen_overflows() -> int:
    """The kernel's count of connections dropped for a full listen backlog, on every socket
    of this machine (TcpExt ListenOverflows in /proc/net/netstat)."""
    lines = [line.split() for line in Path("/proc/net/netstat").read_text().splitlines()
             if line.startswith("TcpExt:")]
    return int(dict(zip(lines[0], lines[1]))["ListenOverflows"])


def checkout_commit(folder: Path) -> str:
    """``git describe --always --dirty`` of the checkout at ``folder`` ("unknown" without
    git)."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                              capture_output=True, text=True, check=True,
                              cwd=folder).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def start_server(corpus: Path, cache_dir: str | None, log_path: Path,
                 checkout: Path | None = None) -> tuple[subprocess.Popen, str, int]:
    """``trace-lightning-retriever`` on a free loopback port, from ``checkout`` (None: this
    one) -> (process, host:port, passages), once its log says it serves."""
    command = [sys.executable, "-m", "trace_lightning.tasks.search_qa.retrieval.server",
               "--corpus", str(corpus), "--host", "127.0.0.1", "--port", "0"]
    if cache_dir is not None:
        command += ["--cache-dir", cache_dir]
    env = None
    if checkout is not None:  # its package first on the path
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(checkout.resolve())] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   cwd=checkout)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        found = re.search(r"serving (\d+) passages of .* at http://(127\.0\.0\.1:\d+)/retrieve",
                          log_path.read_text())
        if found:
            return process, found.group(2), int(found.group(1))
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}) before serving: "
                               f"{log_path.read_text()[-2000:]}")
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the server did not serve within {START_TIMEOUT_S:.0f} s")


def one_request(address: str, body: bytes, n_queries: int) -> str | None:
    """POST /retrieve on a new connection -> None if answered well, else the error's kind."""
    connection = http.client.HTTPConnection(address, timeout=REQUEST_TIMEOUT_S)
    try:
        connection.request("POST", "/retrieve", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        answer = response.read()
    except (OSError, http.client.HTTPException) as e:
        return type(e).__name__
    finally:
        connection.close()
    if response.status != 200:
        return f"HTTP {response.status}"
    if len(json.loads(answer).get("result", ())) != n_queries:
        return "wrong answer"
    return None


def client_loop(address: str, bodies: list[bytes], n_queries: int, first: int, step: int,
                budget: int, go, start, duration_s: float, results) -> None:
    """One client process: from ``go``, send ``bodies[first::step]`` in turn, one request at a
    time, until ``duration_s`` has passed or ``budget`` requests are sent; put (latencies of
    the answered requests in seconds, errors by kind, the time it stopped) on ``results``."""
    go.wait()
    end = start.value + duration_s
    latencies, errors = [], Counter()
    for i in range(budget):
        if time.time() >= end:
            break
        sent = time.perf_counter()
        error = one_request(address, bodies[(first + i * step) % len(bodies)], n_queries)
        if error is None:
            latencies.append(time.perf_counter() - sent)
        else:
            errors[error] += 1
    results.put((latencies, dict(errors), time.time()))


def run_load(address: str, bodies: list[bytes], n_queries: int, clients: int,
             duration_s: float, max_requests: int,
             server_pid: int) -> tuple[list[float], Counter, float, float]:
    """``clients`` processes (forked, as separate as trainer ranks) send ``bodies`` ->
    (latencies of answered requests in seconds, errors by kind, wall seconds, the server's
    peak RSS in MB, sampled every 50 ms)."""
    context = multiprocessing.get_context("fork")  # no thread runs here
    go, start, results = context.Event(), context.Value("d", 0.0), context.Queue()
    budget = -(-max_requests // clients)
    processes = [context.Process(target=client_loop, daemon=True, args=(
        address, bodies, n_queries, i, clients, budget, go, start, duration_s, results))
        for i in range(clients)]
    for process in processes:
        process.start()
    start.value = time.time()
    go.set()
    latencies, errors, stopped, peak = [], Counter(), [], 0.0
    # each request ends within its timeout, so the clients end by then
    deadline = time.monotonic() + duration_s + 3 * REQUEST_TIMEOUT_S + 30
    try:
        while len(stopped) < clients:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{clients - len(stopped)} clients did not finish")
            peak = max(peak, rss_mb(server_pid))
            try:
                lat, err, at = results.get(timeout=0.05)
            except queue.Empty:
                continue
            latencies += lat
            errors.update(err)
            stopped.append(at)
    finally:
        for process in processes:
            process.join(5)
            if process.is_alive():
                process.kill()
    return latencies, errors, max(stopped) - start.value, peak


def percentile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank ``q`` percentile of an ascending list."""
    return sorted_values[min(len(sorted_values) - 1, max(0, round(q * len(sorted_values)) - 1))]


def load_main(args: argparse.Namespace) -> dict:
    qa_file, corpus_file = DATASETS[args.dataset]
    questions = [e.question for e in load_qa(args.data / qa_file)]
    n = args.queries_per_request
    bodies = [json.dumps({"queries": [questions[(i + j) % len(questions)] for j in range(n)],
                          "topk": args.topk}).encode() for i in range(0, len(questions), n)]
    with tempfile.TemporaryDirectory() as tmp:
        process, address, passages = start_server(args.data / corpus_file, args.cache_dir,
                                                  Path(tmp) / "server.log", args.server_from)
        try:
            for i in range(2 * args.clients):  # warm-up: lazy imports, first allocations
                one_request(address, bodies[i % len(bodies)], n)
            time.sleep(1.0)
            idle_before = rss_mb(process.pid)
            load_average, overflows = os.getloadavg()[0], listen_overflows()
            latencies, errors, wall_s, peak = run_load(address, bodies, n, args.clients,
                                                       args.duration_s, args.max_requests,
                                                       process.pid)
            overflows = listen_overflows() - overflows
            time.sleep(2.0)
            idle_after = rss_mb(process.pid)
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
    latencies.sort()
    p50, p99 = (percentile(latencies, 0.5), percentile(latencies, 0.99)) if latencies else (0, 0)
    requests = len(latencies) + sum(errors.values())
    result = {
        "benchmark": "retrieval_load", "dataset": args.dataset, "passages": passages,
        "clients": args.clients, "queries_per_request": n, "topk": args.topk,
        "duration_s": round(wall_s, 2), "requests": requests,
        "requests_per_s": round(requests / wall_s, 1), "errors": sum(errors.values()),
        "error_kinds": dict(errors), "p50_ms": round(1000 * p50, 2),
        "p99_ms": round(1000 * p99, 2), "p99_over_p50": round(p99 / p50, 2) if p50 else None,
        "server_rss_mb": {"idle_before": round(idle_before, 1),
                          "peak": round(max(peak, idle_before), 1),
                          "idle_after": round(idle_after, 1)},
        "listen_overflows_machine": overflows,
        "load_average_1m_before": round(load_average, 2), "cpus": os.cpu_count(),
        "server_commit": checkout_commit(args.server_from or REPO),
        **({"server_from": str(args.server_from)} if args.server_from else {})}
    result["targets_met"] = {
        "no_errors": result["errors"] == 0,
        "p99_at_most_10x_p50": bool(p50) and p99 <= 10 * p50,
        "rss_back_to_idle": idle_after <= idle_before * (1 + RSS_TOLERANCE)}
    rss = result["server_rss_mb"]
    print(f"{args.clients} clients x {wall_s:.1f} s on {passages} passages ({n} "
          f"quer{'y' if n == 1 else 'ies'} per request, topk {args.topk}): {requests} requests, "
          f"{result['requests_per_s']} /s, {result['errors']} errors {dict(errors) or ''}\n"
          f"latency p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms "
          f"(p99/p50 {result['p99_over_p50']})\n"
          f"server RSS: {rss['idle_before']} MB idle before, {rss['peak']} MB peak, "
          f"{rss['idle_after']} MB idle after\nconnections dropped for a full listen backlog "
          f"(the whole machine's count): {overflows}\ntargets met: {result['targets_met']}")
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data",
                        help="folder holding hotpotqa/ and 2wikimultihopqa/")
    parser.add_argument("--cache-dir", default=None,
                        help="BM25 index cache (default: the library's default)")
    recall = parser.add_argument_group("recall")
    recall.add_argument("--limit", type=int, default=None,
                        help="first N questions per dataset (default: all)")
    recall.add_argument("--batch-size", type=int, default=32, help="queries per HTTP request")
    load = parser.add_argument_group("load (with --clients)")
    load.add_argument("--clients", type=int, default=None,
                      help="run the load benchmark with this many concurrent clients")
    load.add_argument("--duration-s", type=float, default=20.0, help="seconds of load")
    load.add_argument("--max-requests", type=int, default=200_000,
                      help="stop after this many requests if the time has not run out")
    load.add_argument("--dataset", choices=sorted(DATASETS), default="hotpotqa",
                      help="whose corpus is served and whose dev questions are asked")
    load.add_argument("--queries-per-request", type=int, default=1)
    load.add_argument("--topk", type=int, default=3)
    load.add_argument("--server-from", type=Path, default=None,
                      help="run the server from this checkout of the repository (default: "
                           "this one), e.g. a worktree of an older commit to compare")
    parser.add_argument("--quick", action="store_true",
                        help="recall: the first 50 questions per dataset (unless --limit); "
                             "load: at most 3 s; nothing written unless --out")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"also write the JSON line here (default with --clients: "
                             f"{OUT.relative_to(REPO)}, without it and --limit: "
                             f"{RECALL_OUT.relative_to(REPO)}; the published figures' files; "
                             f"none with --quick)")
    args = parser.parse_args(argv)
    if args.quick:
        args.limit = args.limit or 50
        args.duration_s = min(args.duration_s, 3.0)
    for name in ("clients", "max_requests", "queries_per_request", "topk"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} ({value}) must be >= 1")
    if args.server_from is not None and not (args.server_from / "trace_lightning").is_dir():
        parser.error(f"--server-from ({args.server_from}) holds no trace_lightning/; give a "
                     f"checkout of this repository")
    if not 0 < args.duration_s <= 600:
        parser.error(f"--duration-s ({args.duration_s}) must be in (0, 600]")

    stamp = provenance.Stamp()
    result = load_main(args) if args.clients is not None else recall_main(args)
    # the default runs publish; a run over the first --limit questions is a smaller one
    out = args.out or (None if args.quick else OUT if args.clients is not None
                       else RECALL_OUT if args.limit is None else None)
    provenance.publish(result, stamp, out)
    return result


if __name__ == "__main__":
    main()
