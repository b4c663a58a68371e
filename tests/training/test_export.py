"""trace_lightning/training/export.py: the policy as a Hugging Face directory, from a state dict, a
checkpoint file or a sharded (DCP) checkpoint directory; what an export over an existing
folder replaces (only what an export wrote) and what a failure or a kill leaves. A real fit
that exports through ``callbacks.ExportPolicy`` and ``trace-lightning-export`` is in
test_fit.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from trace_lightning.training.checkpoints import read_checkpoint
from trace_lightning.training.export import (ELSEWHERE, META_FILE, export_checkpoint, is_local_path,
                                             main, policy_state, save_policy)
from builders import tiny_policy


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("tiny-export"), vocab_size=512, seed=3)


@pytest.fixture
def trained(model_dir):
    """The tiny policy with every weight moved: an export of the initial weights would fail."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def assert_same_weights(out, model, dtype=torch.float32):
    loaded = AutoModelForCausalLM.from_pretrained(out)
    got, want = loaded.state_dict(), model.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == dtype, name
        torch.testing.assert_close(got[name], tensor.to(dtype), atol=0, rtol=0)
    return loaded


def listing(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def test_saved_policy_loads_with_its_weights_tokenizer_and_record(trained, model_dir, tmp_path):
    out = save_policy(trained.state_dict(), model_dir, tmp_path / "policy",
                      meta={"epochs": 3, "global_step": 12})
    loaded = assert_same_weights(out, trained)
    ids = torch.tensor([[5, 17, 300, 2, 9]])
    torch.testing.assert_close(loaded(ids).logits, trained(ids).logits, atol=0, rtol=0)
    # the head is still the embedding (tied), not a copy that would drift apart
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    text = "Which country is Ralemka in?"
    assert (AutoTokenizer.from_pretrained(out)(text)["input_ids"]
            == AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"])
    meta = json.loads((out / META_FILE).read_text())
    del meta["files"]  # see test_the_record_lists_every_file_the_export_wrote
    assert meta == {"policy_path": str(model_dir), "dtype": "float32", "epochs": 3,
                    "global_step": 12}
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]  # no temporary folder left
    (tmp_path / "plain").mkdir()  # the usual permissions, not those of its private staging
    assert out.stat().st_mode == (tmp_path / "plain").stat().st_mode


def test_the_record_lists_every_file_the_export_wrote(trained, model_dir, tmp_path):
    """The manifest (``files`` in trace_lightning.json, itself included) is what tells a
    previous export's files from the user's."""
    out = save_policy(trained.state_dict(), model_dir, tmp_path / "policy")
    files = json.loads((out / META_FILE).read_text())["files"]
    assert files == listing(out)
    assert {META_FILE, "config.json", "model.safetensors", "tokenizer.json"} <= set(files)


def test_dtype_cast_for_serving(trained, model_dir, tmp_path):
    out = save_policy(trained.state_dict(), model_dir, tmp_path / "bf16", dtype="bfloat16")
    assert_same_weights(out, trained, dtype=torch.bfloat16)
    assert json.loads((out / META_FILE).read_text())["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="'bf16'.*bfloat16"):
        save_policy(trained.state_dict(), model_dir, tmp_path / "x", dtype="bf16")


@pytest.mark.parametrize("dtype", ["bf16", "int8", "bool", "complex64", "float8_e4m3fn"])
def test_export_dtype_must_be_a_floating_one(trained, model_dir, tmp_path, dtype):
    """int8/bool are torch dtypes too: they used to cast every weight and end in a bare
    StopIteration (no floating tensor left); the error names the flag, value and choices."""
    from callbacks import ExportPolicy

    match = (rf"--dtype / ExportPolicy dtype \('{dtype}'\) is not a floating torch dtype.*"
             r"bfloat16, float16, float32 or float64")
    with pytest.raises(ValueError, match=match):
        save_policy(trained.state_dict(), model_dir, tmp_path / "x", dtype=dtype)
    assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match=match):  # at configuration, not when training ends
        ExportPolicy(dtype=dtype)


def test_a_failed_export_leaves_the_previous_one_whole(trained, model_dir, tmp_path):
    out = save_policy(trained.state_dict(), model_dir, tmp_path / "policy")
    broken = {k: v for k, v in trained.state_dict().items() if "layers.1." not in k}
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.*policy_path"):
        save_policy(broken, model_dir, out)
    assert_same_weights(out, trained)


def test_exporting_again_replaces_the_previous_export(trained, model_dir, tmp_path):
    out = save_policy(trained.state_dict(), model_dir, tmp_path / "policy", dtype="float16")
    save_policy(trained.state_dict(), model_dir, out)
    assert_same_weights(out, trained)  # the second export's (float32) weights
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]  # no temporary folder left


