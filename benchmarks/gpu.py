"""GPU training and generation benchmark: our Lightning update against a plain PyTorch loop.

One Qwen3-0.6B-shaped model with random weights (no download), bf16, SDPA attention:

1. ``logprobs``: the LM-head/loss tail alone on (batch, seq, vocab) logits, forward + backward:
   ``token_logprobs`` plain (one float32 copy) vs chunked (the default) vs
   ``masked_token_logprobs`` (LM head only on policy rows); time, peak memory, agreement.
2. ``plain``: a bare loop, ``--batch`` x ``--seq`` random tokens per forward, ``--accum``
   forwards per AdamW step (fused), the same loss as ours (``token_logprobs`` with entropy +
   ``policy_loss``), gradient clipping at 1.0.
3. ``ours``: ``TraceModule.training_step`` under ``Trainer(strategy=TraceFSDPStrategy(
   auto_wrap_policy={Qwen3DecoderLayer}), precision="bf16-true")`` on a DataLoader of mini-batch dicts:
   synthetic tree-like leaves (300-2048 tokens, ~60% policy tokens) packed by
   ``pack_microbatches`` into micro-batches of at most ``batch * seq`` padded tokens, about
   ``batch * seq * accum`` real tokens per mini-batch (one optimizer step each, as in plain).
   ``ours`` is the module as it stands (the policy is its own FSDP root, see
   ``TraceModule.shard_models``; no attention mask for its right-padded causal batches, so
   SDPA can take its flash kernel; the LM head on policy rows only; fused AdamW on CUDA: what
   the 2026-11-30 H200 runs measured as ``ours_tuned``, now the module's own path).
   ``ours_fp32_master``: ours with float32 weights and AdamW state, ``precision="bf16-mixed"``
   (FSDP computes in bf16). ``ours_auto``: the module as it stands under ``strategy="auto"``
   (one device, no FSDP; the design notes measured a minimal module 3x slower so, and the
   2026-11-30 H200 run measured ours 1.1x faster so: see docs/results.md, GPU). With
   ``--compile``: ``plain_compiled`` / ``ours_compiled`` (``TraceModule(compile_layers=True)``)
   (``torch.compile`` of each decoder layer). ``weight_updated_frac``: share of one weight
   matrix's entries changed by the timed steps at ``--lr``; bf16 weights drop AdamW updates
   smaller than half their rounding step (about 0.4% of the weight).
   ``ours_packed`` (and ``ours_packed_compiled``): ours on Search-R1-shaped trees, each
   packed as one sequence (``TraceModule(tree_packing=True)``: FlexAttention with a block
   mask on CUDA); its tokens/s and MFU count the leaves' tokens (the per-leaf work it
   replaces: an equivalent throughput), ``forwarded_share`` the tokens it actually forwards.
4. ``generation``: ``HFEngine`` (its own KV-cached sampling loop) at batch ``--gen-batch``,
   ``--gen-new`` new tokens, ~``--gen-prompt``-token prompts; and ``hf_generate``
   (transformers ``generate``, sampling) on the same prompts.
5. ``padding``: padded share of packed micro-batches vs fixed-size batches of the same leaves.

FLOPs (PaLM appendix B convention, training = forward + backward, padding not counted):
per real token of a sequence of length L, ``6 * N + 12 * n_layers * n_heads * head_dim * L``,
with N = every non-embedding parameter plus the LM-head matmul (V * hidden; with tied
embeddings N equals the unique parameter count, 596M for Qwen3-0.6B). The attention term uses
the attention width ``n_heads * head_dim`` (2048 for Qwen3-0.6B, not hidden=1024) and counts
full, not causal, attention. MFU = FLOPs / s / 790e12 (the dense bf16 matmul peak measured on
the H200 in the project's design notes; the spec sheet's figure, 989e12, would give 0.8x
these MFUs). Variants that skip work (the LM head on policy rows only) keep the same FLOP
count, so their MFU is a throughput-equivalent figure: at about 60% policy tokens ``ours``
skips about 0.4 of the LM head's 6 x 156M FLOPs per token, so its hardware MFU is about 8%
lower than the one printed. Timings: ``torch.cuda.synchronize`` around a wall
clock, after ``--warmup`` steps; for Lightning, from the start of the first timed batch to the
end of the last (data loading and hooks included).

Prints a table and ends with one JSON line (also written to ``--out``, updated after every
section). Each section runs in its own ``try``: a failure is recorded and the next one runs.
Sections that would start after ``--budget-s`` are skipped; compiled ones are cut off there.
They run in the order the targets need them: plain, ours, generation, compiled ours (with
``--compile``), then the variants, so a tight budget drops variants first.
``--tiny`` runs every section on CPU, FSDP1 included (over gloo, see ``_fsdp_strategy``).

    PYTHONPATH=. python benchmarks/gpu.py --out $OUT/gpu.json        # one H200, ~3-4 min;
                                          # the published copy: docs/results/gpu.json
    PYTHONPATH=. python benchmarks/gpu.py --tiny                     # CPU smoke test, ~30 s
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402


def _placeholder_missing(names: tuple[str, ...] = ("bm25s",)) -> list[str]:
    """``trace_lightning.training.module`` imports ``collect -> rollout -> environment -> retrieval ->
    retrieval.bm25 -> bm25s`` at import time; this benchmark never retrieves. Where such a
    module is absent (the H200 image has no bm25s), put an empty placeholder in
    ``sys.modules`` so the import chain loads; any real use of it would fail loudly."""
    placed = []
    for name in names:
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            sys.modules[name] = types.ModuleType(name)
            placed.append(name)
    return placed


PLACEHOLDERS = _placeholder_missing()

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3Config  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer  # noqa: E402

from trace_lightning.rollout.engines.base import SamplingConfig  # noqa: E402
from trace_lightning.rollout.engines.hf_engine import HFEngine  # noqa: E402
from trace_lightning.math.loss import (masked_token_logprobs, policy_loss,  # noqa: E402
                                  token_logprobs)
from trace_lightning.training.module import TraceModule, compile_decoder_layers  # noqa: E402
from trace_lightning.packing.leaves import collate, pack_microbatches, padding_share  # noqa: E402
from trace_lightning.tree import LeafSequence  # noqa: E402

PEAK_FLOPS = 790e12  # bf16 dense matmul, measured on the H200 (the project's design notes)
QWEN3_0_6B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                  vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
                  rms_norm_eps=1e-6)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, vocab_size=512, tie_word_embeddings=True,
            max_position_embeddings=512, rms_norm_eps=1e-6)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke test: a 2-layer model, short sequences, fp32, 2 steps")
    p.add_argument("--steps", type=int, default=None, help="timed optimizer steps (default 8)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3)")
    p.add_argument("--batch", type=int, default=None, help="sequences per plain forward (8)")
    p.add_argument("--seq", type=int, default=None, help="tokens per plain sequence (2048)")
    p.add_argument("--tree-seq", type=int, default=None,
                   help="ours_packed: the leaf length its Search-R1-shaped trees are scaled "
                        "to (2048: update.py's trees; default --seq)")
    p.add_argument("--accum", type=int, default=2,
                   help="forwards per optimizer step (plain); ours: mini-batch = accum x "
                        "batch x seq real tokens")
    p.add_argument("--gen-batch", type=int, default=None, help="generation batch (256)")
    p.add_argument("--gen-prompt", type=int, default=None, help="prompt tokens, about (256)")
    p.add_argument("--gen-new", type=int, default=None, help="new tokens per sequence (128)")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate everywhere")
    p.add_argument("--compile", action="store_true",
                   help="also time plain and ours with torch.compile'd decoder layers")
    p.add_argument("--sections", default="all",
                   help="comma list of: model, padding, logprobs, plain, ours, ours_packed, "
                        "ours_fp32_master, ours_auto, ours_packed_compiled, "
                        "generation, hf_generate, plain_unchunked, plain_compiled, "
                        "ours_compiled (the last two need --compile)")
    p.add_argument("--budget-s", type=float, default=280.0,
                   help="skip sections that would start after this many seconds")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    small = args.tiny
    defaults = dict(steps=2 if small else 8, warmup=1 if small else 3, batch=2 if small else 8,
                    seq=128 if small else 2048, gen_batch=4 if small else 256,
                    gen_prompt=16 if small else 256, gen_new=8 if small else 128)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.steps < 1 or args.warmup < 0 or args.accum < 1:
        raise ValueError(f"--steps ({args.steps}) must be >= 1, --warmup ({args.warmup}) >= 0 "
                         f"and --accum ({args.accum}) >= 1")
    return args


def flop_terms(c: Qwen3Config) -> tuple[int, int]:
    """``(N, A)`` with training FLOPs per real token of a length-L sequence = 6 N + A L:
    N = non-embedding parameters + the LM-head matmul, A = 12 * layers * heads * head_dim."""
    attn_width = c.num_attention_heads * c.head_dim
    per_layer = (c.hidden_size * attn_width * 2  # q, o
                 + c.hidden_size * c.num_key_value_heads * c.head_dim * 2  # k, v
                 + 3 * c.hidden_size * c.intermediate_size  # gate, up, down
                 + 2 * c.head_dim + 2 * c.hidden_size)  # q/k norms, 2 layer norms
    n = c.num_hidden_layers * per_layer + c.hidden_size + c.vocab_size * c.hidden_size
    return n, 12 * c.num_hidden_layers * attn_width  # + final norm + LM head matmul


# ---- setup ------------------------------------------------------------------------------
class Setup:
    """Device, dtypes and shapes shared by every section."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.cuda = torch.cuda.is_available() and not args.tiny
        if not self.cuda and not args.tiny:
            raise RuntimeError("no CUDA device; run with --tiny for the CPU smoke test")
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.dtype_name = "bfloat16" if self.cuda else "float32"
        self.precision = "bf16-true" if self.cuda else "32-true"
        self.shape = dict(TINY if args.tiny else QWEN3_0_6B)
        self.config = Qwen3Config(**self.shape)
        self.n_flop_params, self.attn_coef = flop_terms(self.config)
        self.pad_id = 0

    def flops(self, lengths: list[int]) -> float:
        """Training FLOPs of the real tokens of sequences of these lengths (module doc)."""
        return sum(6.0 * self.n_flop_params * n + self.attn_coef * n * n for n in lengths)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float | None:
        return torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def build_model(s: Setup, out_dir: Path) -> dict:
    """Random-weight model of the benchmark shape, saved with ``save_pretrained``."""
    torch.manual_seed(s.args.seed)
    with torch.device(s.device):
        model = AutoModelForCausalLM.from_config(s.config, dtype=s.dtype,
                                                 attn_implementation="sdpa")
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out_dir)
    info = {"params": n, "n_flop_params": s.n_flop_params, "path": str(out_dir),
            "attn_implementation": model.config._attn_implementation}
    del model
    s.free()
    return info


