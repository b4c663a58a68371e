"""--model.policy_path as a hub id: resolved to its snapshot in the Hugging Face cache.

Nothing can be downloaded here, so the cache is filled the way ``huggingface_hub`` fills it
(``models--owner--name/refs/main`` naming a ``snapshots/<commit>`` folder) and the hub is
offline: the real ``snapshot_download`` then resolves the id from the cache alone.
"""

from __future__ import annotations

import shutil

import huggingface_hub.constants
import pytest
from transformers import AutoModelForCausalLM

from trace_lightning.rollout.engines import build_engine, policy_logprobs
from trace_lightning.hub import local_model_dir
from builders import tiny_policy

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def model_dir(tmp_path):
    return tiny_policy(tmp_path / "m", vocab_size=512, seed=3)


@pytest.fixture
def hub_cache(tmp_path, model_dir, monkeypatch):
    repo = tmp_path / "cache" / "models--trace-test--tiny-qwen3"
    shutil.copytree(model_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return repo / "snapshots" / COMMIT


def test_hub_id_resolves_to_its_cached_snapshot_and_the_engine_loads_it(hub_cache, model_dir):
    path = local_model_dir("trace-test/tiny-qwen3")
    assert path == str(hub_cache)
    engine = build_engine("hf", path)
    # the snapshot's weights: the model built and saved above, token for token
    want = policy_logprobs(AutoModelForCausalLM.from_pretrained(model_dir), [[5, 17, 42, 9]])
    assert engine.prompt_logprobs([[5, 17, 42, 9]])[0] == pytest.approx(want[0], abs=1e-6)


def test_unresolvable_policy_paths_name_the_flag_and_the_fix(hub_cache, tmp_path):
    with pytest.raises(FileNotFoundError, match="huggingface-cli download trace-test/absent") \
            as err:
        local_model_dir("trace-test/absent")
    assert "--model.policy_path" in str(err.value)
    # a local-looking path is never sent to the hub
    with pytest.raises(FileNotFoundError, match="does not exist") as err:
        local_model_dir(str(tmp_path / "runs" / "demo" / "model"))
    assert "save_pretrained" in str(err.value)
    assert local_model_dir(str(hub_cache)) == str(hub_cache)  # a directory is itself


def test_a_home_relative_policy_path_is_expanded(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # model_dir is tmp_path / "m"
    assert local_model_dir("~/m") == str(model_dir)


@pytest.mark.parametrize("make, why", [
    (lambda d: d.mkdir(), "holds no config.json"),
    (lambda d: d.write_text("{}"), "is a file, not a directory"),
    (lambda d: (d.mkdir(), (d / "config.json").write_text("{}")),
     r"holds no tokenizer \(tokenizer.json or tokenizer_config.json\)"),
])
def test_a_directory_that_is_no_model_is_named_before_any_work(tmp_path, make, why):
    """Otherwise transformers fails with its own error after the corpus is indexed."""
    bad = tmp_path / "model"
    make(bad)
    with pytest.raises(FileNotFoundError, match=rf"^--model.policy_path \('{bad}'\) {why}; it "
                                                r"must be a Hugging Face model directory with "
                                                r"config.json and tokenizer files"):
        local_model_dir(str(bad))
