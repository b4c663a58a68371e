"""Reading a Lightning checkpoint, and checking it before a run loads it: which are intact.

``checkpoint_meta`` reads a checkpoint's contents without its tensors and ``read_checkpoint``
its module state and hyper-parameters (a file, or a sharded FSDP folder), each naming what
is wrong with a path that is no checkpoint (the export and the CLI read through them).

``check_checkpoint`` runs in the DataModule's setup, before the engine starts (Lightning
loads the checkpoint only after it, and would fail there, or not at all: a damaged optimizer
state loads silently and shows as bad rewards an epoch later). It checks, and names the
checkpoint and the first bad entry:

- keys and shapes: the weights (``state_dict``) hold exactly this run's policy, reference
  (``--model.kl_coef`` > 0) and predictor, with their shapes, as Lightning's strict load
  wants; each AdamW moment has its parameter's shape. The expected shapes come from models
  built on the meta device from the policy's config (no memory, no weights read).
- bytes: every record of the file matches the CRC-32 that ``torch.save`` wrote for it (a
  flipped bit or a bad copy since the save).
- values: every floating tensor is finite, and AdamW's second moments are >= 0 (what a
  run that diverged would have saved, CRC and all).

``fit`` checks everything it loads: the weights, the optimizer states and the module's own
state (``checkpoint["trace"]``: replay, predictor optimizer); ``validate`` loads only the
weights and checks only those. Cost: the file is memory-mapped (no copy in memory); the
values check reads each checked tensor once through the page cache (a minimum and maximum
per 16M values), the CRC check reads its records again (from the cache when it holds the
file), and a file not yet in the cache is read at the disk's speed. The expected shapes
cost a model on the meta device (no memory for its weights). A sharded (FSDP) checkpoint's
keys and shapes are checked from its metadata; its values, which only the distributed
loader reads, are not.
"""

from __future__ import annotations

import math
import struct
import textwrap
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn


CHUNK = 1 << 24  # elements tested at a time (a 16 MB mask where values are counted)
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter state besides its step


# --ckpt_path values Lightning resolves itself (not files)
LIGHTNING_CKPT_KEYS = ("best", "last", "hpc", "registry")


def local_checkpoint_meta(path: str) -> dict | None:
    """Before the engine starts: the checkpoint ``--ckpt_path`` resolved to (``path``), read
    without its tensors (``checkpoint_meta``), or None for a value Lightning resolves itself
    ("registry:<name>", a URL). A path not on this process's file system, or not a Lightning
    checkpoint, is one error naming the flag."""
    if "://" in path or path.split(":")[0] in LIGHTNING_CKPT_KEYS:
        return None
    if not Path(path).exists():
        raise FileNotFoundError(f"--ckpt_path: checkpoint {path!r} does not exist on this "
                                f"process's file system; give the path of a .ckpt file "
                                f"(or a sharded checkpoint's folder) every process sees")
    try:
        return checkpoint_meta(path)
    except ValueError as e:
        raise ValueError(f"--ckpt_path: {e}") from None


def check_checkpoint(path: str | Path, data: dict, policy_dir: str, fitting: bool,
                     new_predictor: Callable[[Any], nn.Module], reference: bool,
                     settings: str) -> None:
    """Raise a ValueError naming ``path`` and its first bad entry, if any (see the module's
    docstring). ``data``: the checkpoint memory-mapped (``checkpoint_meta``; a sharded
    checkpoint's ``meta.pt``); ``policy_dir``: the policy's local directory; ``fitting``:
    check what ``fit`` loads, not only the weights; ``new_predictor(config)``: the run's
    predictor for a policy config; ``reference``: the run keeps a frozen reference copy of
    the policy; ``settings``: the flags that shape the model, named in a mismatch."""
    path = Path(path)
    weights, params = expected_shapes(policy_dir, new_predictor, reference)
    sharded = path.is_dir()
    if sharded:
        saved, optimizer = _sharded_shapes(path)
    else:
        saved = {k: tuple(v.shape) for k, v in data.get("state_dict", {}).items()}
        optimizer = _optimizer_shapes(data.get("optimizer_states", [])[:1], params)
    _check_shapes(path, weights, saved, params, optimizer if fitting else {}, settings)
    checked = ["state_dict", "optimizer_states", "trace"] if fitting else ["state_dict"]
    entries = [(name, t) for key in checked for name, t in tensors(data.get(key), key)]
    if not sharded:
        _check_records(path, entries, whole_file=fitting)
    for name, t in entries:
        _check_values(path, name, t, params)