def load_model(s: Setup, path: Path, dtype: torch.dtype | None = None):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or s.dtype,
                                                 attn_implementation="sdpa")
    return model.to(s.device)


# ---- synthetic tree leaves --------------------------------------------------------------
def synth_leaf(rng: random.Random, seq: int, vocab: int, idx: int,
               full_length: bool = False) -> LeafSequence:
    """A search-agent leaf: prompt, then turns of (policy thought+action, observation), the
    last turn policy only; segment lengths are fractions of ``seq`` (300-2048 tokens overall at
    seq 2048, ~60% policy tokens). ``full_length``: keep adding turns up to exactly ``seq``."""
    mask = [0] * max(2, int(seq * rng.uniform(0.06, 0.15)))  # prompt
    turns = rng.randint(1, 4)
    for k in range(64 if full_length else turns):
        mask += [1] * max(1, int(seq * rng.uniform(0.08, 0.25)))  # thought + action
        if k < turns - 1 or full_length:
            mask += [0] * max(1, int(seq * rng.uniform(0.04, 0.10)))  # observation
        if len(mask) >= seq:
            break
    mask = mask[:seq]
    base = -math.log(vocab)  # a random-weight policy is close to uniform
    ids = [rng.randrange(vocab) for _ in mask]
    logprobs = [base + rng.gauss(0.0, 0.05) if m else 0.0 for m in mask]
    reward = float(rng.random() < 0.5)
    return LeafSequence(tree_id=f"t{idx // 8}", leaf_id=idx, rollout=idx % 8, input_ids=ids,
                        policy_mask=mask, logprobs=logprobs, reward=reward,
                        ancestors=[0], advantage=1.0 if reward else -1.0)