def test_folders_beside_the_export_named_like_its_temporaries_are_left_alone(
        trained, model_dir, tmp_path):
    """The export wrote into ``<out>.partial`` and moved the previous one to ``<out>.old``,
    deleting whatever was there first: a user's folder of that name was lost outright."""
    for name in ("policy.partial", "policy.old"):
        (tmp_path / name / "sub").mkdir(parents=True)
        (tmp_path / name / "sub" / "mine.txt").write_text(f"keep {name}")
    out = save_policy(trained.state_dict(), model_dir, tmp_path / "policy")  # a new export
    save_policy(trained.state_dict(), model_dir, out, dtype="bfloat16")  # and over it
    assert_same_weights(out, trained, dtype=torch.bfloat16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy", "policy.old",
                                                         "policy.partial"]
    for name in ("policy.partial", "policy.old"):
        assert listing(tmp_path / name) == ["sub/mine.txt"]
        assert (tmp_path / name / "sub" / "mine.txt").read_text() == f"keep {name}"


def test_files_of_ones_own_in_a_previous_export_are_refused_and_kept(trained, model_dir,
                                                                    tmp_path):
    """Exporting over a previous export deleted the notes and results kept in it. Now the
    export stops before any work, naming them; moved out, the export goes ahead."""
    ckpt = save_checkpoint(tmp_path / "last.ckpt", trained, model_dir)
    out = tmp_path / "policy"
    main([str(ckpt), str(out), "--dtype", "bfloat16"])
    (out / "EVAL_NOTES.md").write_text("my notes")
    (out / "results").mkdir()
    (out / "results" / "score.txt").write_text("0.42")
    (out / "empty").mkdir()
    before = listing(out)
    with pytest.raises(SystemExit) as e:
        main([str(ckpt), str(out)])
    assert str(e.value) == (
        f"trace-lightning-export: output directory {out} is a previous export that also holds "
        f"files no export wrote (EVAL_NOTES.md, empty/, results/score.txt): replacing it would "
        f"delete them; move them out of {out}, or give another output folder "
        f"(trace-lightning-export's OUT, ExportPolicy's dirpath)")
    with pytest.raises(FileExistsError, match="EVAL_NOTES.md, empty/, results/score.txt"):
        save_policy(trained.state_dict(), model_dir, out)  # ExportPolicy's way
    assert listing(out) == before and (out / "empty").is_dir()
    assert (out / "EVAL_NOTES.md").read_text() == "my notes"
    assert (out / "results" / "score.txt").read_text() == "0.42"
    assert_same_weights(out, trained, dtype=torch.bfloat16)  # the previous export, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "policy"]

    for name in ("EVAL_NOTES.md", "results", "empty"):
        (out / name).rename(tmp_path / name)
    main([str(ckpt), str(out)])
    assert_same_weights(out, trained)