def expected_shapes(policy_dir: str, new_predictor: Callable[[Any], nn.Module], reference: bool
                    ) -> tuple[dict[str, tuple], dict[str, list]]:
    """This run's ``state_dict`` shapes ({key: shape}), and each optimizer's parameters in
    its order ({"policy"/"predictor": [(name, shape)]}), from models on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from trace_lightning.training.module import without_dropout

    config = without_dropout(AutoConfig.from_pretrained(policy_dir))
    with torch.device("meta"):
        models = {"policy": AutoModelForCausalLM.from_config(config),
                  "predictor": new_predictor(config)}
    if reference:
        models["reference"] = models["policy"]  # a frozen copy of the policy
    weights = {f"{prefix}.{k}": tuple(v.shape) for prefix, model in models.items()
               for k, v in model.state_dict().items()}
    params = {prefix: [(f"{prefix}.{n}", tuple(p.shape))
                       for n, p in models[prefix].named_parameters()]
              for prefix in ("policy", "predictor")}
    return weights, params


def tensors(obj, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in ``obj`` (nested dicts, lists and tuples) with its place in it:
    ``optimizer_states[0]['state'][3]['exp_avg_sq']``."""
    if isinstance(obj, torch.Tensor):
        yield name, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{name}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{name}[{i}]")


def _optimizer_shapes(states: list[dict], params: dict[str, list]) -> dict[str, tuple]:
    """The saved shapes of the policy optimizer's moments ({name: shape}), and a count
    entry when it holds another number of parameters than this run's policy."""
    out: dict[str, tuple] = {}
    for i, state in enumerate(states):
        names = [n for n, _ in params["policy"]]
        count = sum(len(g.get("params", [])) for g in state.get("param_groups", []))
        if count != len(names):
            out[f"optimizer_states[{i}] parameters"] = (count,)
        for idx, moments in state.get("state", {}).items():
            for key in MOMENTS:
                if isinstance(idx, int) and idx < len(names) and key in moments:
                    out[f"{names[idx]} {key}"] = tuple(moments[key].shape)
    return out