def synth_minibatches(s: Setup, n: int, rng: random.Random) -> list[dict]:
    """``n`` mini-batch dicts ``{"micro": [...], "n_tokens", "lengths", "padded"}`` of about
    ``accum * batch * seq`` real tokens each, packed into ``batch * seq``-token micro-batches."""
    a = s.args
    target, budget = a.accum * a.batch * a.seq, a.batch * a.seq
    out, idx = [], 0
    for _ in range(n):
        seqs, total = [], 0
        while total < target:
            seq = synth_leaf(rng, a.seq, s.config.vocab_size, idx)
            idx += 1
            seqs.append(seq)
            total += len(seq.input_ids)
        groups = pack_microbatches(seqs, budget)
        micro = [collate([seqs[i] for i in g], s.pad_id) for g in groups]
        out.append({"micro": micro,
                    "n_tokens": float(sum(sum(q.policy_mask) for q in seqs)),
                    "lengths": [len(q.input_ids) for q in seqs],
                    "padded": sum(m["input_ids"].numel() for m in micro)})
    return out


def synth_tree_minibatches(s: Setup, n: int, seed: int) -> list[dict]:
    """``n`` mini-batch dicts like ``synth_minibatches``'s, of Search-R1-shaped trees
    (``benchmarks/update.py``'s, their lengths scaled to ``--tree-seq``: at 2048 a 300-token
    prompt and 3 turns of 100 generated + 450 observation tokens), each tree packed as one
    sequence (``tree_packing``): about ``accum * batch * seq`` tokens over leaves per
    mini-batch; ``lengths`` are the leaves' (the per-leaf work, for FLOPs and tokens/s)."""
    from trace_lightning.math.advantage import assign_advantages
    from trace_lightning.packing.trees import tree_minibatches, update_units

    spec = importlib.util.spec_from_file_location("bench_update",
                                                  Path(__file__).with_name("update.py"))
    update = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(update)
    a = s.args
    target, budget = a.accum * a.batch * a.seq, a.batch * a.seq
    scale = (a.tree_seq or a.seq) / 2048
    out = []
    for k in range(n):
        trees, leaves = [], []
        while sum(len(q.input_ids) for q in leaves) < target:
            (t,) = update.search_r1_trees(
                s.config.vocab_size, seed * 1000 + k * 100 + len(trees), prompts=1,
                prompt_len=max(2, int(300 * scale)), generated=max(1, int(100 * scale)),
                observed=max(1, int(450 * scale)))
            t.tree_id = f"{k}-{len(trees)}"
            seqs = t.flatten()
            for q, adv in zip(seqs, assign_advantages(seqs, [t], "grpo")):
                q.token_advantages = adv
            trees.append(update_units(t, seqs, budget))
            leaves += seqs
        (mini,) = tree_minibatches(trees, 1, budget, s.pad_id, seed=k)
        out.append({"micro": mini["micro"], "n_tokens": mini["n_tokens"],
                    "lengths": [len(q.input_ids) for q in leaves],
                    "padded": sum(m["input_ids"].numel() for m in mini["micro"]),
                    "unique": sum(len(u) for us in trees for u in us)})
    return out