def test_an_export_from_before_manifests_is_replaced_only_if_it_holds_what_exports_write(
        trained, model_dir, tmp_path):
    """A trace_lightning.json without ``files``: the top-level files named as
    save_pretrained names them are the export's (LEGACY_EXPORT_FILES), anything else is the
    user's."""
    out = save_policy(trained.state_dict(), model_dir, tmp_path / "policy", dtype="float16")
    info = json.loads((out / META_FILE).read_text())
    del info["files"]
    (out / META_FILE).write_text(json.dumps(info))
    (out / "EVAL_NOTES.md").write_text("my notes")
    with pytest.raises(FileExistsError, match=r"also holds files no export wrote "
                                              r"\(EVAL_NOTES.md\): replacing"):
        save_policy(trained.state_dict(), model_dir, out)
    assert_same_weights(out, trained, dtype=torch.float16)
    (out / "EVAL_NOTES.md").unlink()
    save_policy(trained.state_dict(), model_dir, out)
    assert_same_weights(out, trained)
    assert json.loads((out / META_FILE).read_text())["files"] == listing(out)


def test_a_file_or_a_link_as_the_output_is_refused(trained, model_dir, tmp_path):
    (tmp_path / "model.txt").write_text("keep me")
    with pytest.raises(FileExistsError) as e:
        save_policy(trained.state_dict(), model_dir, tmp_path / "model.txt")
    assert str(e.value) == (f"output directory {tmp_path / 'model.txt'} exists and is a file, "
                            f"not a folder: replacing it would delete it; move it away, or "
                            f"{ELSEWHERE}")
    assert (tmp_path / "model.txt").read_text() == "keep me"
    # a link to a previous export: the swap would put a folder in the link's place
    target = save_policy(trained.state_dict(), model_dir, tmp_path / "target")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(FileExistsError, match=f"link is a symbolic link \\(to {target}\\).*"
                                              f"give the folder itself \\({target}\\)"):
        save_policy(trained.state_dict(), model_dir, tmp_path / "link")
    assert (tmp_path / "link").resolve() == target
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "model.txt", "target"]


def test_a_file_put_in_the_output_while_exporting_is_refused_and_kept(trained, model_dir,
                                                                     tmp_path, monkeypatch):
    """The folder is checked again just before the swap: a file that appeared while the
    weights were written stops the export instead of being deleted with the previous one."""
    from transformers import PreTrainedModel

    out = save_policy(trained.state_dict(), model_dir, tmp_path / "policy")
    save = PreTrainedModel.save_pretrained

    def save_then_user_writes(self, directory, **kwargs):
        save(self, directory, **kwargs)
        (out / "notes.txt").write_text("written meanwhile")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_then_user_writes)
    with pytest.raises(FileExistsError, match=r"no export wrote \(notes.txt\)"):
        save_policy(trained.state_dict(), model_dir, out, dtype="bfloat16")
    monkeypatch.undo()
    assert (out / "notes.txt").read_text() == "written meanwhile"
    assert_same_weights(out, trained)
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]


KILLED_EXPORT_SCRIPT = """
import os, sys
from pathlib import Path
from transformers import AutoModelForCausalLM
from trace_lightning.training.export import save_policy

model_dir, out = sys.argv[1], Path(sys.argv[2])
rename = Path.rename

def killed_after_moving_the_previous_aside(self, target):
    rename(self, target)
    if Path(target).parent.name.startswith("policy.old-"):
        os._exit(9)  # a kill: no except, no finally

Path.rename = killed_after_moving_the_previous_aside
save_policy(AutoModelForCausalLM.from_pretrained(model_dir).state_dict(), model_dir, out,
            dtype="bfloat16")
"""


