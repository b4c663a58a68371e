"""A real Trainer over hand-built mini-batches (checkpointed, resumable, FSDP on CPU), and
mini-batches sampled token by token from a policy (their log-probs the sampler's)."""

from __future__ import annotations

import random

import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

from trace_lightning.packing.leaves import collate
from trace_lightning.training.module import TraceModule
from trace_lightning.training.strategies import CPUFSDPStrategy
from trace_lightning.tree import LeafSequence

from builders.trees import TINY_VOCAB, random_leaf


def minibatch(seed: int, advantage_nan: bool = False) -> dict:
    """One mini-batch of four random leaves (``random_leaf``) in two micro-batches."""
    rng = random.Random(seed)
    seqs = [random_leaf(rng, n, 3, i) for i, n in enumerate((14, 9, 11, 6))]
    if advantage_nan:
        seqs[2].advantage = float("nan")
    micro = [collate(seqs[:2], pad_id=0), collate(seqs[2:], pad_id=0)]
    return {"micro": micro, "n_tokens": float(sum(sum(s.policy_mask) for s in seqs))}


def fit_checkpointed(root, module: TraceModule, epochs: int, callback: L.Callback, ckpt=None,
                     batches: int = 1, **trainer_kw) -> L.Trainer:
    """A real Trainer, ``batches`` mini-batches an epoch, resumed from ``ckpt`` if given."""
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=str(root),
                        callbacks=[callback], **trainer_kw)
    data = DataLoader([minibatch(i + 1) for i in range(batches)], batch_size=None)
    trainer.fit(module, train_dataloaders=data, ckpt_path=ckpt)
    return trainer


def cpu_fsdp(state_dict_type: str = "full") -> CPUFSDPStrategy:
    """FSDP on one CPU process (gloo), a unit per decoder layer."""
    return CPUFSDPStrategy(auto_wrap_policy={Qwen3DecoderLayer}, state_dict_type=state_dict_type)


def sampled_minibatches(sampler, n_minibatches: int, seed: int) -> list[dict]:
    """Leaves sampled token by token from ``sampler`` (its log-probs are the behaviour's):
    a 4-token prompt, then 12 sampled tokens; 3 leaves per mini-batch, advantages +-1."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for b in range(n_minibatches):
        seqs = []
        for i in range(3):
            ids = torch.randint(1, TINY_VOCAB, (1, 4), generator=gen)
            lps = [0.0] * 4
            with torch.no_grad():
                for _ in range(12):
                    lp = torch.log_softmax(sampler(input_ids=ids).logits[0, -1].double(), -1)
                    tok = torch.multinomial(lp.exp(), 1, generator=gen)
                    lps.append(float(lp[tok]))
                    ids = torch.cat([ids, tok[None]], dim=1)
            adv = 1.0 if (b + i) % 2 else -1.0
            seqs.append(LeafSequence(tree_id=f"t{b}{i}", leaf_id=1, rollout=i,
                                     input_ids=ids[0].tolist(), policy_mask=[0] * 4 + [1] * 12,
                                     logprobs=lps, reward=float(adv > 0), ancestors=[0],
                                     advantage=adv))
        out.append({"micro": [collate(seqs[:2], pad_id=0), collate(seqs[2:], pad_id=0)],
                    "n_tokens": 36.0})
    return out


def perturbed(policy_dir, scale: float = 0.5):
    """The policy with every weight moved by ``scale`` of its tensor's std (seeded)."""
    model = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for p in model.parameters():
            p.add_(scale * p.std().nan_to_num(0.02) * torch.randn(p.shape, generator=g))
    return model
