"""The prepared GPU check: one device call of at most 8 minutes on one H100 or H200 whose
image has torch but no vLLM (``scripts/gpu_check.sh`` runs it; ``scripts/gpu_prepare.sh``
builds what that call carries).

Sections, each recorded on its own (a failure is written down and the next one runs):

1. ``fit``: the demo under Lightning FSDP with the HF engine for 2 steps
   (``configs/demo.yaml`` + ``configs/demo_gpu.yaml``, ``--data.engine.kind=hf``, a smaller
   budget) on a prepared world (``--world``), in a subprocess with a time limit: its exit
   status, wall time and the last value of each logged ``train/``, ``perf/``, ``alloc/`` and
   ``rollout/`` scalar.
2. ``equivalence``: the packed update against the per-leaf one on the same Search-R1-shaped
   trees, loss and every parameter's gradient (backward included), the packed rows with the
   attention ``TraceModule`` picks on the device (CUDA: FlexAttention, which transformers
   compiles; CPU: ``tree_sdpa``), the per-leaf rows with plain causal SDPA. Float32 (TF32
   off) must agree to 1e-5 (loss and each gradient, relative to its norm). Bfloat16 cannot
   agree that closely with anything, so its test is that packing adds no more than bf16's
   own rounding: the packed bf16 loss and gradients' error against the float32 per-leaf
   ones is at most ``BF16_FACTOR`` times the per-leaf bf16 ones' error, plus ``BF16_SLACK``.
3. ``update``: tokens/s, MFU and peak memory of the packed Lightning update
   (``benchmarks/gpu.py``'s ``ours_packed``: ``TraceModule`` under FSDP, bf16-true) on a
   Qwen3-0.6B-shaped random-weight policy at 8,192-token packed rows.

Recompiles: dynamo's recompilations, counted from its ``recompiles`` log (what
``TORCH_LOGS=recompiles`` prints) per section, beside the graphs compiled.

    PYTHONPATH=. python benchmarks/gpu_check.py --world .devshare/world --out $OUT/gpu.json
    PYTHONPATH=. python benchmarks/gpu_check.py --tiny      # CPU: a tiny world and model

``--tiny`` runs every section on CPU (FSDP1 over gloo, a tiny demo world built in a temporary
folder, a 2-layer policy). Ends with one JSON line (also written to ``--out`` after every
section).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent


def load(name: str):
    """A sibling benchmark script as a module (``gpu.py`` first: it puts placeholders for
    modules the GPU image lacks before the library is imported)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gpu = load("gpu")
import torch  # noqa: E402
from lightning.fabric.utilities.apply_func import move_data_to_device  # noqa: E402

from trace_lightning.math.advantage import assign_advantages  # noqa: E402
from trace_lightning.math.loss import weighted_policy_loss  # noqa: E402
from trace_lightning.training.module import TraceModule, flex_attention_available  # noqa: E402
from trace_lightning.packing.leaves import collate, pack_microbatches  # noqa: E402
from trace_lightning.packing.attention import TREE_SDPA  # noqa: E402
from trace_lightning.packing.trees import (WEIGHT_KEYS, collate_units,  # noqa: E402
                                                   pack_rows, update_units)

FP32_RTOL = 1e-5  # packed vs per-leaf, float32: loss and each gradient (relative to its norm)
BF16_FACTOR, BF16_SLACK = 2.0, 1e-3  # packed bf16 error <= factor x per-leaf bf16's + slack
EQUIV_LAYERS = 4  # the equivalence policy: Qwen3-0.6B's widths, fewer layers
# the demo for 2 steps on a smaller budget than demo.yaml's (what the check needs: it runs)
FIT_BUDGET = ["--data.allocator.roots=32", "--data.candidates_per_step=64",
              "--trainer.max_epochs=2"]