def test_a_kill_between_the_renames_loses_nothing_and_the_next_export_deletes_nothing(
        trained, model_dir, tmp_path):
    """Killed with the previous export moved aside and the new one not yet in place: both
    are whole, in the folders this export made, and a later export leaves them alone."""
    out = save_policy(trained.state_dict(), model_dir, tmp_path / "policy")
    script = tmp_path / "killed.py"
    script.write_text(KILLED_EXPORT_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(model_dir), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 9, done.stderr[-3000:]
    assert not out.exists()
    (old,) = tmp_path.glob("policy.old-*")
    (partial,) = tmp_path.glob("policy.partial-*")
    assert_same_weights(old / "policy", trained)  # the previous export, whole
    assert json.loads((partial / "policy" / META_FILE).read_text())["dtype"] == "bfloat16"
    leftovers = {p: listing(p) for p in (old, partial)}
    save_policy(trained.state_dict(), model_dir, out)
    assert_same_weights(out, trained)
    assert {p: listing(p) for p in (old, partial)} == leftovers


def test_a_failed_replace_leaves_the_previous_export_in_place(trained, model_dir, tmp_path,
                                                              monkeypatch):
    """The previous export was deleted before the new one was renamed into place: a failure
    (or a kill) in between left no model at all."""
    out = save_policy(trained.state_dict(), model_dir, tmp_path / "policy")
    rename = Path.rename

    def failing_rename(self, target):
        if self.parent.name.startswith("policy.partial-"):
            raise OSError("simulated failure moving the new export into place")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_rename)
    with pytest.raises(OSError, match="simulated"):
        save_policy(trained.state_dict(), model_dir, out, dtype="bfloat16")
    monkeypatch.undo()
    assert_same_weights(out, trained)  # the previous (float32) export, whole
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]  # its temporaries removed


def test_a_failed_save_leaves_the_previous_export_untouched(trained, model_dir, tmp_path,
                                                            monkeypatch):
    from transformers import PreTrainedModel

    out = save_policy(trained.state_dict(), model_dir, tmp_path / "policy")
    before = sorted(p.name for p in out.iterdir())

    def failing_save(self, directory, **kwargs):
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "model.safetensors").write_bytes(b"half a file")
        raise RuntimeError("simulated failure while saving")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", failing_save)
    with pytest.raises(RuntimeError, match="simulated"):
        save_policy(trained.state_dict(), model_dir, out, dtype="bfloat16")
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir()) == before
    assert_same_weights(out, trained)
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]  # the half export removed


def test_the_generation_config_comes_from_the_policy_path(trained, model_dir, tmp_path):
    """A model built from its config saves a default generation config; the export carries
    the source's (its eos ids and sampling defaults reach generate() and vLLM)."""
    src = Path(shutil.copytree(model_dir, tmp_path / "src"))
    generation = GenerationConfig.from_pretrained(src)
    generation.eos_token_id = [2, 7]
    generation.do_sample, generation.temperature = True, 0.37
    generation.save_pretrained(src)
    out = save_policy(trained.state_dict(), src, tmp_path / "policy")
    got = GenerationConfig.from_pretrained(out)
    assert (got.eos_token_id, got.do_sample, got.temperature) == ([2, 7], True, 0.37)
    # a source without one: the export still works, with transformers' default
    (src / "generation_config.json").unlink()
    out = save_policy(trained.state_dict(), src, tmp_path / "policy")
    assert GenerationConfig.from_pretrained(out).temperature != 0.37


def test_a_relative_policy_path_from_another_directory_names_the_flag(trained, model_dir,
                                                                      tmp_path, monkeypatch):
    """A run records its policy_path as given (here relative to the run's working directory);
    exported from elsewhere, transformers failed with an error naming neither the checkpoint
    nor --policy-path."""
    module = {f"policy.{k}": v for k, v in trained.state_dict().items()}
    torch.save({"state_dict": module, "hyper_parameters": {"policy_path": "runs/demo/model"}},
               tmp_path / "last.ckpt")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["last.ckpt", "out"])
    msg = str(e.value)
    assert msg.startswith("trace-lightning-export: last.ckpt records "
                          "model.policy_path=runs/demo/model, which does not exist (as a "
                          "directory) from ")
    assert str(tmp_path) in msg and "pass --policy-path DIR" in msg
    with pytest.raises(SystemExit, match="--policy-path elsewhere/demo/model does not exist"):
        main(["last.ckpt", "out", "--policy-path", "elsewhere/demo/model"])
    assert not (tmp_path / "out").exists()
    main(["last.ckpt", "out", "--policy-path", str(model_dir)])
    assert_same_weights(tmp_path / "out", trained)


