"""The task seam: ``--data.task`` (search QA one task among others), and the module interface."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import lightning as L
import pytest

from trace_lightning.data import TraceDataModule
from trace_lightning.tasks.search_qa.config import DemoConfig, EnvConfig
from trace_lightning.learner import Learner, learner_of
from trace_lightning.tasks.base import Task, TaskData, Turn
from trace_lightning.tasks.search_qa.data import SearchQAData


def test_the_datamodule_takes_any_task_and_nothing_of_search_qa():
    task = SearchQAData(demo=DemoConfig(out_dir="w"), env=EnvConfig(max_seq_tokens=512))
    dm = TraceDataModule(task=task, policy_path="w/model", max_tokens_per_microbatch=1024)
    assert dm.task is task and dm.task.max_seq_tokens == 512 and dm.task.metric == "em"
    own = set(inspect.signature(TraceDataModule).parameters)
    assert not own & set(inspect.signature(SearchQAData).parameters)  # search's are the task's
    with pytest.raises(TypeError, match=r"--data.task must be a TaskData .* got str"):
        TraceDataModule(task="search", policy_path="w/model")


def test_the_task_s_sequence_limit_bounds_the_micro_batches():
    task = SearchQAData(demo=DemoConfig(out_dir="w"), env=EnvConfig(max_seq_tokens=512))
    with pytest.raises(ValueError, match=r"--data.max_tokens_per_microbatch \(256\) must be >= "
                                         r"the task's max_seq_tokens \(512, a setting of "
                                         r"--data.task.init_args\)"):
        TraceDataModule(task=task, policy_path="w/model", max_tokens_per_microbatch=256)


def test_search_environment_is_a_task():
    from trace_lightning.tasks.search_qa.environment import SearchEnvironment

    for name in ("prompt", "parse", "execute", "score"):
        assert callable(getattr(SearchEnvironment, name))
    assert SearchEnvironment.calls_metric == "searches"
    assert Turn("search", "x").calls_tool and not Turn("answer", "x").calls_tool
    assert not Turn("invalid", error="why").calls_tool
    assert Task.__name__ == "Task"


class NotALearner(L.LightningModule):
    def training_step(self, batch, batch_idx):
        return None


def test_the_datamodule_names_what_a_module_lacks():
    trainer = SimpleNamespace(lightning_module=NotALearner())
    with pytest.raises(TypeError, match=r"implements trace_lightning.learner.Learner .* "
                                        r"NotALearner lacks predictor_nodes_seen, "
                                        r"reads_prompt_features, sync_to_engine, predict_trees, receive_step, "
                                        r"check_checkpoint, prepare_update"):
        learner_of(trainer)


def test_trace_module_is_a_learner():
    from trace_lightning.training.module import TraceModule

    module = TraceModule(policy_path="unused")
    assert isinstance(module, Learner)
    assert learner_of(SimpleNamespace(lightning_module=module)) is module