# --tiny: demo_gpu.yaml's strategy as FSDP1 over gloo on CPU
CPU_FSDP_OVERLAY = """\
trainer:
  accelerator: cpu
  strategy:
    class_path: trace_lightning.training.strategies.CPUFSDPStrategy
    init_args:
      auto_wrap_policy:
        - transformers.models.qwen3.modeling_qwen3.Qwen3DecoderLayer
      state_dict_type: full
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU: tiny world and model (the tests)")
    p.add_argument("--world", type=Path, default=None,
                   help="a prepared demo world (scripts/gpu_prepare.sh copies one to "
                        ".devshare/world); --tiny builds its own")
    p.add_argument("--sections", default="fit,equivalence,update",
                   help="comma list of: fit, equivalence, update")
    p.add_argument("--fit-timeout-s", type=float, default=200.0,
                   help="the fit subprocess is stopped after this long")
    p.add_argument("--update-steps", type=int, default=None, help="timed steps (default 4)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="skip sections that would start after this many seconds")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    wanted = set(args.sections.split(","))
    if not wanted <= {"fit", "equivalence", "update"}:
        raise ValueError(f"--sections ({args.sections!r}): expected names among fit, "
                         f"equivalence, update")
    if "fit" in wanted and not args.tiny and args.world is None:
        raise ValueError("--world is required for the fit section off --tiny: run "
                         "scripts/gpu_prepare.sh and pass --world .devshare/world, or drop "
                         "fit from --sections")
    if args.update_steps is None:
        args.update_steps = 1 if args.tiny else 4
    return args


class RecompileCounter(logging.Handler):
    """Counts dynamo's "Recompiling function ..." records (its ``recompiles`` log)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.count = 0
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("Recompiling"):
            self.count += 1
            if len(self.reasons) < 5:
                self.reasons.append(msg[:400])


def watch_recompiles() -> RecompileCounter:
    torch._logging.set_logs(recompiles=True)
    counter = RecompileCounter()
    logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(counter)
    return counter


# ---- 1. the demo under FSDP ------------------------------------------------------------
def tiny_world(root: Path) -> Path:
    """A small demo world without a warm start (the check runs it; learning is not checked)."""
    from trace_lightning.tasks.search_qa.demo.prepare import prepare_demo

    out = root / "world"
    prepare_demo(out, warm_start_steps=0, n_people=40, n_cities=8, n_countries=4,
                 n_companies=8, n_questions=40, n_eval_questions=8, warm_questions=20,
                 model={"hidden_size": 64, "layers": 2, "intermediate": 128})
    return out


def section_fit(args, tmp: Path) -> dict:
    from trace_lightning.tasks.search_qa.demo.prepare import DemoPaths

    world = tiny_world(tmp) if args.tiny else args.world
    paths = DemoPaths.under(world)
    root = tmp / "fit"
    val = [{"name": "demo_heldout", "path": str(paths.eval_qa),
            "corpus": str(paths.eval_corpus), "limit": 8 if args.tiny else 50}]
    cmd = [sys.executable, "-m", "trace_lightning.cli", "fit",
           "--config", str(REPO / "configs" / "demo.yaml"),
           "--config", str(REPO / "configs" / "demo_gpu.yaml"),
           "--data.engine.kind=hf", "--data.task.init_args.demo=null",
           f"--model.policy_path={paths.model}",
           f"--data.task.init_args.train={paths.train_qa}",
           f"--data.task.init_args.corpus={paths.train_corpus}",
           f"--data.task.init_args.val={json.dumps(val)}", f"--trainer.default_root_dir={root}",
           f"--trainer.logger.init_args.save_dir={root}", f"--data.trees_dir={root / 'trees'}",
           *FIT_BUDGET]
    if args.tiny:  # FSDP1 on CPU over gloo (Lightning's FSDP refuses a CPU accelerator)
        overlay = tmp / "cpu_fsdp.yaml"
        overlay.write_text(CPU_FSDP_OVERLAY)
        cmd += ["--config", str(overlay), "--data.allocator.roots=4",
                "--data.candidates_per_step=8", "--data.allocator.group_size=2",
                "--data.allocator.cold_start_nodes=0"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=args.fit_timeout_s)
        rc, log = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        rc, log = "timeout", (e.stdout or b"").decode() + (e.stderr or b"").decode()
    out = {"exit": rc, "seconds": time.perf_counter() - t0, "command": " ".join(cmd[1:]),
           "log_tail": log[-2000:], "scalars": last_scalars(root)}
    if rc != 0:
        raise RuntimeError(f"the demo fit ended with {rc}: {log[-1500:]}")
    return out