def test_local_paths_are_told_from_hub_ids(tmp_path):
    """A hub id is name or owner/name; anything longer, or starting with '.', '/' or '~', or
    existing, is a local path."""
    assert not is_local_path("Qwen/Qwen3-0.6B") and not is_local_path("gpt2")
    for local in ("runs/demo/model", "./model", "../model", "/abs/model", "~/model",
                  str(tmp_path)):
        assert is_local_path(local), local


def test_policy_state_keeps_only_the_policy():
    w = torch.ones(2)
    module = {"policy.model.norm.weight": w, "predictor.net.0.weight": w,
              "reference.model.norm.weight": 2 * w}
    assert policy_state(module, "x.ckpt") == {"model.norm.weight": w}
    with pytest.raises(ValueError, match="x.ckpt: no 'policy.' weights.*trace-lightning fit"):
        policy_state({"predictor.net.0.weight": w}, "x.ckpt")


def test_checkpoint_file_and_sharded_directory(trained, model_dir, tmp_path):
    """A Lightning checkpoint file, and the layout Lightning's FSDP strategy writes with
    ``state_dict_type="sharded"``: DCP files holding {"model": ..., "optimizer_0": ...} and
    ``meta.pt`` holding the rest (hyper-parameters among it)."""
    import torch.distributed.checkpoint as dcp

    module = {f"policy.{k}": v for k, v in trained.state_dict().items()}
    module["predictor.net.0.weight"] = torch.zeros(3, 4)
    hparams = {"policy_path": str(model_dir), "lr": 1e-5}
    torch.save({"state_dict": module, "hyper_parameters": hparams, "epoch": 1},
               tmp_path / "last.ckpt")
    main([str(tmp_path / "last.ckpt"), str(tmp_path / "from_file")])
    assert_same_weights(tmp_path / "from_file", trained)

    sharded = tmp_path / "sharded.ckpt"
    dcp.save({"model": module, "optimizer_0": {"state": {"0": {"exp_avg": torch.ones(5)}}}},
             checkpoint_id=str(sharded), no_dist=True)
    torch.save({"hyper_parameters": hparams, "epoch": 1}, sharded / "meta.pt")
    state, got_hparams = read_checkpoint(sharded)
    assert set(state) == set(module) and got_hparams == hparams  # no optimizer state read
    export_checkpoint(sharded, tmp_path / "from_dir", dtype="bfloat16")
    assert_same_weights(tmp_path / "from_dir", trained, dtype=torch.bfloat16)


