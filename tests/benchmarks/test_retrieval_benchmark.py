"""benchmarks/retrieval.py: its quick modes end to end on the real QA data, recall (in-process
BM25 and the HTTP server in a thread) and load (the server and its clients in processes of
their own), and where the full modes publish."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from builders import load_benchmark

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "retrieval.py"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("retrieval")


def test_quick_recall_on_both_datasets(bench, shared_data, tmp_path, capsys, monkeypatch):
    published = []
    monkeypatch.setattr(bench.provenance, "publish",
                        lambda result, stamp, out, **kw: published.append(out))
    result = bench.main(["--quick", f"--data={shared_data}", f"--cache-dir={tmp_path}"])
    assert published == [None]  # a quick run writes no published figures' file
    rows = {r["dataset"]: r for r in result["results"]}
    assert set(rows) == {"hotpotqa", "2wikimultihopqa"}
    assert rows["hotpotqa"]["passages"] == 13182 and rows["2wikimultihopqa"]["passages"] == 1294
    for r in rows.values():
        assert r["queries"] == 50 and not r["index_from_cache"]  # built in tmp_path
        # BM25 finds a supporting passage of most questions (the HTTP answers are checked
        # equal to the in-process ones by the benchmark itself)
        assert 0.5 < r["recall@1"] <= r["recall@5"] <= r["recall@10"] <= 1
        assert r["qps_inprocess"] > 0 and r["qps_http"] > 0


def test_full_modes_publish_to_their_files(bench, monkeypatch):
    outs = []
    monkeypatch.setattr(bench, "recall_main", lambda args: {"benchmark": "retrieval"})
    monkeypatch.setattr(bench, "load_main", lambda args: {"benchmark": "retrieval_load"})
    monkeypatch.setattr(bench.provenance, "publish",
                        lambda result, stamp, out, **kw: outs.append(out))
    bench.main([])
    bench.main(["--clients", "4"])
    bench.main(["--limit", "10"])
    bench.main(["--quick", "--clients", "4"])
    assert outs == [bench.RECALL_OUT, bench.OUT, None, None]


@pytest.mark.parametrize("server_from", [None, REPO])
def test_quick_load_answers_every_request(shared_data, tmp_path, server_from):
    # in a process of its own: the clients are forked, and this one may hold threads
    out = tmp_path / "load.json"
    flags = [] if server_from is None else ["--server-from", str(server_from)]
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--clients", "2",
                           "--data", str(shared_data), "--dataset", "2wikimultihopqa",
                           "--cache-dir", str(tmp_path / "cache"), "--out", str(out), *flags],
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == line
    assert line["benchmark"] == "retrieval_load" and line["passages"] == 1294
    assert line["clients"] == 2 and line["duration_s"] <= 3 + 10  # 3 s, a last request
    assert line["requests"] > 0 and line["errors"] == 0 and line["error_kinds"] == {}
    assert 0 < line["p50_ms"] <= line["p99_ms"]
    assert line["targets_met"]["no_errors"]
    assert line["server_rss_mb"]["peak"] >= line["server_rss_mb"]["idle_before"] > 0
    assert len(line["machine"]["load_before"]) == 3
    # whose code served: this checkout's, named when --server-from picks one
    assert line["server_commit"] == line["commit"]
    assert line.get("server_from") == (None if server_from is None else str(server_from))
