"""The task seam: ``--data.task`` beside the search-QA flags, and the module interface."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest

from trace_lightning.data import TraceDataModule
from trace_lightning.tasks.search_qa.config import DemoConfig, EnvConfig
from trace_lightning.learner import Learner, learner_of
from trace_lightning.tasks.base import Task, TaskData, Turn
from trace_lightning.tasks.search_qa.data import SearchQAData


def test_a_task_beside_the_search_qa_flags_is_one_error():
    task = SearchQAData(demo=DemoConfig(out_dir="runs/demo/world"))
    with pytest.raises(ValueError, match=r"--data.task \(SearchQAData\) and --data.corpus, "
                                         r"--data.env are both set: those are the search-QA "
                                         r"task's settings"):
        TraceDataModule(task=task, corpus="c.jsonl", env=EnvConfig(),
                        policy_path="runs/demo/world/model")


def test_without_a_task_the_search_qa_flags_build_it():
    dm = TraceDataModule(demo=DemoConfig(out_dir="w"), env=EnvConfig(max_seq_tokens=512),
                         policy_path="w/model", max_tokens_per_microbatch=1024)
    assert isinstance(dm.task, SearchQAData) and isinstance(dm.task, TaskData)
    assert dm.task.max_seq_tokens == 512 and dm.task.metric == "em"


def test_the_task_s_sequence_limit_bounds_the_micro_batches():
    with pytest.raises(ValueError, match=r"--data.max_tokens_per_microbatch \(256\) must be >= "
                                         r"the task's max_seq_tokens \(512"):
        TraceDataModule(demo=DemoConfig(out_dir="w"), env=EnvConfig(max_seq_tokens=512),
                        policy_path="w/model", max_tokens_per_microbatch=256)


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
                                        r"check_checkpoint_predictor, prepare_update"):
        learner_of(trainer)


def test_trace_module_is_a_learner():
    from trace_lightning.training.module import TraceModule

    module = TraceModule(policy_path="unused")
    assert isinstance(module, Learner)
    assert learner_of(SimpleNamespace(lightning_module=module)) is module
