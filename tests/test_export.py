"""trace_lightning/export.py: the policy as a Hugging Face directory, from a state dict, a
checkpoint file or a sharded (DCP) checkpoint directory. A real fit that exports through
``callbacks.ExportPolicy`` and ``trace-lightning-export`` is in test_fit.py."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trace_lightning.export import (META_FILE, export_checkpoint, main, policy_state,
                                    read_checkpoint, save_policy)
from trace_lightning.models import build_tiny_from_corpus


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, shared_data):
    return build_tiny_from_corpus(shared_data / "hotpotqa" / "corpus.jsonl",
                                  tmp_path_factory.mktemp("tiny-export"), vocab_size=1024, seed=3)


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
    assert meta == {"policy_path": str(model_dir), "dtype": "float32", "epochs": 3,
                    "global_step": 12}
    assert not (tmp_path / "policy.partial").exists()


def test_dtype_cast_for_serving(trained, model_dir, tmp_path):
    out = save_policy(trained.state_dict(), model_dir, tmp_path / "bf16", dtype="bfloat16")
    assert_same_weights(out, trained, dtype=torch.bfloat16)
    assert json.loads((out / META_FILE).read_text())["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="'bf16' is not a torch dtype.*bfloat16"):
        save_policy(trained.state_dict(), model_dir, tmp_path / "x", dtype="bf16")


def test_a_failed_export_leaves_the_previous_one_whole(trained, model_dir, tmp_path):
    out = save_policy(trained.state_dict(), model_dir, tmp_path / "policy")
    broken = {k: v for k, v in trained.state_dict().items() if "layers.1." not in k}
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.*policy_path"):
        save_policy(broken, model_dir, out)
    assert_same_weights(out, trained)


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

    data = DataLoader(torch.randint(0, 1024, (4, 16), generator=torch.Generator().manual_seed(0)),
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
        assert json.loads((tmp_path / "p" / name / META_FILE).read_text())["epochs"] == epochs
    assert not torch.equal(module.snapshots[1]["model.norm.weight"],
                           module.snapshots[2]["model.norm.weight"])
    with pytest.raises(ValueError, match="every_n_epochs \\(-1\\) must be >= 0"):
        ExportPolicy(every_n_epochs=-1)