def test_checkpoint_errors_name_the_path_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.ckpt does not exist.*checkpoints/"):
        export_checkpoint(tmp_path / "nope.ckpt", tmp_path / "out")
    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError, match="without meta.pt"):
        export_checkpoint(tmp_path / "dir", tmp_path / "out")
    torch.save({"state_dict": {"policy.w": torch.ones(1)}, "hyper_parameters": {}},
               tmp_path / "old.ckpt")
    with pytest.raises(ValueError, match="records no model.policy_path; pass --policy-path"):
        export_checkpoint(tmp_path / "old.ckpt", tmp_path / "out")
    torch.save({"weights": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a Lightning checkpoint"):
        export_checkpoint(tmp_path / "other.pt", tmp_path / "out")


def save_checkpoint(path: Path, model, policy_path) -> Path:
    """A Lightning checkpoint file of ``model`` as a TraceModule's policy."""
    module = {f"policy.{k}": v for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": module, "hyper_parameters": {"policy_path": str(policy_path)}},
               path)
    return path


def test_only_an_empty_directory_or_a_previous_export_is_replaced(trained, model_dir, tmp_path,
                                                                  capsys):
    """``trace-lightning-export run/checkpoints/last.ckpt run`` replaced (deleted) the run
    directory, its checkpoint and its base model with it."""
    run = tmp_path / "run"
    ckpt = save_checkpoint(run / "checkpoints" / "last.ckpt", trained, model_dir)
    base = Path(shutil.copytree(model_dir, run / "world" / "model"))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))

    with pytest.raises(SystemExit) as e:  # out holds the checkpoint
        main([str(ckpt), str(run), "--policy-path", str(model_dir)])
    assert str(e.value) == (f"trace-lightning-export: output directory {run} holds {ckpt}, "
                            f"which this export reads: replacing {run} would delete it; "
                            f"choose a new directory for the export")
    with pytest.raises(SystemExit, match=f"{run} holds {base}, which this export reads"):
        main([str(tmp_path / "x.ckpt"), str(run), "--policy-path", str(base)])
    with pytest.raises(SystemExit) as e:  # a directory of the user's own
        main([str(ckpt), str(tmp_path / "notes")])
    assert str(e.value) == (f"trace-lightning-export: output directory {tmp_path / 'notes'} "
                            f"exists and is not a previous export (no {META_FILE} in it): "
                            f"replacing it would delete its files (todo.txt); move them out "
                            f"of {tmp_path / 'notes'}, or {ELSEWHERE}")
    with pytest.raises(FileExistsError, match="notes exists and is not a previous export"):
        save_policy(trained.state_dict(), model_dir, tmp_path / "notes")  # ExportPolicy's way
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"

    (tmp_path / "empty").mkdir()
    main([str(ckpt), str(tmp_path / "empty")])
    main([str(ckpt), str(tmp_path / "empty"), "--dtype", "bfloat16"])  # a previous export
    assert capsys.readouterr().out.count(f"policy written to {tmp_path / 'empty'}") == 2
    assert_same_weights(tmp_path / "empty", trained, dtype=torch.bfloat16)
    with pytest.raises(SystemExit, match="empty holds .*empty, which this export reads"):
        main([str(ckpt), str(tmp_path / "empty"), "--policy-path", str(tmp_path / "empty")])
    assert_same_weights(tmp_path / "empty", trained, dtype=torch.bfloat16)
    # <out>.old, where a previous export once waited while the new one was renamed into
    # place, is a name of the user's like any other now: left alone
    (tmp_path / "empty.old").mkdir()
    (tmp_path / "empty.old" / "backup.txt").write_text("keep me")
    main([str(ckpt), str(tmp_path / "empty")])
    assert (tmp_path / "empty.old" / "backup.txt").read_text() == "keep me"
    assert_same_weights(tmp_path / "empty", trained)