def last_scalars(root: Path) -> dict:
    """The last value of each logged train/perf/alloc/rollout scalar, and how many steps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = sorted((root / "tensorboard").glob("version_*"))
    if not runs:
        return {}
    acc = EventAccumulator(str(runs[-1]), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [len(acc.Scalars(t)), acc.Scalars(t)[-1].value] for t in acc.Tags()["scalars"]
            if t.split("/")[0] in ("train", "perf", "alloc", "rollout")}


# ---- 2. packed against per-leaf --------------------------------------------------------
def equivalence_trees(s, model, n_trees: int) -> list:
    """Search-R1-shaped trees (``update.py``'s: leaves of 1,950 tokens at rows of 8,192,
    scaled with the rows) whose behaviour log-probs are the model's own plus noise (sd 0.3),
    so ratios clip on both sides."""
    update = load("update")
    scale = s.args.seq / 8192
    trees = update.search_r1_trees(s.config.vocab_size, s.args.seed, prompts=n_trees,
                                   prompt_len=max(2, int(300 * scale)),
                                   generated=max(1, int(100 * scale)),
                                   observed=max(1, int(450 * scale)))
    gen = torch.Generator().manual_seed(s.args.seed)
    for t in trees:
        for leaf in t.leaves():
            ids = torch.tensor([t.prefix_ids(leaf.id)], device=s.device)  # (1, L)
            with torch.no_grad():
                logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].cpu()
            start = 0
            for n in t.path(leaf.id):
                for i, m in enumerate(n.policy_mask):
                    if m:
                        n.logprobs[i] = float(lp[start + i - 1]
                                              + 0.3 * torch.randn((), generator=gen))
                start += len(n.token_ids)
        t.compute_values()
    return trees


def loss_and_grads(model, micro: list[dict], normalizer: float, device):
    """The step's loss and gradients over ``micro`` (as ``training_step`` sums them)."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for mb in micro:
        mb = move_data_to_device(mb, device)
        logp, ent = TraceModule._logprobs(model, mb, with_entropy=True)  # (B, T) each
        loss, _ = weighted_policy_loss(logp, mb["old_logprobs"].to(logp.dtype),
                                       {k: mb[k] for k in WEIGHT_KEYS},
                                       normalizer=normalizer, entropy=ent)
        loss.backward()
        total += float(loss)
    return total, {n: p.grad.float().clone() for n, p in model.named_parameters()}


def errors(got, want) -> dict:
    """Relative errors: the loss's, each gradient's (to its norm; the largest), all of them
    together."""
    (lg, g), (lw, w) = got, want
    per = {n: float((g[n] - w[n]).norm() / w[n].norm().clamp_min(1e-30)) for n in w}
    diff = sum(float((g[n] - w[n]).pow(2).sum()) for n in w) ** 0.5
    ref = sum(float(w[n].pow(2).sum()) for n in w) ** 0.5
    worst = max(per, key=per.get)
    return {"loss": abs(lg - lw) / max(abs(lw), 1e-30), "grad_max": per[worst],
            "grad_max_param": worst, "grad_all": diff / max(ref, 1e-30)}


def section_equivalence(s, path: Path) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    # TraceModule's "auto" on the device: FlexAttention on a CUDA trainer, else per node
    attn = "flex_attention" if s.cuda and flex_attention_available() else TREE_SDPA
    config = AutoConfig.from_pretrained(path)
    config.num_hidden_layers = min(config.num_hidden_layers, EQUIV_LAYERS)
    torch.manual_seed(s.args.seed)
    leaf_model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                  dtype=torch.float32).to(s.device).train()
    packed_model = AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                                    dtype=torch.float32).to(s.device).train()
    packed_model.load_state_dict(leaf_model.state_dict())
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        trees = equivalence_trees(s, leaf_model, n_trees=2)
        seqs = [q for t in trees for q in t.flatten()]
        for q, adv in zip(seqs, assign_advantages(seqs, trees, "grpo")):
            q.token_advantages = adv
        budget = s.args.batch * s.args.seq
        pairs = float(sum(sum(q.policy_mask) for q in seqs))
        leaf_micro = [collate([seqs[i] for i in g], 0,
                              advantages=[seqs[i].token_advantages for i in g])
                      for g in pack_microbatches(seqs, budget)]
        units = [u for t in trees for u in update_units(
            t, [q for q in seqs if q.tree_id == t.tree_id], budget)]
        packed_micro = [collate_units([[units[j] for j in row] for row in rows], 0)
                        for rows in pack_rows([len(u) for u in units], budget)]
        out = {"attention": attn, "layers": config.num_hidden_layers, "leaves": len(seqs),
               "leaf_tokens": sum(len(q.input_ids) for q in seqs),
               "packed_tokens": sum(len(u) for u in units),
               "packed_rows": [list(mb["input_ids"].shape) for mb in packed_micro]}
        ref = loss_and_grads(leaf_model, leaf_micro, pairs, s.device)
        out["float32"] = errors(loss_and_grads(packed_model, packed_micro, pairs, s.device), ref)
        leaf_model.to(torch.bfloat16)
        packed_model.to(torch.bfloat16)
        leaf16 = loss_and_grads(leaf_model, leaf_micro, pairs, s.device)
        packed16 = loss_and_grads(packed_model, packed_micro, pairs, s.device)
        out["bfloat16"] = {"packed_vs_float32": errors(packed16, ref),
                           "leaf_vs_float32": errors(leaf16, ref),
                           "packed_vs_leaf": errors(packed16, leaf16)}
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    f32, b16 = out["float32"], out["bfloat16"]
    out["tolerance"] = {"float32": FP32_RTOL, "bfloat16": f"packed error vs float32 <= "
                        f"{BF16_FACTOR} x per-leaf bf16 error + {BF16_SLACK}"}
    out["float32_ok"] = f32["loss"] <= FP32_RTOL and f32["grad_max"] <= FP32_RTOL
    out["bfloat16_ok"] = all(
        b16["packed_vs_float32"][k] <= BF16_FACTOR * b16["leaf_vs_float32"][k] + BF16_SLACK
        for k in ("loss", "grad_all"))
    del leaf_model, packed_model
    s.free()
    if not (out["float32_ok"] and out["bfloat16_ok"]):
        raise AssertionError(f"packed and per-leaf updates disagree: {json.dumps(out)[:1500]}")
    return out


