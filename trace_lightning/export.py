"""The trained policy as a Hugging Face directory: what transformers, vLLM (``vllm serve DIR``)
and evaluation harnesses load.

Two ways out of a run:

- ``callbacks.ExportPolicy`` writes it from the live run (at the end of ``fit``, and every n
  epochs if asked), gathering FSDP shards onto rank 0's CPU.
- ``trace-lightning-export CKPT OUT`` converts a Lightning checkpoint afterwards: a checkpoint
  file (``state_dict_type: full``, the CPU demo's ``last.ckpt``) or a sharded FSDP checkpoint
  directory (``state_dict_type: sharded``, the GPU config), read without a process group.

The directory holds the policy's config and weights (safetensors), the tokenizer from the
run's ``policy_path``, and ``trace_lightning.json`` (what it was exported from). It is written
next to its destination and renamed into place, so an interrupted export never leaves half a
model where a complete one was.
"""

from __future__ import annotations

import argparse
import json
import shutil
import warnings
from pathlib import Path

import torch
from torch import nn

POLICY_PREFIX = "policy."  # TraceModule.policy in the LightningModule's state dict
META_FILE = "trace_lightning.json"


def policy_state(module_state: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """The policy's weights, HF-named, from a TraceModule state dict (``policy.`` stripped;
    the predictor and a KL reference are left behind)."""
    state = {k[len(POLICY_PREFIX):]: v for k, v in module_state.items()
             if k.startswith(POLICY_PREFIX)}
    if not state:
        some = ", ".join(list(module_state)[:3]) or "none"
        raise ValueError(f"{source}: no {POLICY_PREFIX!r} weights (keys start: {some}); "
                         f"give a checkpoint written by `trace-lightning fit`")
    return state


def save_policy(state: dict[str, torch.Tensor], policy_path: str | Path, out: str | Path,
                dtype: str | None = None, meta: dict | None = None) -> Path:
    """Write ``state`` (HF names) as a ``save_pretrained`` directory at ``out``.

    Args:
        state: the policy's full weights.
        policy_path: the run's ``model.policy_path``: its config (architecture) and tokenizer.
        out: the directory to write; replaced if it exists.
        dtype: cast the weights ("bfloat16", "float16", "float32"); None keeps the trained
            dtype (fp32 master weights stay fp32).
        meta: more to record in ``trace_lightning.json`` (step, epoch, source).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    if dtype is not None:
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"export dtype {dtype!r} is not a torch dtype; use 'bfloat16', "
                             f"'float16' or 'float32' (or none to keep the trained dtype)")
        state = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v
                 for k, v in state.items()}
    config = AutoConfig.from_pretrained(policy_path)
    weight_dtype = next(v.dtype for v in state.values() if v.is_floating_point())
    with torch.device("meta"):  # no second copy of the weights: load_state_dict assigns them
        model = AutoModelForCausalLM.from_config(config, dtype=weight_dtype)
    _load_exactly(model, state, policy_path)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(policy_path).save_pretrained(tmp)
    info = {"policy_path": str(policy_path), "dtype": str(weight_dtype).removeprefix("torch."),
            **(meta or {})}
    (tmp / META_FILE).write_text(json.dumps(info, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _load_exactly(model: nn.Module, state: dict[str, torch.Tensor], policy_path) -> None:
    """Assign ``state`` to a meta-device ``model``; every parameter must be given (a tied LM
    head may be absent: it is the embedding)."""
    expected = set(model.state_dict())
    tied = {k for k in expected - set(state) if k.endswith("lm_head.weight")} \
        if getattr(model.config, "tie_word_embeddings", False) else set()
    missing, unexpected = sorted(expected - set(state) - tied), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"the weights do not fit the architecture of {policy_path} "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]}); export with "
                         f"the policy_path the run trained (see its hparams.yaml)")
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()  # one tensor again where a checkpoint stored two copies


def read_checkpoint(ckpt: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The module state dict and the hyper-parameters of a Lightning checkpoint: a file, or a
    sharded FSDP directory (``meta.pt`` + ``*.distcp``), read on this process alone."""
    path = Path(ckpt)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist; runs write it under "
                                f"<default_root_dir>/tensorboard/version_N/checkpoints/")
    if path.is_file():
        # a trace-lightning checkpoint holds the DataModule's numpy RNG state, which
        # weights_only loading refuses: load only checkpoints you wrote yourself
        data = torch.load(path, map_location="cpu", weights_only=False)
        if "state_dict" not in data:
            raise ValueError(f"{path} is not a Lightning checkpoint (no 'state_dict')")
        return data["state_dict"], data.get("hyper_parameters", {})
    meta_file = path / "meta.pt"
    if not meta_file.exists():
        raise ValueError(f"{path} is a directory without meta.pt: not a sharded Lightning "
                         f"checkpoint; give the .ckpt file or directory Lightning wrote")
    meta = torch.load(meta_file, map_location="cpu", weights_only=False)
    return _read_sharded_model(path), meta.get("hyper_parameters", {})


def _read_sharded_model(path: Path) -> dict[str, torch.Tensor]:
    """The ``model`` entry of a distributed (DCP) checkpoint, without its optimizer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(path))
    entries = reader.read_metadata().state_dict_metadata
    model = {k[len("model."):]: torch.empty(md.size, dtype=md.properties.dtype)
             for k, md in entries.items()
             if k.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    if not model:
        raise ValueError(f"{path}: no model weights in this distributed checkpoint")
    state = {"model": model}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state["model"]


def export_checkpoint(ckpt: str | Path, out: str | Path, dtype: str | None = None,
                      policy_path: str | None = None) -> Path:
    """``save_policy`` from a Lightning checkpoint written by ``trace-lightning fit``."""
    module_state, hparams = read_checkpoint(ckpt)
    policy_path = policy_path or hparams.get("policy_path")
    if not policy_path:
        raise ValueError(f"{ckpt} records no model.policy_path; pass --policy-path (the "
                         f"directory the run's policy was loaded from)")
    return save_policy(policy_state(module_state, str(ckpt)), policy_path, out, dtype,
                       meta={"checkpoint": str(Path(ckpt).resolve())})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="trace-lightning-export",
        description="Write a trace-lightning checkpoint's policy as a Hugging Face directory "
                    "(transformers, vLLM).")
    p.add_argument("ckpt", help="last.ckpt (a file) or a sharded FSDP checkpoint directory")
    p.add_argument("out", help="directory to write (replaced if it exists)")
    p.add_argument("--dtype", default=None,
                   help="cast weights, e.g. bfloat16 (default: as trained)")
    p.add_argument("--policy-path", default=None,
                   help="config and tokenizer source (default: the run's model.policy_path)")
    args = p.parse_args(argv)
    try:
        out = export_checkpoint(args.ckpt, args.out, args.dtype, args.policy_path)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"trace-lightning-export: {e}") from e
    print(f"policy written to {out}")


if __name__ == "__main__":
    main()
