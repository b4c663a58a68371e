"""Retrieval benchmark: BM25 recall@1/5/10 and queries per second on HotpotQA and 2Wiki dev.

Query = the question; hit@k = any supporting title among the top k passages. Throughput is
measured for the in-process index (one batched call over all questions) and for the HTTP
server on 127.0.0.1 through the client (requests of ``--batch-size`` queries). Prints a table,
then one JSON line with every figure.

    python benchmarks/retrieval.py [--data ../shared/data] [--limit 500]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from trace_lightning.datasets import load_qa
from trace_lightning.retrieval import BM25Retriever, HTTPRetriever
from trace_lightning.retrieval.server import serve_in_thread

REPO = Path(__file__).resolve().parents[1]
DATASETS = {"hotpotqa": ("hotpotqa/dev_distractor.jsonl", "hotpotqa/corpus.jsonl"),
            "2wikimultihopqa": ("2wikimultihopqa/dev.jsonl", "2wikimultihopqa/corpus.jsonl")}
KS = (1, 5, 10)


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
    recall = {k: sum(any(p.title in e.supporting_titles for p in ps[:k])
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


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data",
                        help="folder holding hotpotqa/ and 2wikimultihopqa/")
    parser.add_argument("--limit", type=int, default=None,
                        help="first N questions per dataset (default: all)")
    parser.add_argument("--batch-size", type=int, default=32, help="queries per HTTP request")
    parser.add_argument("--cache-dir", default=None,
                        help="BM25 index cache (default: the library's default)")
    args = parser.parse_args(argv)

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
    print(json.dumps({"benchmark": "retrieval", "results": rows}))
    return rows


if __name__ == "__main__":
    main()