# ---- 3. the update at Qwen3-0.6B's shape -----------------------------------------------
def update_setup(args) -> object:
    """``gpu.py``'s setup: Qwen3-0.6B-shaped, bf16, micro-batches of one 8,192-token row of
    ``update.py``'s Search-R1-shaped trees, 4 per optimizer step (``--tiny``: its tiny shape
    on CPU, rows of 256 and trees scaled to match)."""
    argv = ["--batch", "1", "--seq", "256" if args.tiny else "8192", "--accum", "4",
            "--tree-seq", "64" if args.tiny else "2048",
            "--steps", str(args.update_steps), "--warmup", "1" if args.tiny else "2",
            "--seed", str(args.seed)]
    return gpu.Setup(gpu.parse_args(argv + (["--tiny"] if args.tiny else [])))


# ---- driver ----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    recompiles = watch_recompiles()
    s = update_setup(args)
    results: dict = {"check": "gpu", "args": {k: (str(v) if isinstance(v, Path) else v)
                                              for k, v in vars(args).items()},
                     "environment": gpu.environment(s), "peak_flops": gpu.PEAK_FLOPS,
                     "shape": s.shape}

    def save() -> None:
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))

    tmp_dir = tempfile.TemporaryDirectory(prefix="trace_gpu_check_")
    tmp = Path(tmp_dir.name)
    policy = tmp / "policy"
    wanted = args.sections.split(",")

    def run(name: str, fn) -> None:
        if name not in wanted:
            return
        if time.perf_counter() - start > args.budget_s:
            results[name] = {"skipped": f"--budget-s {args.budget_s:.0f} reached"}
            save()
            return
        print(f"[{name}] running", flush=True)
        t0, r0, g0 = time.perf_counter(), recompiles.count, gpu.compiled_graphs()
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001 - record it, run the next section
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
            s.free()
        results[name].update(section_s=time.perf_counter() - t0,
                             recompiles=recompiles.count - r0,
                             graphs_compiled=gpu.compiled_graphs() - g0)
        print(f"[{name}] {json.dumps(results[name])[:2000]}", flush=True)
        save()

    run("fit", lambda: section_fit(args, tmp))
    if {"equivalence", "update"} & set(wanted):
        results["model"] = gpu.build_model(s, policy)
    run("equivalence", lambda: section_equivalence(s, policy))
    run("update", lambda: gpu.section_ours(s, policy, packed=True))
    results["recompiles"] = {"total": recompiles.count, "first_reasons": recompiles.reasons}
    results["passed"] = all(name in results and "error" not in results[name]
                            and "skipped" not in results[name] for name in wanted)
    results["elapsed_s"] = time.perf_counter() - start
    save()
    tmp_dir.cleanup()
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    out = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if out["passed"] else 1)  # a live process group could hang the teardown
