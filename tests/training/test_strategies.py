"""CPUFSDPStrategy wraps like Lightning's FSDPStrategy, activation checkpointing included."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import wrap

from trace_lightning.training.strategies import CPUFSDPStrategy


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x)


class Holder(nn.Module):
    """A LightningModule's shape: the policy, wrapped by the module itself (``shard_models``),
    beside a part the strategy must leave alone."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy
        self.predictor = nn.Linear(4, 1)


@pytest.fixture
def gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`")
@pytest.mark.parametrize("wrapped_by_module", [False, True])
def test_activation_checkpointing_policy_wraps_the_layers(gloo, wrapped_by_module):
    strategy = CPUFSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block})
    policy = nn.Sequential(Block(), Block())
    if wrapped_by_module:  # what TraceModule.configure_model does under the FSDP strategy
        with strategy.model_sharded_context():
            policy = wrap(policy)
    model = strategy._setup_model(Holder(policy))
    assert any(isinstance(m, FSDP) for m in model.modules())
    checkpointed = [m for m in model.modules() if isinstance(m, CheckpointWrapper)]
    assert len(checkpointed) == 2
    assert all(isinstance(m._checkpoint_wrapped_module, Block) for m in checkpointed)


def test_mixed_precision_keeps_buffers_and_gradient_reduction_in_fp32():
    """Lightning's bf16-mixed FSDP config casts buffers and reductions to bf16; ours keeps
    them fp32 (parameters still compute in bf16). An explicit config and true precisions
    are Lightning's."""
    import torch
    from lightning.pytorch.plugins.precision import FSDPPrecision
    from torch.distributed.fsdp import MixedPrecision

    from trace_lightning.training.strategies import TraceFSDPStrategy

    def config(precision: str, **kwargs) -> MixedPrecision:
        strategy = TraceFSDPStrategy(**kwargs)
        strategy.precision_plugin = FSDPPrecision(precision)
        return strategy.mixed_precision_config

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    got = config("bf16-mixed")
    assert (got.param_dtype, got.reduce_dtype, got.buffer_dtype) == (bf16, fp32, fp32)
    got = config("16-mixed")
    assert (got.param_dtype, got.reduce_dtype, got.buffer_dtype) == (fp16, fp32, fp32)
    got = config("bf16-true")
    assert (got.param_dtype, got.reduce_dtype, got.buffer_dtype) == (bf16, bf16, bf16)
    mine = MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16)
    assert config("bf16-mixed", mixed_precision=mine) is mine


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`")
def test_rope_frequencies_stay_exact_under_bf16_mixed_fsdp(gloo):
    """Qwen3's RoPE ``inv_freq`` is a buffer: under Lightning's bf16-mixed FSDP config the
    first forward rounds it to bf16 for good (up to 3.7e-3 relative error at head_dim 128,
    rope_theta 1e6: over a radian of phase 1,000 tokens apart), so the trainer's log-probs
    drift from vLLM's, which keeps it fp32. Under ours it is the same fp32 tensor after the
    forward."""
    import torch
    from lightning.pytorch.plugins.precision import FSDPPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    cfg = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                      rope_theta=1e6)

    def inv_freq_after_forward(mixed_precision) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(cfg)
        exact = model.model.rotary_emb.inv_freq.clone()
        fsdp = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True,
                    auto_wrap_policy=ModuleWrapPolicy({Qwen3DecoderLayer}),
                    mixed_precision=mixed_precision)
        with torch.no_grad():
            fsdp(input_ids=torch.zeros(1, 4, dtype=torch.long))
        return fsdp.module.model.rotary_emb.inv_freq, exact

    ours = CPUFSDPStrategy()
    ours.precision_plugin = FSDPPrecision("bf16-mixed")
    got, exact = inv_freq_after_forward(ours.mixed_precision_config)
    assert got.dtype == torch.float32 and torch.equal(got, exact)
    # Lightning's own config (what FSDPStrategy used): rounded
    got, exact = inv_freq_after_forward(FSDPPrecision("bf16-mixed").mixed_precision_config)
    assert not torch.equal(got.float(), exact)
    assert ((got.double() - exact.double()) / exact.double()).abs().max() > 1e-3