class _MiniBatches(torch.utils.data.Dataset):
    """The mini-batch dicts as TraceModule's DataModule yields them (extra keys dropped)."""

    def __init__(self, items: list[dict]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return {"micro": self.items[i]["micro"], "n_tokens": self.items[i]["n_tokens"]}


# ---- sections ---------------------------------------------------------------------------
def section_padding(s: Setup) -> dict:
    """Padded share: packed micro-batches vs fixed batches of ``--batch`` leaves in arrival
    order (padded to their longest) vs everything padded to ``--seq``."""
    rng = random.Random(s.args.seed + 1)
    seqs = [synth_leaf(rng, s.args.seq, s.config.vocab_size, i) for i in range(512)]
    packed = pack_microbatches(seqs, s.args.batch * s.args.seq)
    fixed = [list(range(i, min(i + s.args.batch, len(seqs))))
             for i in range(0, len(seqs), s.args.batch)]
    lengths = [len(q.input_ids) for q in seqs]
    policy = sum(sum(q.policy_mask) for q in seqs)
    return {"leaves": len(seqs), "mean_len": statistics.mean(lengths),
            "min_len": min(lengths), "max_len": max(lengths),
            "policy_token_share": policy / sum(lengths),
            "packed": padding_share(packed, seqs), "packed_micro_batches": len(packed),
            "fixed_batch": padding_share(fixed, seqs), "fixed_batches": len(fixed),
            "pad_to_seq": 1.0 - sum(lengths) / (len(seqs) * s.args.seq)}


def _time_cuda(s: Setup, fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    s.sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        s.sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def section_logprobs(s: Setup) -> dict:
    """LM-head + log-prob tail, forward + backward, on ``batch x seq`` positions."""
    a, c = s.args, s.config
    g = torch.Generator(device=s.device).manual_seed(a.seed)
    b, t, v, h = a.batch, a.seq, c.vocab_size, c.hidden_size
    ids = torch.randint(0, v, (b, t), device=s.device, generator=g)  # (B, T)
    up = torch.randn(b, t, device=s.device, generator=g)  # (B, T) upstream gradient
    rng = random.Random(a.seed + 2)
    mask = torch.tensor([synth_leaf(rng, t, v, i, full_length=True).policy_mask
                         for i in range(b)], dtype=torch.float32, device=s.device)  # (B, T)
    hidden = torch.randn(b, t, h, device=s.device, dtype=s.dtype, generator=g)  # (B, T, H)
    head = torch.nn.Linear(h, v, bias=False, device=s.device, dtype=s.dtype)
    out: dict = {"shape": [b, t, v], "policy_share": float(mask.mean())}
    results = {}
    for name in ("plain", "chunked", "masked"):
        hid = hidden.detach().requires_grad_(True)

        def step(name=name, hid=hid):
            hid.grad, head.weight.grad = None, None
            if name == "masked":
                logp, ent = masked_token_logprobs(hid, head, ids, mask, with_entropy=True)
            else:
                logp, ent = token_logprobs(head(hid), ids, with_entropy=True,
                                           chunk_elements=None if name == "plain" else 1 << 28)
            ((logp * up * mask).sum()).backward()
            return logp.detach(), ent

        s.free()
        s.reset_peak()
        base = torch.cuda.memory_allocated() / 2**30 if s.cuda else 0.0
        sec = _time_cuda(s, step, reps=5 if s.cuda else 1, warmup=2 if s.cuda else 1)
        logp, ent = step()
        peak = s.peak_gib()
        results[name] = (logp * mask, ent * mask, hid.grad.float(), head.weight.grad.float())
        out[name] = {"ms": sec * 1e3, "peak_extra_gib": None if peak is None else peak - base}
    ref = results["plain"]
    for name in ("chunked", "masked"):
        got = results[name]
        out[name]["max_abs_logp_diff"] = float((got[0] - ref[0]).abs().max())
        out[name]["grad_hidden_rel_err"] = float((got[2] - ref[2]).norm() / ref[2].norm())
        out[name]["grad_head_rel_err"] = float((got[3] - ref[3]).norm() / ref[3].norm())
    del results, ref, hidden, head
    s.free()
    return out


def _plain_batches(s: Setup, n: int) -> list[dict]:
    """``n`` fixed (batch, seq) micro-batches of random tokens with tree-like policy masks."""
    a = s.args
    rng = random.Random(a.seed + 3)
    out = []
    for k in range(n):
        seqs = [synth_leaf(rng, a.seq, s.config.vocab_size, k * a.batch + i, full_length=True)
                for i in range(a.batch)]
        mb = collate(seqs, s.pad_id)
        out.append({k2: v.to(s.device) for k2, v in mb.items()})
    return out


def compiled_graphs() -> int:
    """Graphs torch.compile has built so far in this process (recompiles included)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def section_plain(s: Setup, path: Path, chunked: bool = True, compiled: bool = False) -> dict:
    a = s.args
    model = load_model(s, path)
    model.train()
    if compiled:
        compile_decoder_layers(model)
    batches = _plain_batches(s, 4)
    n_tokens = float(sum(mb["policy_mask"].sum() for mb in batches[:a.accum]))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, fused=s.cuda)
    chunk = (1 << 28) if chunked else None
    before = _snapshot(model)
    warmup = a.warmup + (2 if compiled else 0)
    s.reset_peak()
    t_compile = time.perf_counter()
    step_times = []
    t0 = None
    for i in range(warmup + a.steps):
        if i == warmup:
            s.sync()
            t0 = time.perf_counter()
            before = _snapshot(model)
            graphs0 = compiled_graphs()
        ts = time.perf_counter()
        for k in range(a.accum):
            mb = batches[(i * a.accum + k) % len(batches)]
            logits = model(input_ids=mb["input_ids"], use_cache=False).logits  # (B, T, V)
            logp, ent = token_logprobs(logits, mb["input_ids"], with_entropy=True,
                                       chunk_elements=chunk)
            del logits
            loss, _ = policy_loss(logp, mb["old_logprobs"], mb["advantages"], mb["policy_mask"],
                                  normalizer=n_tokens, entropy=ent)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i == 0:
            s.sync()
            first_step_s = time.perf_counter() - t_compile
        if i >= warmup:
            s.sync()
            step_times.append(time.perf_counter() - ts)
    s.sync()
    wall = time.perf_counter() - t0
    tokens = a.steps * a.accum * a.batch * a.seq
    flops = a.steps * a.accum * s.flops([a.seq] * a.batch)
    out = {"tokens_per_s": tokens / wall, "mfu": flops / wall / PEAK_FLOPS,
           "step_s_median": statistics.median(step_times), "tokens_per_step": tokens / a.steps,
           "peak_gib": s.peak_gib(), "first_step_s": first_step_s,
           "weight_updated_frac": _updated_frac(before, model),
           "logprobs": "chunked" if chunked else "plain", "compiled": compiled,
           "graphs_compiled_while_timed": compiled_graphs() - graphs0,
           "adamw": "fused" if s.cuda else "foreach"}
    del model, opt, batches
    s.free()
    return out


def _probe_weight(model) -> torch.Tensor:
    return model.model.layers[-1].mlp.down_proj.weight


def _snapshot(model) -> torch.Tensor | None:
    try:
        return _probe_weight(model).detach().float().clone()
    except Exception:  # noqa: BLE001 - a statistic; a sharded view may not be readable
        return None


def _updated_frac(before: torch.Tensor | None, model) -> float | None:
    after = _snapshot(model)
    if before is None or after is None or before.shape != after.shape or before.numel() == 0:
        return None
    return float((after != before).float().mean())


def _fsdp_strategy(s: Setup):
    """Our FSDP strategy (the GPU configs'); on CPU (--tiny) the same FSDP1 code over gloo."""
    from trace_lightning.training.strategies import CPUFSDPStrategy, TraceFSDPStrategy

    if s.cuda:
        return TraceFSDPStrategy(auto_wrap_policy={Qwen3DecoderLayer}), "cuda"
    return CPUFSDPStrategy(auto_wrap_policy={Qwen3DecoderLayer}), "cpu"


class _StepTimer(L.Callback):
    """Times the batches after ``warmup`` (synchronised), peak memory, one weight's update."""

    def __init__(self, s: Setup, warmup: int):
        self.s, self.warmup = s, warmup
        self.t_fit = time.perf_counter()
        self.t0 = self.t_end = self.t_first = None
        self.batch_times: list[tuple[int, float]] = []
        self.before = None
        self.updated_frac = None
        self.attn = None
        self._ts = 0.0
        self.graphs0 = self.graphs = 0

    def on_train_start(self, trainer, pl_module):
        self.s.reset_peak()
        self.attn = pl_module.policy.config._attn_implementation

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.s.sync()
        self._ts = time.perf_counter()
        if batch_idx == 0:
            self.t_first = self._ts
        if batch_idx == self.warmup:
            self.t0 = self._ts
            self.before = _snapshot(pl_module.policy)
            self.graphs0 = compiled_graphs()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.s.sync()
        now = time.perf_counter()
        if batch_idx >= self.warmup:
            self.t_end = now
            self.batch_times.append((batch_idx, now - self._ts))

    def on_train_end(self, trainer, pl_module):
        self.updated_frac = _updated_frac(self.before, pl_module.policy)
        self.graphs = compiled_graphs() - self.graphs0


def section_ours(s: Setup, path: Path, fp32_master: bool = False, compiled: bool = False,
                 fsdp: bool = True, packed: bool = False) -> dict:
    a = s.args
    warmup = a.warmup + (2 if compiled else 0)
    items = (synth_tree_minibatches(s, warmup + a.steps, a.seed + 6) if packed
             else synth_minibatches(s, warmup + a.steps, random.Random(a.seed + 4)))
    dtype = "float32" if fp32_master else s.dtype_name
    precision = "bf16-mixed" if fp32_master else s.precision
    kwargs = dict(policy_path=str(path), dtype=dtype, lr=a.lr, compile_layers=compiled,
                  tree_packing=packed)
    module = TraceModule(**kwargs)
    timer = _StepTimer(s, warmup)
    if fsdp:
        strategy, accelerator = _fsdp_strategy(s)
    else:
        strategy, accelerator = "auto", ("cuda" if s.cuda else "cpu")
    trainer = L.Trainer(accelerator=accelerator, devices=1, strategy=strategy,
                        precision=precision, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[timer])
    loader = DataLoader(_MiniBatches(items), batch_size=None, shuffle=False, num_workers=0)
    trainer.fit(module, train_dataloaders=loader)
    timed = items[warmup:]
    wall = timer.t_end - timer.t0
    tokens = sum(sum(it["lengths"]) for it in timed)
    flops = sum(s.flops(it["lengths"]) for it in timed)
    per_batch = [sum(items[i]["lengths"]) / dt for i, dt in timer.batch_times]
    out = {"tokens_per_s": tokens / wall, "mfu": flops / wall / PEAK_FLOPS,
           "tokens_per_s_median_batch": statistics.median(per_batch),
           "tokens_per_step": tokens / a.steps,
           "micro_per_step": statistics.mean(len(it["micro"]) for it in timed),
           "padding_share": 1.0 - sum(it.get("unique", sum(it["lengths"])) for it in timed)
           / sum(it["padded"] for it in timed),
           "policy_token_share": sum(it["n_tokens"] for it in timed) / tokens,
           "peak_gib": s.peak_gib(), "setup_s": timer.t_first - timer.t_fit,
           "weight_updated_frac": timer.updated_frac, "attn_implementation": timer.attn,
           "precision": precision, "dtype": dtype,
           "strategy": type(trainer.strategy).__name__,
           "fsdp_root": type(module.policy).__name__, "compiled": compiled,
           # packed: tokens actually forwarded over the leaves' tokens (tokens/s and MFU
           # above count the leaves': the per-leaf work, an equivalent throughput)
           "forwarded_share": (sum(it["unique"] for it in timed) / tokens if packed
                               else None),
           "graphs_compiled_while_timed": timer.graphs}
    del trainer, module, loader, items, timer
    s.free()
    return out


def _prompts(s: Setup) -> list[list[int]]:
    a = s.args
    rng = random.Random(a.seed + 5)
    lo, hi = int(a.gen_prompt * 0.875), int(a.gen_prompt * 1.125)
    return [[rng.randrange(s.config.vocab_size) for _ in range(rng.randint(lo, hi))]
            for _ in range(a.gen_batch)]


def section_generation(s: Setup, path: Path) -> dict:
    a = s.args
    model = load_model(s, path)
    engine = HFEngine(model, batch_size=a.gen_batch)
    prompts = _prompts(s)
    engine.generate(prompts[:4], SamplingConfig(max_tokens=4, seed=1))  # warm-up
    s.reset_peak()
    s.sync()
    t0 = time.perf_counter()
    out = engine.generate(prompts, SamplingConfig(temperature=1.0, max_tokens=a.gen_new, seed=0))
    s.sync()
    sec = time.perf_counter() - t0
    new = sum(len(c[0].token_ids) for c in out)
    res = {"new_tokens_per_s": new / sec, "seconds": sec, "new_tokens": new,
           "batch": len(prompts), "prompt_tokens": sum(map(len, prompts)),
           "peak_gib": s.peak_gib()}
    del model, engine
    s.free()
    return res


def section_hf_generate(s: Setup, path: Path) -> dict:
    a = s.args
    model = load_model(s, path).eval()
    prompts = _prompts(s)
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), s.pad_id, dtype=torch.long)  # (B, T) left-padded
    mask = torch.zeros_like(ids)  # (B, T)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(s.device), mask.to(s.device)
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=s.pad_id)
    with torch.no_grad():
        model.generate(input_ids=ids[:4], attention_mask=mask[:4], max_new_tokens=4,
                       min_new_tokens=4, **kw)
        s.reset_peak()
        s.sync()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=a.gen_new,
                             min_new_tokens=a.gen_new, **kw)
        s.sync()
    sec = time.perf_counter() - t0
    new = (out.shape[1] - width) * out.shape[0]
    res = {"new_tokens_per_s": new / sec, "seconds": sec, "new_tokens": new,
           "peak_gib": s.peak_gib()}
    del model, out
    s.free()
    return res


