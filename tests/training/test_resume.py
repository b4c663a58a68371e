"""Resuming and validating from checkpoints: the predictor's float32 weights and its own
optimizer's state (single-file and FSDP-sharded checkpoints), this run's lr and warm-up, and
``validate --ckpt_path`` under FSDP. A real Trainer on the tiny policy (``policy_dir``,
training/conftest.py)."""

from __future__ import annotations

import copy
import types

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from trace_lightning.training.module import TraceModule
from builders.training import cpu_fsdp, fit_checkpointed
from builders.trees import mixed_trees


def test_resuming_under_bf16_true_restores_the_float32_predictor(policy_dir, tmp_path):
    """Lightning loads a checkpoint into the module while bf16-true still holds the predictor
    in bf16; the resumed predictor must be the saved float32 one, not its rounding."""
    seen = []

    class Receive(L.Callback):
        def on_train_start(self, trainer, pl_module):
            if trainer.current_epoch == 0:  # one predictor fit, so its weights are not round
                pl_module.receive_step(types.SimpleNamespace(trees=mixed_trees(), epoch=0))
                pl_module.fit_predictor()
            seen.append({k: v.clone() for k, v in pl_module.predictor.state_dict().items()})

    def fit(epochs, ckpt=None):
        module = TraceModule(policy_path=str(policy_dir), lr=1e-4, predictor_holdout=0.0)
        return fit_checkpointed(tmp_path, module, epochs, Receive(), ckpt, precision="bf16-true")

    ckpt = fit(1).checkpoint_callback.best_model_path
    saved = torch.load(ckpt, weights_only=False)["state_dict"]
    fit(2, ckpt)
    resumed = seen[-1]
    assert any(v.dtype == torch.float32 and not torch.equal(v, v.bfloat16().float())
               for v in resumed.values())  # values bf16 cannot hold: a rounding would show
    for k, v in resumed.items():
        torch.testing.assert_close(v, saved[f"predictor.{k}"], atol=0, rtol=0, msg=k)


@pytest.mark.parametrize("warmup, lr, expected", [
    (10, 2e-4, [2e-4 * 3 / 10, 2e-4 * 4 / 10]),  # this run's length: 3/3 and 1 before
    (0, 1e-4, [1e-4, 1e-4]),  # no warm-up, a new lr: not the checkpoint's 2e-4 * 3/3
])
def test_a_resumed_run_takes_its_own_lr_and_warmup_length(policy_dir, tmp_path, warmup, lr,
                                                          expected):
    """Two steps with a 3-step warm-up at 2e-4 (1/3 and 2/3 of it), then resumed with this
    run's warm-up length and lr: its steps 2-3 follow those, not the checkpoint's."""
    lrs = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            lrs.append(float(trainer.callback_metrics["train/lr"]))

    def fit(epochs, warmup, lr, ckpt=None):
        module = TraceModule(policy_path=str(policy_dir), lr=lr, lr_warmup_steps=warmup)
        return fit_checkpointed(tmp_path, module, epochs, Record(), ckpt, batches=2)

    ckpt = fit(1, warmup=3, lr=2e-4).checkpoint_callback.best_model_path
    fit(2, warmup=warmup, lr=lr, ckpt=ckpt)
    assert lrs == pytest.approx([2e-4 / 3, 2e-4 * 2 / 3, *expected])


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_resuming_under_fsdp_restores_the_predictors_own_optimizer(policy_dir, tmp_path,
                                                                   no_process_group,
                                                                   state_dict_type):
    """FSDP (one CPU process, gloo), sharded or full checkpoints: the resumed predictor's
    AdamW holds the saved moments as plain tensors (Lightning would restore them as shards
    of a model FSDP does not own, and the next predictor step fail), and steps on from them."""
    restored, updates = [], []

    class Receive(L.Callback):
        def on_train_start(self, trainer, pl_module):
            if trainer.current_epoch == 1:
                opt = pl_module.predictor_life.optimizer(pl_module.predictor)
                restored.append(copy.deepcopy(opt.state_dict()))
            pl_module.receive_step(types.SimpleNamespace(trees=mixed_trees(),
                                                         epoch=trainer.current_epoch))
            pl_module.fit_predictor()
            updates.append(pl_module.predictor_life.stats["predictor/updates"])

    def fit(epochs, ckpt=None):
        module = TraceModule(policy_path=str(policy_dir), lr=1e-4, predictor_holdout=0.0)
        return fit_checkpointed(tmp_path, module, epochs, Receive(), ckpt,
                                strategy=cpu_fsdp(state_dict_type))

    ckpt = fit(1).checkpoint_callback.best_model_path
    meta = f"{ckpt}/meta.pt" if state_dict_type == "sharded" else ckpt
    saved = torch.load(meta, weights_only=False)["trace"]["predictor_optimizer"]
    fit(2, ckpt)
    assert updates[1] > 0  # the resumed fit stepped
    (state,) = restored
    assert saved["state"] and state["state"].keys() == saved["state"].keys()
    for i, moments in saved["state"].items():
        for key, value in moments.items():
            assert type(state["state"][i][key]) is torch.Tensor, key
            torch.testing.assert_close(state["state"][i][key], value, atol=0, rtol=0)


