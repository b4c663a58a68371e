"""The trained policy as a Hugging Face directory: what transformers, vLLM (``vllm serve DIR``)
and evaluation harnesses load.

Two ways out of a run:

- ``callbacks.ExportPolicy`` writes it from the live run (at the end of ``fit``, and every n
  epochs if asked), gathering FSDP shards onto rank 0's CPU.
- ``trace-lightning-export CKPT OUT`` converts a Lightning checkpoint afterwards: a checkpoint
  file (``state_dict_type: full``, the CPU demo's ``last.ckpt``) or a sharded FSDP checkpoint
  directory (``state_dict_type: sharded``, the GPU config), read without a process group.

The directory holds the policy's config and weights (safetensors), the tokenizer and the
generation config (eos ids, sampling defaults) from the run's ``policy_path``, and
``trace_lightning.json``: what it was exported from, and ``files``, the manifest of every file
the export wrote (itself included).

What an export guarantees:

- It replaces only what an export wrote. An existing ``out`` must be an empty folder or a
  previous export holding nothing but its manifest's files; anything else there (notes,
  results, a folder of one's own) is refused before any work, naming the files and the fix
  (move them out, or export elsewhere), and checked again just before the swap. An export
  without a manifest (a ``trace_lightning.json`` without ``files``) counts as the
  export's only the top-level files named as ``save_pretrained`` names a causal LM's and
  its tokenizer's (``LEGACY_EXPORT_FILES``). A file, a symbolic link, or a folder that is or
  holds the checkpoint or policy_path being read is refused too.
- Nothing is lost at any moment. The new export is written in a fresh folder beside ``out``
  (``<out>.partial-XXXXXXXX/``, made by ``tempfile.mkdtemp``) and swapped in by renames
  (``replace_dir``); a complete model is at ``out`` at every moment, or, killed between the
  two renames, inside ``<out>.old-XXXXXXXX/``.
- Nothing else is deleted: no fixed temporary name is taken (a ``<out>.partial`` or
  ``<out>.old`` of one's own is left alone), and only the folders this process made are
  cleaned up, on failure too. What a kill leaves (``<out>.partial-*`` holding a half-written
  export, or ``<out>.old-*`` holding the previous one) no later export deletes: delete it,
  or move the previous export back, yourself.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from trace_lightning.folders import replace_dir
from trace_lightning.hub import is_local_path
from trace_lightning.training.checkpoints import read_checkpoint, reason

if TYPE_CHECKING:
    from transformers import GenerationConfig

log = logging.getLogger(__name__)

POLICY_PREFIX = "policy."  # TraceModule.policy in the LightningModule's state dict
META_FILE = "trace_lightning.json"
# What an export without a manifest holds, as save_pretrained names a causal LM's config,
# weights and generation config and a tokenizer's files: top-level files only
LEGACY_EXPORT_FILES = (META_FILE, "config.json", "generation_config.json", "model*.safetensors",
                       "model.safetensors.index.json", "tokenizer*", "special_tokens_map.json",
                       "added_tokens.json", "chat_template.*", "vocab.*", "merges.txt")
ELSEWHERE = "give another output folder (trace-lightning-export's OUT, ExportPolicy's dirpath)"
EXPORT_DTYPES = "bfloat16, float16, float32 or float64"


def export_dtype(dtype: str | None) -> torch.dtype | None:
    """The torch dtype to cast an export to (None: as trained).

    Only floating dtypes of 16 bits or more: an integer or bool cast would destroy the weights
    (and leave no floating tensor to build the model in), and a bare float8 cast, without
    scales, is not a format that transformers or vLLM serve.
    """
    if dtype is None:
        return None
    torch_dtype = getattr(torch, dtype, None)
    if not (isinstance(torch_dtype, torch.dtype) and torch_dtype.is_floating_point
            and torch_dtype.itemsize >= 2):
        raise ValueError(f"--dtype / ExportPolicy dtype ({dtype!r}) is not a floating torch "
                         f"dtype to export in; use {EXPORT_DTYPES} (or none to keep the "
                         f"trained dtype)")
    return torch_dtype


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
        out: the directory to write; if it exists it must be empty or a previous export
            holding only the files an export writes (see ``check_out``), which is replaced.
        dtype: cast the weights ("bfloat16", "float16", "float32", "float64"); None keeps
            the trained dtype (fp32 master weights stay fp32).
        meta: more to record in ``trace_lightning.json`` (step, epoch, source).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    cast = export_dtype(dtype)
    check_out(out, [policy_path])
    if cast is not None:
        state = {k: v.to(cast) if v.is_floating_point() else v for k, v in state.items()}
    config = AutoConfig.from_pretrained(policy_path)
    weight_dtype = next(v.dtype for v in state.values() if v.is_floating_point())
    with torch.device("meta"):  # no second copy of the weights: load_state_dict assigns them
        model = AutoModelForCausalLM.from_config(config, dtype=weight_dtype)
    _load_exactly(model, state, policy_path)
    # a model built from its config carries a default generation config: without the
    # source's, generate() and vLLM would lose its eos ids and sampling defaults
    generation = _generation_config(policy_path)
    if generation is not None:
        model.generation_config = generation
    out.parent.mkdir(parents=True, exist_ok=True)
    # a fresh folder of this process's (mode 0700 while it is written); the export inside it
    # gets the usual permissions
    staging = Path(tempfile.mkdtemp(prefix=f"{out.name}.partial-", dir=out.parent))
    tmp = staging / out.name
    try:
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(policy_path).save_pretrained(tmp)
        files = sorted([*(p.relative_to(tmp).as_posix() for p in tmp.rglob("*")
                          if not p.is_dir()), META_FILE])
        info = {"policy_path": str(policy_path),
                "dtype": str(weight_dtype).removeprefix("torch."), **(meta or {}),
                "files": files}
        (tmp / META_FILE).write_text(json.dumps(info, indent=1) + "\n")
        check_out(out, [policy_path])  # again: what was put there meanwhile is refused too
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # empty, or a failed export's half
    return out


def check_out(out: str | Path, sources: Iterable[str | Path | None] = ()) -> None:
    """Refuse, with a FileExistsError naming the folder, why and the fix, an ``out`` whose
    replacement would lose data. It may be missing, an empty folder or a previous export
    holding nothing ``foreign_files`` finds; not a file, a symbolic link (the swap would
    replace the link, not its folder), nor one of ``sources`` (the checkpoint and policy_path
    being read) or a folder above one."""
    out = Path(out)
    for source in sources:
        if source is None or not Path(source).exists():  # None, or a hub id
            continue
        resolved = Path(source).resolve()
        if resolved == out.resolve() or out.resolve() in resolved.parents:
            raise FileExistsError(
                f"output directory {out} holds {source}, which this export reads: replacing "
                f"{out} would delete it; choose a new directory for the export")
    if out.is_symlink():
        raise FileExistsError(
            f"output directory {out} is a symbolic link (to {out.readlink()}): an export "
            f"replaces its folder by renames, which would replace the link, not what it "
            f"points to; give the folder itself ({out.resolve()}), or {ELSEWHERE}")
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(
            f"output directory {out} exists and is a file, not a folder: replacing it would "
            f"delete it; move it away, or {ELSEWHERE}")
    foreign = foreign_files(out)
    if not foreign:
        return
    names = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5
                                      else "")
    if not (out / META_FILE).is_file():
        raise FileExistsError(
            f"output directory {out} exists and is not a previous export (no {META_FILE} in "
            f"it): replacing it would delete its files ({names}); move them out of {out}, "
            f"or {ELSEWHERE}")
    raise FileExistsError(
        f"output directory {out} is a previous export that also holds files no export wrote "
        f"({names}): replacing it would delete them; move them out of {out}, or {ELSEWHERE}")


def foreign_files(out: Path) -> list[str]:
    """What in the folder ``out`` no export wrote, as sorted paths relative to it (a folder
    with nothing in it ends in ``/``): all of it where it holds no ``trace_lightning.json``;
    what its ``files`` (the manifest) does not list; for an export without a manifest
    (no ``files``, or a record that does not parse), what ``LEGACY_EXPORT_FILES`` does not
    name."""
    if not (out / META_FILE).is_file():
        return list(_entries(out, out))
    listed = _manifest(out)
    if listed is None:
        return [rel for rel in _entries(out, out) if not any(
            fnmatch.fnmatchcase(rel, pattern) and "/" not in rel
            for pattern in LEGACY_EXPORT_FILES)]
    return [rel for rel in _entries(out, out) if rel not in listed]


def _entries(folder: Path, root: Path) -> Iterator[str]:
    """Every file, link and empty folder under ``folder``, relative to ``root``, sorted."""
    for path in sorted(folder.iterdir()):
        rel = path.relative_to(root).as_posix()
        if path.is_dir() and not path.is_symlink():
            inner = list(_entries(path, root))
            yield from inner or [f"{rel}/"]
        else:
            yield rel


def _manifest(out: Path) -> set[str] | None:
    """The ``files`` listed in ``out``'s ``trace_lightning.json``, or None where it lists
    none (an export without a manifest) or does not parse."""
    try:
        info = json.loads((out / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    files = info.get("files") if isinstance(info, dict) else None
    if not (isinstance(files, list) and all(isinstance(f, str) for f in files)):
        return None
    return set(files)


def _generation_config(policy_path: str | Path) -> GenerationConfig | None:
    """The ``GenerationConfig`` of ``policy_path``, or None where it has none.

    A directory without ``generation_config.json`` has none; one that is there must load (a
    broken one is an error, not a silent default). For a hub id transformers raises OSError
    when the repository has no such file (its config and tokenizer load)."""
    from transformers import GenerationConfig
    from transformers.utils import GENERATION_CONFIG_NAME

    if Path(policy_path).is_dir():
        if not (Path(policy_path) / GENERATION_CONFIG_NAME).is_file():
            return None
        return GenerationConfig.from_pretrained(policy_path)
    try:
        return GenerationConfig.from_pretrained(policy_path)
    except OSError:  # the hub repository has no generation_config.json
        return None


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


def _check_policy_path(policy_path: str, ckpt: str | Path, given: bool) -> None:
    """Fail before transformers does (its error names neither the flag nor the checkpoint)
    when ``policy_path`` is local (``is_local_path``) but not a directory, typically a
    relative path recorded by a run started from another working directory, or when its
    config or tokenizer does not load (no config.json, a hub id not downloaded)."""
    from transformers import AutoConfig, AutoTokenizer

    if is_local_path(policy_path) and not Path(policy_path).is_dir():
        problem = f"does not exist (as a directory) from {Path.cwd()}"
    else:
        try:
            AutoConfig.from_pretrained(policy_path)
            AutoTokenizer.from_pretrained(policy_path)
            return
        except (OSError, ValueError) as e:
            problem = f"does not load as a transformers config and tokenizer ({reason(e)})"
    if given:
        raise FileNotFoundError(
            f"--policy-path {policy_path} {problem}; give the directory the run's policy was "
            f"loaded from (or a hub id, owner/name)")
    raise FileNotFoundError(
        f"{ckpt} records model.policy_path={policy_path}, which {problem}; pass --policy-path "
        f"DIR (the directory the run's policy was loaded from)")


def export_checkpoint(ckpt: str | Path, out: str | Path, dtype: str | None = None,
                      policy_path: str | None = None) -> Path:
    """``save_policy`` from a Lightning checkpoint written by ``trace-lightning fit``.

    ``policy_path`` (``--policy-path``) overrides the run's recorded ``model.policy_path``.
    Either must be an existing directory or a hub id; what ``is_local_path`` calls local but
    is not a directory is an error naming ``--policy-path``. ``dtype`` and ``out`` are
    checked before the checkpoint is read."""
    export_dtype(dtype)
    check_out(out, [ckpt, policy_path])
    module_state, hparams = read_checkpoint(ckpt)
    given = bool(policy_path)
    policy_path = policy_path or hparams.get("policy_path")
    if not policy_path:
        raise ValueError(f"{ckpt} records no model.policy_path; pass --policy-path (the "
                         f"directory the run's policy was loaded from)")
    _check_policy_path(str(policy_path), ckpt, given)
    return save_policy(policy_state(module_state, str(ckpt)), policy_path, out, dtype,
                       meta={"checkpoint": str(Path(ckpt).resolve())})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="trace-lightning-export",
        description="Write a trace-lightning checkpoint's policy as a Hugging Face directory "
                    "(transformers, vLLM).",
        epilog="The export is written in a fresh folder beside OUT (OUT.partial-XXXXXXXX) and "
               "swapped in by renames: killed at any moment, it leaves a complete model at "
               "OUT or, between the two renames, the previous one in OUT.old-XXXXXXXX. It "
               "replaces an empty OUT or a previous export, and deletes nothing else.")
    p.add_argument("ckpt", help="last.ckpt (a file) or a sharded FSDP checkpoint directory")
    p.add_argument("out", metavar="OUT",
                   help=f"directory to write; if it exists it must be empty or a previous "
                        f"export holding only what an export writes (the files listed in its "
                        f"{META_FILE}), which is replaced by renames; other files there are "
                        f"refused, never deleted")
    p.add_argument("--dtype", default=None,
                   help="cast weights, e.g. bfloat16 (default: as trained)")
    p.add_argument("--policy-path", default=None,
                   help="config and tokenizer source (default: the run's model.policy_path)")
    args = p.parse_args(argv)
    try:
        out = export_checkpoint(args.ckpt, args.out, args.dtype, args.policy_path)
    except (OSError, ValueError) as e:  # ours name the file or flag and the fix
        raise SystemExit(f"trace-lightning-export: {e}") from e
    print(f"policy written to {out}")


if __name__ == "__main__":
    main()