def _sharded_shapes(path: Path) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """A sharded checkpoint's weight shapes and its policy optimizer's moment shapes, from
    its metadata (``model.<key>``, ``optimizer_0.state.<param>.<moment>``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        entries = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - a missing or damaged .metadata: name it
        raise ValueError(f"--ckpt_path: {path} is a sharded checkpoint whose metadata does not "
                         f"load ({type(e).__name__}: {e}); it is cut short (a stop during the "
                         f"save) or damaged: give another checkpoint of the run") from e
    shapes = {k: tuple(md.size) for k, md in entries.items()
              if isinstance(md, TensorStorageMetadata)}
    weights = {k[len("model."):]: v for k, v in shapes.items() if k.startswith("model.")}
    optimizer = {}
    for k, shape in shapes.items():
        head, _, key = k.rpartition(".")
        if k.startswith("optimizer_0.state.") and key in MOMENTS:
            optimizer[f"{head[len('optimizer_0.state.'):]} {key}"] = shape
    return weights, optimizer


def _check_shapes(path: Path, weights: dict, saved: dict, params: dict, optimizer: dict,
                  settings: str) -> None:
    missing = [k for k in weights if k not in saved]
    unexpected = [k for k in saved if k not in weights]
    wrong = [f"{k} {saved[k]} (this run's: {weights[k]})" for k in weights
             if k in saved and saved[k] != weights[k]]
    own = {f"{n} {key}": shape for n, shape in params["policy"] for key in MOMENTS}
    wrong += [f"{k} {shape} (this run's: {own[k]})" for k, shape in optimizer.items()
              if k in own and shape != own[k]]
    wrong += [f"{k} {shape[0]} (this run's: {len(params['policy'])})"
              for k, shape in optimizer.items() if k.endswith(" parameters")]
    if not (missing or unexpected or wrong):
        return
    listed = "; ".join(f"{what}: {', '.join(keys[:3])}" + (f" and {len(keys) - 3} more"
                                                            if len(keys) > 3 else "")
                       for what, keys in (("missing", missing), ("unexpected", unexpected),
                                          ("other shapes", wrong)) if keys)
    raise ValueError(
        f"--ckpt_path: {path} does not fit this run's model ({listed}); it was written by a "
        f"run of another policy or settings ({settings}): give a checkpoint of this model, or "
        f"use the settings of the run that wrote it")


def _check_records(path: Path, entries: list[tuple[str, torch.Tensor]],
                   whole_file: bool) -> None:
    """Every record of the file that holds a checked entry (``whole_file``: every record)
    has the CRC-32 ``torch.save`` wrote for it. A record without a CRC (a writer that
    skipped them: 0) is not checked."""
    with zipfile.ZipFile(path) as zf:
        held = _entries_by_record(zf, entries)
        for info in zf.infolist():
            name = info.filename
            inside = (held or {}).get(name, [])
            unchecked = "/data/" in name and held is not None and not inside  # a tensor's
            if info.CRC == 0 or (unchecked and not whole_file):
                continue
            try:
                with zf.open(info) as f:
                    while f.read(1 << 24):
                        pass
            except zipfile.BadZipFile as e:
                what = f"{', '.join(inside[:2])} (record {name})" if inside else f"record {name}"
                raise ValueError(
                    f"--ckpt_path: {path} is damaged: {what} differs from what was saved "
                    f"({e}: a flipped bit, a bad disk or an interrupted copy since the save); "
                    f"resume from another checkpoint of the run, or copy this one again from "
                    f"where it is intact") from None


def _entries_by_record(zf: zipfile.ZipFile, entries: list[tuple[str, torch.Tensor]],
                       ) -> dict[str, list[str]] | None:
    """{record name: the entries whose storage it is}, or None when the tensors are not
    views of the mapped file (then every record is checked, and named by itself).

    Memory-mapped, each storage starts at its record's data in one mapping of the file, so
    its address minus its record's offset is the same for all: the lowest address belongs
    to the first record."""
    offsets = {}
    for info in zf.infolist():
        if "/data/" in info.filename and info.file_size > 0:
            zf.fp.seek(info.header_offset + 26)  # the local header's name and extra lengths
            name_len, extra_len = struct.unpack("<HH", zf.fp.read(4))
            offsets[info.header_offset + 30 + name_len + extra_len] = info.filename
    starts = {}
    for name, t in entries:
        storage = t.untyped_storage()
        if storage.nbytes() > 0:
            starts.setdefault(storage.data_ptr(), []).append(name)
    if not offsets or not starts:
        return None
    base = min(starts) - min(offsets)
    if any(ptr - base not in offsets for ptr in starts):
        return None
    return {offsets[ptr - base]: names for ptr, names in starts.items()}


def _check_values(path: Path, name: str, t: torch.Tensor, params: dict) -> None:
    """``t`` is finite, and an AdamW second moment is >= 0. Each chunk's minimum and
    maximum tell (NaN propagates to both); the bad values are counted
    only for the message."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    flat = t.reshape(-1)  # a view of the mapped file (weights and moments are contiguous)
    second = name.endswith("['exp_avg_sq']")
    chunks = [flat[start:start + CHUNK] for start in range(0, flat.numel(), CHUNK)]
    for chunk in chunks:
        low, high = (float(v) for v in torch.aminmax(chunk))
        if not (math.isfinite(low) and math.isfinite(high)) or (second and low < 0):
            break
    else:
        return
    bad = sum(int((~torch.isfinite(c)).sum()) for c in chunks)
    negative = sum(int((c < 0).sum()) for c in chunks) if second else 0
    what = f"{bad} non-finite (NaN or inf)" if bad else f"{negative} negative"
    of = _parameter_of(name, params)
    raise ValueError(
        f"--ckpt_path: {path}: {name}{of} holds {what} values of {t.numel()}"
        f"{' (a second moment is a mean of squares)' if not bad else ''}; the run that wrote "
        f"it diverged, or the file was damaged since: resume from an earlier checkpoint of "
        f"the run")