def test_a_checkpoint_with_the_predictors_optimizer_in_lightnings_resumes_it(policy_dir,
                                                                           tmp_path):
    """Checkpoints written before the predictor's optimizer left Lightning's hold its state
    as Lightning's second optimizer: the resumed run takes it from there, and a checkpoint
    saved before its first predictor step (e.g. on an exception in the first rollout) keeps
    it, not None."""
    resaved = tmp_path / "resaved.ckpt"

    class Receive(L.Callback):
        def on_train_start(self, trainer, pl_module):
            if trainer.current_epoch == 1:
                trainer.save_checkpoint(resaved)
            pl_module.receive_step(types.SimpleNamespace(trees=mixed_trees(),
                                                         epoch=trainer.current_epoch))
            pl_module.fit_predictor()

    def fit(epochs, ckpt=None):
        module = TraceModule(policy_path=str(policy_dir), lr=1e-4, predictor_holdout=0.0)
        return fit_checkpointed(tmp_path, module, epochs, Receive(), ckpt)

    ckpt = fit(1).checkpoint_callback.best_model_path
    old = torch.load(ckpt, weights_only=False)
    saved = old["trace"].pop("predictor_optimizer")
    old["optimizer_states"].append(saved)  # the layout before
    torch.save(old, tmp_path / "old.ckpt")
    fit(2, str(tmp_path / "old.ckpt"))
    kept = torch.load(resaved, weights_only=False)
    assert len(kept["optimizer_states"]) == 1
    state = kept["trace"]["predictor_optimizer"]["state"]
    assert state.keys() == saved["state"].keys() and saved["state"]
    for i, moments in saved["state"].items():
        for key, value in moments.items():
            torch.testing.assert_close(state[i][key], value, atol=0, rtol=0)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_validate_from_a_checkpoint_under_fsdp_and_bf16_true(policy_dir, tmp_path,
                                                             no_process_group):
    """``validate --ckpt_path`` under FSDP with bf16-true: FSDP's strategy loads the weights
    itself (the checkpoint reaches on_load_checkpoint without "state_dict"); the validated
    predictor is the saved one, in the run's bf16."""
    fit = fit_checkpointed(tmp_path, TraceModule(policy_path=str(policy_dir), lr=1e-4), 1,
                           L.Callback(), strategy=cpu_fsdp())
    ckpt = fit.checkpoint_callback.best_model_path
    saved = torch.load(ckpt, weights_only=False)["state_dict"]

    validate = L.Trainer(accelerator="cpu", devices=1, logger=False, strategy=cpu_fsdp(),
                         precision="bf16-true", enable_progress_bar=False,
                         enable_model_summary=False)
    module = TraceModule(policy_path=str(policy_dir))
    validate.validate(module, dataloaders=DataLoader([{"x": torch.zeros(1)}], batch_size=None),
                      ckpt_path=ckpt)
    for k, v in module.predictor.state_dict().items():
        assert v.dtype == torch.bfloat16
        torch.testing.assert_close(v, saved[f"predictor.{k}"].bfloat16(), atol=0, rtol=0)
