"""The search-QA task's typed settings (``--data.task.init_args.env.*``,
``--data.task.init_args.val``, ``--data.task.init_args.demo.*``).

Each is a dataclass whose fields LightningCLI turns into flags and YAML keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trace_lightning.tasks.search_qa.environment import SEARCH_R1_INSTRUCTION, check_settings


@dataclass
class EvalSet:
    """A validation set.

    Args:
        name: the name in metric keys (``val/<name>/em``).
        path: QA JSONL (our schema or FlashRAG's).
        corpus: its BM25 corpus; None uses ``retriever_url`` or the training corpus.
        limit: evaluate the first ``limit`` questions only.
    """

    name: str
    path: str
    corpus: str | None = None
    limit: int | None = None


@dataclass
class EnvConfig:
    """The search agent's environment (see ``SearchEnvironment``).

    Args:
        topk: passages per search.
        max_turns: turns before an episode is cut.
        max_obs_tokens: an observation is cut to this many tokens.
        max_seq_tokens: a trajectory's total tokens before it is cut.
        max_query_chars: a search query is cut to this many characters (a retrieval
            server refuses longer ones: ``trace-lightning-retriever --max-query-chars``).
        instruction: the prompt with ``{question}``; None: Search-R1's.
        use_chat_template: wrap the prompt in the tokenizer's chat template.
        reward: "em", "f1" or "f1_threshold".
        f1_threshold: threshold of the "f1_threshold" reward.
    """

    topk: int = 3
    max_turns: int = 4
    max_obs_tokens: int = 256
    max_seq_tokens: int = 2048
    max_query_chars: int = 2000
    instruction: str | None = None
    use_chat_template: bool = True
    reward: Literal["em", "f1", "f1_threshold"] = "em"
    f1_threshold: float = 0.3

    def __post_init__(self) -> None:
        """What the environment would refuse, refused now, before any engine starts."""
        check_settings(topk=self.topk, max_turns=self.max_turns,
                       max_obs_tokens=self.max_obs_tokens, max_seq_tokens=self.max_seq_tokens,
                       max_query_chars=self.max_query_chars,
                       instruction=self.instruction or SEARCH_R1_INSTRUCTION,
                       reward=self.reward, f1_threshold=self.f1_threshold)


@dataclass
class DemoConfig:
    """The generated demo world (``trace_lightning.tasks.search_qa.demo``); prepared once into ``out_dir``.

    Args:
        out_dir: where the world, tokenizer and warm-started policy are written.
        seed: the training world's seed.
        eval_seed: the held-out world's seed (other entities, same vocabulary).
        warm_start_steps: most supervised steps on gold trajectories before RL (the warm
            start stops earlier once its loss reaches ``options.warm_start_stop_loss``).
        options: further keyword arguments of ``trace_lightning.tasks.search_qa.demo.prepare_demo``.
    """

    out_dir: str = "runs/demo/world"
    seed: int = 0
    eval_seed: int = 1
    warm_start_steps: int = 1000
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        """``options`` holds keyword arguments ``prepare_demo`` takes, none set here."""
        import inspect

        from trace_lightning.tasks.search_qa.demo.prepare import prepare_demo

        own = {"out_dir", "seed", "eval_seed", "warm_start_steps"}
        known = set(inspect.signature(prepare_demo).parameters) - own
        for key in self.options:
            if key in own:
                raise ValueError(f"--data.task.init_args.demo.options sets {key!r}, which is "
                                 f"--data.task.init_args.demo.{key} itself; set that instead")
            if key not in known:
                raise ValueError(f"--data.task.init_args.demo.options: {key!r} is not an option "
                                 f"of the demo world; known: {', '.join(sorted(known))}")


__all__ = ["DemoConfig", "EnvConfig", "EvalSet"]