# ---- driver -----------------------------------------------------------------------------
class SectionTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise ``SectionTimeout`` in the main thread after ``seconds`` (POSIX only)."""
    if seconds is None or not hasattr(signal, "setitimer"):
        yield
        return

    def handler(signum, frame):
        raise SectionTimeout(f"cut off after {seconds:.0f} s (--budget-s)")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _commit() -> str | None:
    """The checkout's commit (None where there is no git, e.g. a copied tree)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment(s: Setup) -> dict:
    import lightning
    import transformers

    env = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "commit": _commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "lightning": lightning.__version__,
           "transformers": transformers.__version__, "device": str(s.device),
           "dtype": s.dtype_name, "placeholder_modules": PLACEHOLDERS,
           "flash_attn_pkg": importlib.util.find_spec("flash_attn") is not None}
    if s.cuda:
        try:
            env.update(gpu=torch.cuda.get_device_name(),
                       capability=torch.cuda.get_device_capability(),
                       sdpa_flash=torch.backends.cuda.flash_sdp_enabled(),
                       sdpa_mem_efficient=torch.backends.cuda.mem_efficient_sdp_enabled(),
                       sdpa_cudnn=torch.backends.cuda.cudnn_sdp_enabled())
        except Exception as e:  # noqa: BLE001 - informative only
            env["error"] = f"{type(e).__name__}: {e}"
    return env