def broken_checkpoints(tmp_path: Path, trained, model_dir) -> dict[str, Path]:
    whole = save_checkpoint(tmp_path / "whole.ckpt", trained, model_dir).read_bytes()
    files = {"text.ckpt": b"I am not a checkpoint\n", "empty.ckpt": b"",
             "random.ckpt": torch.randint(0, 256, (4096,), dtype=torch.uint8,
                                          generator=torch.Generator().manual_seed(0))
             .numpy().tobytes(),
             "truncated.ckpt": whole[:len(whole) // 2]}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    return {name: tmp_path / name for name in files}


def test_a_broken_checkpoint_file_names_itself_and_the_fix(trained, model_dir, tmp_path):
    """Garbage text, random bytes, an empty or a cut-off file ended in torch's raw
    ValueError, UnpicklingError, EOFError or RuntimeError tracebacks, naming no file."""
    for name, path in broken_checkpoints(tmp_path, trained, model_dir).items():
        with pytest.raises(SystemExit) as e:
            main([str(path), str(tmp_path / "out")])
        msg = str(e.value)
        assert msg.startswith(f"trace-lightning-export: {path} does not load as a "
                              f"checkpoint ("), name
        assert msg.endswith("give the .ckpt file or directory Lightning wrote"), name
        assert "\n" not in msg and len(msg) < 400, name
    torch.save(torch.ones(3), tmp_path / "tensor.ckpt")
    with pytest.raises(SystemExit, match="tensor.ckpt holds a Tensor, not a Lightning checkpoint"):
        main([str(tmp_path / "tensor.ckpt"), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_a_bad_dtype_fails_before_the_checkpoint_is_read(trained, model_dir, tmp_path,
                                                         monkeypatch):
    ckpt = save_checkpoint(tmp_path / "last.ckpt", trained, model_dir)
    loads = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or {})
    with pytest.raises(SystemExit, match=r"trace-lightning-export: --dtype / ExportPolicy dtype "
                                         r"\('bf16'\) is not a floating torch dtype"):
        main([str(ckpt), str(tmp_path / "out"), "--dtype", "bf16"])
    assert loads == []


def test_a_policy_path_without_a_model_names_the_flag_or_the_checkpoint(trained, tmp_path):
    """An existing directory that holds no model: transformers' ValueError named neither."""
    (tmp_path / "nomodel").mkdir()
    ckpt = save_checkpoint(tmp_path / "last.ckpt", trained, tmp_path / "nomodel")
    with pytest.raises(SystemExit) as e:
        main([str(ckpt), str(tmp_path / "out")])
    assert str(e.value).startswith(
        f"trace-lightning-export: {ckpt} records model.policy_path={tmp_path / 'nomodel'}, which "
        f"does not load as a transformers config and tokenizer (ValueError: ")
    assert str(e.value).endswith("; pass --policy-path DIR (the directory the run's policy was "
                                 "loaded from)")
    with pytest.raises(SystemExit, match=f"--policy-path {tmp_path / 'nomodel'} does not load "
                                         f"as a transformers config and tokenizer"):
        main([str(ckpt), str(tmp_path / "out"), "--policy-path", str(tmp_path / "nomodel")])
    assert not (tmp_path / "out").exists()


def test_export_callback_every_n_epochs_and_at_the_end(model_dir, tmp_path):
    """ExportPolicy on a real Trainer (3 epochs, every 2): epoch_1 after two epochs, last
    after three, each with the weights of that moment; nothing else."""
    import lightning as L
    from torch.utils.data import DataLoader

    from callbacks import ExportPolicy

    class LM(L.LightningModule):
        def __init__(self, policy_path: str):
            super().__init__()
            self.save_hyperparameters()
            self.policy = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32)
            self.snapshots: dict[int, dict] = {}

        def training_step(self, batch, batch_idx):
            return self.policy(input_ids=batch, labels=batch).loss

        def on_train_epoch_end(self):  # the weights ExportPolicy saw: no step in between
            self.snapshots[self.current_epoch] = {k: v.clone() for k, v in
                                                  self.policy.state_dict().items()}

        def configure_optimizers(self):
            return torch.optim.SGD(self.policy.parameters(), lr=0.5)

    data = DataLoader(torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(0)),
                      batch_size=2)
    module, export = LM(str(model_dir)), ExportPolicy(dirpath=str(tmp_path / "p"),
                                                      every_n_epochs=2)
    trainer = L.Trainer(max_epochs=3, callbacks=[export], logger=False, accelerator="cpu",
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, data)
    assert export.exported == [tmp_path / "p" / "epoch_1", tmp_path / "p" / "last"]
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["epoch_1", "last"]
    for name, epoch, epochs in (("epoch_1", 1, 2), ("last", 2, 3)):
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "p" / name).state_dict()
        for k, v in module.snapshots[epoch].items():
            torch.testing.assert_close(got[k], v, atol=0, rtol=0)
        meta = json.loads((tmp_path / "p" / name / META_FILE).read_text())
        assert (meta["epochs"], meta["policy_steps"]) == (epochs, 2 * epochs)  # 2 batches each
    assert not torch.equal(module.snapshots[1]["model.norm.weight"],
                           module.snapshots[2]["model.norm.weight"])
    with pytest.raises(ValueError, match="every_n_epochs \\(-1\\) must be >= 0"):
        ExportPolicy(every_n_epochs=-1)
    # a dirpath whose "last" is a folder of the user's own fails before training, not after
    (tmp_path / "q" / "last").mkdir(parents=True)
    (tmp_path / "q" / "last" / "notes.txt").write_text("keep me")
    trainer = L.Trainer(max_epochs=1, callbacks=[ExportPolicy(dirpath=str(tmp_path / "q"))],
                        logger=False, accelerator="cpu", enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(FileExistsError, match="last exists and is not a previous export"):
        trainer.fit(LM(str(model_dir)), data)
    assert trainer.global_step == 0 and (tmp_path / "q" / "last" / "notes.txt").exists()


def test_export_callback_records_the_policy_optimizers_steps(model_dir, tmp_path):
    """A module with manual optimization and two optimizers, as TraceModule: the policy's
    (first) steps once per batch, a predictor's three times; ``trainer.global_step`` counts
    all eight, the export records the policy's two."""
    import lightning as L
    from torch.utils.data import DataLoader

    from callbacks import ExportPolicy

    class LM(L.LightningModule):
        def __init__(self, policy_path: str):
            super().__init__()
            self.save_hyperparameters()
            self.automatic_optimization = False
            self.policy = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32)
            self.predictor = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            policy_opt, predictor_opt = self.optimizers()
            for _ in range(3):
                self.manual_backward(self.predictor(torch.ones(1, 2)).square().sum())
                predictor_opt.step()
                predictor_opt.zero_grad()
            self.manual_backward(self.policy(input_ids=batch, labels=batch).loss)
            policy_opt.step()
            policy_opt.zero_grad()

        def configure_optimizers(self):
            return [torch.optim.AdamW(self.policy.parameters(), lr=1e-3),
                    torch.optim.SGD(self.predictor.parameters(), lr=0.1)]

    data = DataLoader(torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(0)),
                      batch_size=2)
    export = ExportPolicy(dirpath=str(tmp_path / "p"))
    trainer = L.Trainer(max_epochs=1, callbacks=[export], logger=False, accelerator="cpu",
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(LM(str(model_dir)), data)
    assert trainer.global_step == 8  # 2 batches x (3 predictor + 1 policy) steps
    meta = json.loads((tmp_path / "p" / "last" / META_FILE).read_text())
    assert (meta["epochs"], meta["policy_steps"]) == (1, 2)


EXPORT_RANKS_SCRIPT = '''
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from callbacks import ExportPolicy

policy_path, out = sys.argv[1], Path(sys.argv[2])

class LM(L.LightningModule):
    def __init__(self, policy_path: str):
        super().__init__()
        self.save_hyperparameters()
        self.policy = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32)

    def training_step(self, batch, batch_idx):
        return self.policy(input_ids=batch, labels=batch).loss

    def on_train_epoch_end(self):  # after ExportPolicy's check, before its export
        if self.global_rank == 0:
            (out / "last").mkdir(parents=True)
            (out / "last" / "notes.txt").write_text("keep me")

    def configure_optimizers(self):
        return torch.optim.SGD(self.policy.parameters(), lr=0.1)

data = DataLoader(torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(0)),
                  batch_size=1)
trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=1, logger=False,
                    callbacks=[ExportPolicy(dirpath=str(out))], enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(LM(policy_path), data)
'''


def test_a_failed_export_stops_every_rank(model_dir, tmp_path):
    """Two ranks started side by side (as srun or torchrun would; Lightning kills no rank
    then): rank 0's write fails (a folder of the user's appeared as ``last`` during training),
    and rank 1, which waited for it, stops too, naming rank 0's reason. Before, rank 1 waited
    in a barrier: under NCCL until the process group's timeout (30 min), here under gloo it
    failed at once with "Connection closed by peer" and no reason. The user's folder is
    untouched."""
    from launch import run_ranks

    script = tmp_path / "export_ranks.py"
    script.write_text(EXPORT_RANKS_SCRIPT)
    out = tmp_path / "policy"
    (rc0, out0), (rc1, out1) = run_ranks(script, [str(model_dir), str(out)], tmp_path,
                                         timeout=180)
    assert rc1 is not None, f"rank 1 still waiting after rank 0 failed:\n{out1[-3000:]}"
    assert rc0 not in (0, None) and rc1 != 0, (out0[-3000:], out1[-3000:])
    assert "FileExistsError" in out0 and "last exists and is not a previous export" in out0
    assert "ExportPolicy: rank 0 could not write" in out1, out1[-3000:]
    assert "last exists and is not a previous export" in out1
    assert (out / "last" / "notes.txt").read_text() == "keep me"
