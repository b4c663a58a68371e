"""CPUFSDPStrategy wraps like Lightning's FSDPStrategy, activation checkpointing included."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import wrap

from trace_lightning.strategies import CPUFSDPStrategy


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