def table(results: dict) -> str:
    rows = [("section", "tokens/s", "MFU", "peak GiB", "notes")]

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    for name in ("plain", "plain_unchunked", "plain_compiled", "ours",
                 "ours_auto", "ours_fp32_master", "ours_compiled", "generation",
                 "hf_generate"):
        r = results.get(name)
        if r is None:
            continue
        if "error" in r or "skipped" in r:
            rows.append((name, "-", "-", "-", r.get("error") or r.get("skipped")))
            continue
        tps = r.get("tokens_per_s", r.get("new_tokens_per_s"))
        notes = []
        if "weight_updated_frac" in r and r["weight_updated_frac"] is not None:
            notes.append(f"updated {r['weight_updated_frac']:.3f}")
        if "padding_share" in r:
            notes.append(f"pad {r['padding_share']:.3f}")
        if "setup_s" in r:
            notes.append(f"setup {r['setup_s']:.0f}s")
        if "seconds" in r:
            notes.append(f"{r['seconds']:.1f}s (new tokens/s)")
        rows.append((name, fmt(tps, ",.0f"), fmt(r.get("mfu"), ".1%"),
                     fmt(r.get("peak_gib"), ".1f"), ", ".join(notes)))
    lp = results.get("logprobs")
    if lp and "error" not in lp and "skipped" not in lp:
        for k in ("plain", "chunked", "masked"):
            extra = lp[k].get("grad_hidden_rel_err")
            rows.append((f"logprobs/{k}", f"{lp[k]['ms']:.1f} ms", "-",
                         fmt(lp[k]["peak_extra_gib"], ".1f"),
                         "" if extra is None else f"grad rel err {extra:.1e}"))
    pad = results.get("padding")
    if pad and "error" not in pad:
        rows.append(("padding", "-", "-", "-",
                     f"packed {pad['packed']:.3f} / fixed {pad['fixed_batch']:.3f} / "
                     f"to seq {pad['pad_to_seq']:.3f}"))
    widths = [max(len(str(r[i])) for r in rows) for i in range(4)]
    lines = ["  ".join(str(r[i]).ljust(widths[i]) for i in range(4)) + "  " + str(r[4])
             for r in rows]
    for key, what in (("ratios", "tokens/s ratios"), ("flop_ratios", "at equal work (MFU)")):
        if results.get(key):
            lines.append(f"{what}: " + ", ".join(f"{k} {v:.2f}"
                                                for k, v in results[key].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    s = Setup(args)
    if s.cuda:  # no fp32 matmul is on the hot path; any that is may use TF32
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    wanted = None if args.sections == "all" else set(args.sections.split(","))
    results: dict = {"args": {k: (str(v) if isinstance(v, Path) else v)
                              for k, v in vars(args).items()},
                     "environment": environment(s), "peak_flops": PEAK_FLOPS,
                     "flops_per_token": "6 * N + 12 * n_layers * n_heads * head_dim * L "
                                        "(N = non-embedding params + LM head matmul; L = the "
                                        "sequence's length; real tokens only)",
                     "shape": s.shape, "n_flop_params": s.n_flop_params}

    def save() -> None:
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))

    tmp = tempfile.TemporaryDirectory(prefix="trace_gpu_bench_")
    path = Path(tmp.name) / "policy"

    def run(name: str, fn, needs_compile: bool = False) -> None:
        if wanted is not None and name not in wanted:
            return
        if needs_compile and not args.compile:
            return
        left = args.budget_s - (time.perf_counter() - start)
        if left <= 0:
            results[name] = {"skipped": f"--budget-s {args.budget_s:.0f} reached"}
            print(f"[{name}] skipped: budget reached", flush=True)
            save()
            return
        print(f"[{name}] running ({left:.0f} s of budget left)", flush=True)
        t0 = time.perf_counter()
        try:
            with time_limit(left if needs_compile else None):
                results[name] = fn()
        except Exception as e:  # noqa: BLE001 - record, keep measuring the other sections
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            s.free()
        results[name]["section_s"] = time.perf_counter() - t0
        print(f"[{name}] {json.dumps(results[name])}", flush=True)
        save()

    # what the targets are judged on first (the budget skips the rest): the plain loop and
    # ours, compiled ours (the MFU target), generation and padding; then the variants
    run("model", lambda: build_model(s, path))
    run("padding", lambda: section_padding(s))
    run("plain", lambda: section_plain(s, path))
    run("ours", lambda: section_ours(s, path))
    run("generation", lambda: section_generation(s, path))
    run("ours_packed", lambda: section_ours(s, path, packed=True))
    run("ours_compiled", lambda: section_ours(s, path, compiled=True), needs_compile=True)
    run("ours_packed_compiled", lambda: section_ours(s, path, compiled=True, packed=True),
        needs_compile=True)
    run("plain_compiled", lambda: section_plain(s, path, compiled=True), needs_compile=True)
    run("logprobs", lambda: section_logprobs(s))
    run("hf_generate", lambda: section_hf_generate(s, path))
    run("ours_auto", lambda: section_ours(s, path, fsdp=False))
    run("ours_fp32_master", lambda: section_ours(s, path, fp32_master=True))
    run("plain_unchunked", lambda: section_plain(s, path, chunked=False))

    def tps(name: str) -> float | None:
        r = results.get(name) or {}
        return r.get("tokens_per_s")

    def mfu(name: str) -> float | None:
        r = results.get(name) or {}
        return r.get("mfu")

    # tokens/s ratios, and the same at equal work (MFU ratios): the plain loop trains full
    # 2048-token rows, ours tree leaves of 295-2048 tokens, whose tokens cost less attention
    ratios, flop_ratios = {}, {}
    for num, den in (("ours", "plain"), ("ours_fp32_master", "plain"), ("ours_auto", "plain"),
                     ("plain", "plain_unchunked"), ("plain_compiled", "plain"),
                     ("ours_compiled", "plain"), ("ours_compiled", "plain_compiled"),
                     ("ours_packed", "plain"), ("ours_packed", "ours"),
                     ("ours_packed_compiled", "plain_compiled")):
        if tps(num) and tps(den):
            ratios[f"{num}/{den}"] = tps(num) / tps(den)
        if mfu(num) and mfu(den):
            flop_ratios[f"{num}/{den}"] = mfu(num) / mfu(den)
    results["ratios"], results["flop_ratios"] = ratios, flop_ratios
    results["elapsed_s"] = time.perf_counter() - start
    save()
    tmp.cleanup()
    print(table(results))
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    results = main()
    if not results["args"]["tiny"]:
        # Everything is printed and written: skip interpreter teardown, where a compile worker
        # pool cut off by --budget-s or a live NCCL process group could hang the exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
