"""Rollout engine benchmark: vLLM vs transformers throughput, and the cost of a tree leaf.

Two measurements on one tiny Qwen3 (random weights, tokenizer trained on HotpotQA passages):

1. Throughput: the same workload (``--prompts`` prompts of ~``--prompt-len`` tokens, ``n``
   samples each, ``--new-tokens`` new tokens, temperature 1) on ``HFEngine`` and
   ``VLLMEngine``; generated tokens per second.
2. Cost per leaf of a continuation vs a fresh rollout (vLLM, prefix caching): ``--leaves``
   fresh rollouts of prompt + ``--rollout-len`` tokens, then one continuation per rollout
   resuming from its ``--branch-depth``-token-deep prefix and generating the remaining
   tokens, so every leaf has the same total length. Also the same continuations with a cold
   (reset) prefix cache, to separate the cache's share from the shorter decode.

Prints a table and ends with one JSON line, also written to ``--out`` (default
docs/results/engines.json, none with --quick).

    python benchmarks/engines.py            # about 2-4 minutes on 2 CPU cores
    python benchmarks/engines.py --quick    # a 2-layer model, a few short rollouts (a test runs it)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import trace_lightning  # noqa: E402,F401 - first, so numpy runs its AVX2 paths (numpy_simd)
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from trace_lightning.rollout.engines import HFEngine, SamplingConfig  # noqa: E402
from trace_lightning.tasks.search_qa.tiny_policy import (  # noqa: E402
    build_tiny_from_corpus, read_corpus_texts)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import provenance  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    data = Path(os.environ.get("TRACE_SHARED_DATA", REPO.parent / "shared" / "data"))
    p.add_argument("--data", type=Path, default=data, help="folder holding hotpotqa/")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="existing save_pretrained model; default: build a tiny one")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--leaves", type=int, default=16)
    p.add_argument("--rollout-len", type=int, default=200)
    p.add_argument("--branch-depth", type=int, default=100)
    p.add_argument("--block-size", type=int, default=32,
                   help="vLLM KV block (prefix cache granularity); vLLM's CPU default is 128")
    p.add_argument("--compile", action="store_true",
                   help="let vLLM torch.compile the model (slow start) instead of eager")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for both engines (vLLM freezes the count once started)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="hidden 64, 2 layers, vocab 512; 4 prompts x 2 samples of 16 tokens, "
                        "4 leaves of 48 tokens branched at 16")
    p.add_argument("--out", default=None,
                   help="also write the JSON line here (default docs/results/engines.json, "
                        "none with --quick; empty: nowhere)")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.vocab = 64, 2, 512
        args.prompts, args.prompt_len, args.n, args.new_tokens = 4, 32, 2, 16
        args.leaves, args.rollout_len, args.branch_depth = 4, 48, 16
    if args.out is None and not args.quick:
        args.out = str(provenance.RESULTS / "engines.json")
    return args


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def generated(out) -> int:
    return sum(len(c.token_ids) for completions in out for c in completions)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    stamp = provenance.Stamp()
    torch.set_num_threads(args.threads)
    corpus = args.data / "hotpotqa" / "corpus.jsonl"
    tmp = tempfile.TemporaryDirectory()
    model_dir = args.model_dir or build_tiny_from_corpus(
        corpus, tmp.name, vocab_size=args.vocab, passages=3000, seed=0,
        hidden_size=args.hidden, layers=args.layers, heads=4, kv_heads=2,
        intermediate=3 * args.hidden, head_dim=64)
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = read_corpus_texts(corpus, 4000)[3000:]  # passages the tokenizer was not trained on
    ids = [tok.encode(t) for t in texts]
    ids = [x[:args.prompt_len] for x in ids if len(x) >= args.prompt_len]
    prompts, tree_prompts = ids[:args.prompts], ids[args.prompts:args.prompts + args.leaves]
    sampling = SamplingConfig(temperature=1.0, max_tokens=args.new_tokens, seed=0)
    rows: list[dict] = []
    result: dict = {"benchmark": "engines",
                    "model": {"hidden": args.hidden, "layers": args.layers, "vocab": len(tok)}}

    if not args.skip_hf:
        hf = HFEngine(model_dir, batch_size=args.prompts * args.n)
        hf.generate(prompts[:2], SamplingConfig(max_tokens=4, seed=0))  # warm-up
        out, sec = timed(lambda: hf.generate(prompts, sampling, n=args.n))
        rows.append({"case": "throughput", "engine": "hf", "leaves": args.prompts * args.n,
                     "gen_tokens": generated(out), "sec": sec,
                     "threads": torch.get_num_threads()})
        del hf

    from trace_lightning.rollout.engines.vllm_engine import VLLMEngine

    (vllm, start_sec) = timed(lambda: VLLMEngine(
        str(model_dir), enforce_eager=not args.compile, kv_cache_memory_gb=1.0,
        max_model_len=1024, block_size=args.block_size, cpu_threads=args.threads))
    result["vllm_start_sec"] = round(start_sec, 1)
    vllm.generate(prompts[:2], SamplingConfig(max_tokens=4, seed=0))  # warm-up
    vllm.llm.reset_prefix_cache()
    out, sec = timed(lambda: vllm.generate(prompts, sampling, n=args.n))
    rows.append({"case": "throughput", "engine": "vllm", "leaves": args.prompts * args.n,
                 "gen_tokens": generated(out), "sec": sec, "threads": torch.get_num_threads()})

    # tree leaves: fresh rollouts vs continuations from their prefixes
    vllm.llm.reset_prefix_cache()
    fresh_cfg = SamplingConfig(temperature=1.0, max_tokens=args.rollout_len, seed=1)
    fresh, fresh_sec = timed(lambda: vllm.generate(tree_prompts, fresh_cfg))
    rollouts = [(p, o[0].token_ids) for p, o in zip(tree_prompts, fresh)
                if len(o[0].token_ids) > args.branch_depth]
    prefixes = [p + t[:args.branch_depth] for p, t in rollouts]
    rest = args.rollout_len - args.branch_depth
    cont_cfg = SamplingConfig(temperature=1.0, max_tokens=rest, seed=2)
    rows.append({"case": "fresh rollout", "engine": "vllm", "leaves": len(fresh),
                 "gen_tokens": generated(fresh), "sec": fresh_sec,
                 "prefill_tokens": sum(map(len, tree_prompts)),
                 "cached_tokens": sum(o[0].cached_tokens for o in fresh)})
    for label, reset in (("continuation", False), ("continuation, cold cache", True)):
        if reset:
            vllm.llm.reset_prefix_cache()
        cont, sec = timed(lambda: vllm.generate(prefixes, cont_cfg))
        rows.append({"case": label, "engine": "vllm", "leaves": len(cont),
                     "gen_tokens": generated(cont), "sec": sec,
                     "prefill_tokens": sum(map(len, prefixes)),
                     "cached_tokens": sum(o[0].cached_tokens for o in cont)})

    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {len(tok)}; "
          f"vLLM {'compiled' if args.compile else 'eager'}, block {args.block_size}, start "
          f"{start_sec:.1f} s; load average before {stamp.load_before[0]:.1f}")
    header = f"{'case':<26}{'engine':<7}{'leaves':>7}{'gen tok':>9}{'sec':>8}{'tok/s':>8}" \
             f"{'s/leaf':>8}{'cached/prefill':>16}"
    print(header)
    print("-" * len(header))
    for r in rows:
        r["tok_per_sec"] = r["gen_tokens"] / r["sec"]
        r["sec_per_leaf"] = r["sec"] / r["leaves"]
        cache = (f"{r['cached_tokens']}/{r['prefill_tokens']}" if "prefill_tokens" in r else "")
        print(f"{r['case']:<26}{r['engine']:<7}{r['leaves']:>7}{r['gen_tokens']:>9}"
              f"{r['sec']:>8.2f}{r['tok_per_sec']:>8.0f}{r['sec_per_leaf']:>8.3f}{cache:>16}")
    by_case = {(r["case"], r["engine"]): r for r in rows}
    fresh_leaf = by_case[("fresh rollout", "vllm")]["sec_per_leaf"]
    result["continuation_vs_fresh_per_leaf"] = round(
        by_case[("continuation", "vllm")]["sec_per_leaf"] / fresh_leaf, 3)
    result["cold_continuation_vs_fresh_per_leaf"] = round(
        by_case[("continuation, cold cache", "vllm")]["sec_per_leaf"] / fresh_leaf, 3)
    if ("throughput", "hf") in by_case:
        result["vllm_vs_hf_tok_per_sec"] = round(
            by_case[("throughput", "vllm")]["tok_per_sec"]
            / by_case[("throughput", "hf")]["tok_per_sec"], 2)
    result["rows"] = [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
                      for r in rows]
    print(f"continuation / fresh, per leaf: {result['continuation_vs_fresh_per_leaf']} "
          f"(cold cache: {result['cold_continuation_vs_fresh_per_leaf']})")
    vllm.close()  # its KV cache and the process's torch threads back to a caller (a test)
    provenance.publish(result, stamp, args.out)
    tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