def _parameter_of(name: str, params: dict) -> str:
    """`` (the AdamW state of <parameter>)`` for an optimizer entry, else ``""``."""
    for prefix, owner in (("optimizer_states[0]['state'][", "policy"),
                          ("trace['predictor_optimizer']['state'][", "predictor")):
        if name.startswith(prefix):
            idx = name[len(prefix):].split("]")[0]
            if idx.isdigit() and int(idx) < len(params[owner]):
                return f" (the AdamW state of {params[owner][int(idx)][0]})"
    return ""


def load_problem(path: Path) -> str | None:
    """Why ``path`` does not load as a Lightning checkpoint (a file or a sharded folder),
    or None: it loads (memory-mapped: its tensors are not read). A link to a deleted
    checkpoint, a file cut short by a stop during its save, one that is no checkpoint."""
    if not path.exists():
        return f"links to {path.readlink()}, which was deleted" if path.is_symlink() \
            else "it was deleted"
    try:
        checkpoint_meta(path)
    except (OSError, ValueError) as e:
        cause = e.__cause__ or e
        return "it does not load: " + textwrap.shorten(f"{type(cause).__name__}: {cause}",
                                                      width=120, placeholder=" ...")
    return None


# ---- reading a checkpoint ------------------------------------------------------------
def read_checkpoint(ckpt: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The module state dict and the hyper-parameters of a Lightning checkpoint: a file, or a
    sharded FSDP directory (``meta.pt`` + ``*.distcp``), read on this process alone."""
    path = Path(ckpt)
    data = checkpoint_meta(path)
    if path.is_file():
        data = _torch_load(path)  # the tensors too
        return data["state_dict"], data.get("hyper_parameters", {})
    return _read_sharded_model(path), data.get("hyper_parameters", {})


def checkpoint_meta(ckpt: str | Path) -> dict:
    """A Lightning checkpoint's contents without reading its tensors (a file memory-mapped;
    a sharded directory's ``meta.pt``: loops, epoch, ``hyper_parameters``). What is not a
    checkpoint Lightning wrote is a ValueError naming the path and what to give instead."""
    path = Path(ckpt)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist; runs write it under "
                                f"<default_root_dir>/tensorboard/version_N/checkpoints/")
    if path.is_file():
        data = _torch_load(path, mmap=True)
        if "state_dict" not in data:
            raise ValueError(f"{path} is not a Lightning checkpoint (no 'state_dict'); give "
                             f"the .ckpt file or directory Lightning wrote")
        return data
    if (path / "config.json").exists():
        raise ValueError(f"{path} is a Hugging Face model directory, not a Lightning "
                         f"checkpoint: train from its weights with --model.policy_path {path} "
                         f"(no --ckpt_path), or give the .ckpt file or directory Lightning "
                         f"wrote")
    meta_file = path / "meta.pt"
    if not meta_file.exists():
        raise ValueError(f"{path} is a directory without meta.pt: not a sharded Lightning "
                         f"checkpoint; give the .ckpt file or directory Lightning wrote")
    return _torch_load(meta_file)


def _torch_load(path: Path, mmap: bool = False) -> dict:
    """``torch.load`` of a checkpoint file (``mmap``: its tensors mapped, not read); one that
    does not load, or holds no dict, is a ValueError naming the file (torch's own errors
    name neither it nor the fix)."""
    try:
        # a trace-lightning checkpoint holds the DataModule's numpy RNG state, which
        # weights_only loading refuses: load only checkpoints you wrote yourself
        data = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # unpickling garbage raises nearly anything: ValueError,
        # UnpicklingError, EOFError, AttributeError; a cut-off zip a RuntimeError
        raise ValueError(f"{path} does not load as a checkpoint ({reason(e)}); it is damaged, "
                         f"cut short (an interrupted save or copy) or not a checkpoint: give "
                         f"the .ckpt file or directory Lightning wrote") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, not a Lightning checkpoint; "
                         f"give the .ckpt file or directory Lightning wrote")
    return data


def reason(e: BaseException) -> str:
    """A library's exception on one short line, for our own message."""
    return textwrap.shorten(f"{type(e).__name__}: {e}", width=120, placeholder=" ...")


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
