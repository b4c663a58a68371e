"""Where a policy lives: a local directory, or a Hugging Face hub id fetched on first use.

``--model.policy_path`` takes either. The LightningModule loads it with ``from_pretrained``
(which reads hub ids itself); the DataModule needs a directory for its tokenizer and the
rollout engine, so it resolves a hub id to its snapshot in the Hugging Face cache
(``HF_HUB_CACHE``), downloading it once (in ``prepare_data``, one process per node). With no
connection (``HF_HUB_OFFLINE=1`` or none to be had) the cached snapshot is used.
"""

from __future__ import annotations

import os
from pathlib import Path

# what a policy needs: config, weights, tokenizer, generation and chat template files
# (no .bin duplicates, no original/ consolidated checkpoints)
POLICY_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
# a tokenizer's save_pretrained writes tokenizer_config.json; a fast one also tokenizer.json
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def is_local_path(policy_path: str) -> bool:
    """Whether ``policy_path`` names a local directory rather than a Hugging Face hub id.

    An existing path is local. Otherwise it is local when it starts with '.', '/' or '~', or
    has more than two '/'-separated parts: a hub id is ``name`` or ``owner/name``
    ("Qwen/Qwen3-0.6B"), while a run's path such as "runs/demo/model" has three. A missing
    relative directory of one or two parts ("model", "runs/model") cannot be told from a hub
    id; transformers reports it when it fails to download it.
    """
    p = policy_path.replace(os.sep, "/")
    return (Path(policy_path).exists() or p.startswith((".", "/", "~"))
            or len(p.split("/")) > 2)


def local_model_dir(policy_path: str, flag: str = "--model.policy_path") -> str:
    """A local directory holding ``policy_path``: itself if it exists (``~`` expanded), else
    the snapshot of the hub id (downloaded into the Hugging Face cache the first time).

    The directory must hold ``config.json`` and a tokenizer (``tokenizer.json`` or
    ``tokenizer_config.json``, one of which any tokenizer's ``save_pretrained`` writes), so a
    wrong directory is named here, before the corpus is indexed, not by transformers later.

    Raises:
        FileNotFoundError: a local path that does not exist, or is not such a directory; a
            hub id neither in the cache nor downloadable from here.
    """
    path = os.path.expanduser(policy_path)
    if Path(path).exists():
        return _model_dir(path, policy_path, flag)
    if is_local_path(policy_path):
        raise FileNotFoundError(
            f"{flag} ({policy_path!r}) does not exist (from {Path.cwd()}); give a directory "
            f"saved with save_pretrained (model and tokenizer), or a hub id (owner/name)")
    from huggingface_hub import snapshot_download

    try:
        snapshot = snapshot_download(policy_path, allow_patterns=POLICY_FILES)
    except Exception as e:  # offline without a cached snapshot, unknown repo, gated repo ...
        raise FileNotFoundError(
            f"{flag} ({policy_path!r}) is no local directory, and as a hub id it could not "
            f"be fetched or found in the cache ({type(e).__name__}: {e}); on a machine that "
            f"can download, `huggingface-cli download {policy_path} --local-dir DIR` and "
            f"pass DIR, or set HF_HUB_CACHE to a cache that holds it") from e
    return _model_dir(snapshot, policy_path, flag)


def _model_dir(path: str, policy_path: str, flag: str) -> str:
    """``path`` if it is a directory with ``config.json`` and tokenizer files, else
    FileNotFoundError naming ``flag``, the value given and what is missing."""
    if not Path(path).is_dir():
        why = "is a file, not a directory"
    elif not (Path(path) / "config.json").is_file():
        why = "holds no config.json"
    elif not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        why = f"holds no tokenizer ({' or '.join(TOKENIZER_FILES)})"
    else:
        return path
    where = "" if path == policy_path else f" ({path})"
    raise FileNotFoundError(
        f"{flag} ({policy_path!r}){where} {why}; it must be a Hugging Face model directory "
        f"with config.json and tokenizer files (model and tokenizer saved with "
        f"save_pretrained), or a hub id (owner/name)")
