"""The search-QA task: the ReAct search agent's format (Search-R1 convention) and its
environment, a ``Task`` (``trace_lightning.tasks.base``).

The policy writes ``<think>...</think>`` then either ``<search>query</search>`` (the
environment appends ``<information>Doc 1(Title: T) text ...</information>`` with the top-k
passages) or ``<answer>...</answer>``, which ends the episode. A turn is what the engine
generates until a stop string (``</search>`` or ``</answer>``), EOS or the token limit.

The environment keeps no state beyond the history: any turn-level prefix can be resumed
from its token ids. Rewards are exact match / token F1 of the final answer against every
gold alias; a missing, empty or malformed answer earns 0. Only text the policy generated is
ever parsed, so the instruction's own example ``<answer>`` can never be scored.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

from trace_lightning.tasks.search_qa.reward import reward_from_scores, score_answer
from trace_lightning.tasks.search_qa.retrieval import Passage, Retriever
from trace_lightning.tasks.base import (Example, StatelessTools, Turn, check_stop_strings,
                                        render_prompt, through_first_stop)

SEARCH_R1_INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first "
    "every time you get new information. After reasoning, if you find you lack some knowledge, "
    "you can call a search engine by <search> query </search> and it will return the top "
    "searched results between <information> and </information>. You can search as many times "
    "as your want. If you find no further external knowledge needed, you can directly provide "
    "the answer inside <answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>. Question: {question}\n"
)
STOP_STRINGS = ["</search>", "</answer>"]
# what ``SearchEnvironment.prompt_features`` says of a prompt (--model.featuriser.task_features)
PROMPT_FEATURES = ("title_search_shows", "title_search_first", "question_search_shows")
_TAG_RE = re.compile(r"</?(think|search|answer|information)>")


def parse_turn(text: str) -> Turn:
    """Parse one generated turn; never raises.

    Valid: optional ``<think>...</think>`` blocks, then exactly one ``<search>q</search>`` or
    ``<answer>a</answer>``, then nothing but whitespace. Untagged text before the action
    (before or between think blocks) is reasoning, as in Search-R1, which does not require
    the think tags. Everything else is "invalid" with the reason: unclosed or nested tags,
    two actions, text after the action, an action only inside ``<think>``, an
    ``<information>`` block written by the policy, an empty query, no action at all.
    An empty answer is a (wrong) answer, not a malformed one.
    """
    depth_tag: str | None = None
    pos = 0
    actions: list[tuple[str, str]] = []
    content_start = 0
    trailing = ""
    for m in _TAG_RE.finditer(text):
        tag, closing = m.group(1), m.group(0).startswith("</")
        if depth_tag is None:
            if closing:
                return Turn("invalid", error=f"</{tag}> without an opening tag")
            if tag == "information":
                return Turn("invalid", error="the policy wrote an <information> block")
            if actions:
                return Turn("invalid", error=f"<{tag}> after the action (two actions or text "
                                               f"after the action)")
            depth_tag, content_start = tag, m.end()
        else:
            if not closing or tag != depth_tag:
                return Turn("invalid", error=f"<{m.group(0)[1:-1]}> inside <{depth_tag}> "
                                               f"(nested or unclosed tags)")
            if depth_tag in ("search", "answer"):
                actions.append((depth_tag, text[content_start:m.start()]))
            depth_tag = None
        pos = m.end()
    trailing = text[pos:]
    if depth_tag is not None:
        return Turn("invalid", error=f"<{depth_tag}> is never closed")
    if not actions:
        return Turn("invalid", error="no <search> or <answer> outside <think>")
    if trailing.strip():
        return Turn("invalid", error="text after the action")
    kind, arg = actions[0]
    arg = " ".join(arg.split())
    if kind == "search" and not arg:
        return Turn("invalid", error="empty search query")
    return Turn(kind, arg)


def format_passages(passages: Sequence[Passage]) -> str:
    """Search-R1's observation body: ``Doc i(Title: T) text`` lines."""
    return "".join(f"Doc {i + 1}(Title: {p.title}) {p.text}\n" for i, p in enumerate(passages))


def check_settings(topk: int, max_turns: int, max_obs_tokens: int, max_seq_tokens: int,
                   max_query_chars: int, instruction: str, reward: str,
                   f1_threshold: float) -> None:
    """ValueError naming the ``--data.task.init_args.env`` flag of a setting
    ``SearchEnvironment`` cannot use; ``EnvConfig`` runs it when the run is configured, before
    any engine starts."""
    if "{question}" not in instruction:
        raise ValueError(f"--data.task.init_args.env.instruction must contain '{{question}}'; got "
                         f"{instruction[:80]!r}")
    for flag, value, least in (("max_query_chars", max_query_chars, 1), ("topk", topk, 1),
                               ("max_turns", max_turns, 1),
                               ("max_obs_tokens", max_obs_tokens, 0),  # 0: tags only
                               ("max_seq_tokens", max_seq_tokens, 1)):
        if value < least:
            raise ValueError(f"--data.task.init_args.env.{flag} ({value}) must be >= {least}")
    if reward not in ("em", "f1", "f1_threshold"):
        raise ValueError(f"--data.task.init_args.env.reward ({reward!r}) must be one of 'em', "
                         f"'f1', 'f1_threshold'")
    if not 0.0 < f1_threshold <= 1.0:
        raise ValueError(f"--data.task.init_args.env.f1_threshold ({f1_threshold}) must be in "
                         f"(0, 1]: at 0 every answer, even a missing one (F1 0), would earn "
                         f"reward 1")


class SearchEnvironment(StatelessTools):
    """Prompt, turn parsing, observations and reward of the multi-hop QA search agent: the
    search-QA ``Task`` (its tool is ``search``; metrics ``em`` and ``f1``).

    Args:
        tokenizer: the policy's tokenizer (a transformers tokenizer).
        retriever: where ``<search>`` queries go (BM25 in-process or the HTTP client); None
            for an environment that only builds prompts (``observe`` then raises).
        topk: passages per search.
        max_turns: turns before the episode is cut (reward 0, ``max_turns``).
        max_obs_tokens: an observation's body is cut to this many tokens.
        max_seq_tokens: a trajectory's total tokens before it is cut (``max_tokens``).
        max_query_chars: a search query is cut to this many characters before retrieval (a
            retrieval server refuses longer ones, and no real query is that long).
        instruction: the prompt, with ``{question}``; defaults to Search-R1's.
        use_chat_template: wrap the prompt in the tokenizer's chat template when it has one.
        reward: "em", "f1", or "f1_threshold" (1 when F1 >= ``f1_threshold``).
        f1_threshold: threshold of the "f1_threshold" reward.
    """

    stop = STOP_STRINGS
    calls_metric = "searches"  # validation's count of the searches a trajectory ran
    metrics = ("em", "f1")

    def __init__(self, tokenizer, retriever: Retriever | None, topk: int = 3, max_turns: int = 4,
                 max_obs_tokens: int = 256, max_seq_tokens: int = 2048,
                 max_query_chars: int = 2000, instruction: str = SEARCH_R1_INSTRUCTION,
                 use_chat_template: bool = True,
                 reward: Literal["em", "f1", "f1_threshold"] = "em", f1_threshold: float = 0.3):
        check_settings(topk=topk, max_turns=max_turns, max_obs_tokens=max_obs_tokens,
                       max_seq_tokens=max_seq_tokens, max_query_chars=max_query_chars,
                       instruction=instruction, reward=reward, f1_threshold=f1_threshold)
        self.tokenizer = tokenizer
        self.retriever = retriever
        self.topk, self.max_turns = topk, max_turns
        self.max_obs_tokens, self.max_seq_tokens = max_obs_tokens, max_seq_tokens
        self.max_query_chars = max_query_chars
        self.instruction, self.use_chat_template = instruction, use_chat_template
        self.reward_kind, self.f1_threshold = reward, f1_threshold
        check_stop_strings(tokenizer, self.stop)
        self._described: dict[tuple[str, str], list[float]] = {}  # prompt_features' cache
        self._obs_open = self._encode("\n\n<information>")
        self._obs_close = self._encode("</information>\n\n")

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt(self, example: Example | str) -> tuple[list[int], str]:
        """Token ids and text of the root prompt for ``example`` (or a question's text)."""
        question = example.question if isinstance(example, Example) else example
        return render_prompt(self.tokenizer, self.instruction, question, self.use_chat_template)

    def parse(self, text: str) -> Turn:
        """One generated turn, cut at its first stop string, parsed (``parse_turn``)."""
        return parse_turn(through_first_stop(text, self.stop))

    def execute(self, calls: Sequence[Turn], states: Sequence[None] = ()
                ) -> list[tuple[list[int], str]]:
        """The observation of each search, in one retriever call (``observe``; the retriever
        keeps no state per trajectory: ``states`` is unused)."""
        return self.observe([c.argument for c in calls])

    def observe(self, queries: list[str]) -> list[tuple[list[int], str]]:
        """One batched retriever call; token ids and text of each observation (of at most
        ``topk`` passages, even where the retriever answered more)."""
        if not queries:
            return []
        if self.retriever is None:
            raise RuntimeError("this SearchEnvironment was built without a retriever (prompts "
                               "only); pass one to search")
        results = self.retriever.search([q[: self.max_query_chars] for q in queries],
                                        self.topk)
        out = []
        for passages in results:
            # at most topk, whatever the retriever answered: the observation is the run's
            body = self._encode(format_passages(passages[: self.topk]))[: self.max_obs_tokens]
            ids = self._obs_open + body + self._obs_close
            out.append((ids, self.tokenizer.decode(ids)))
        return out

    def prompt_features(self, example: Example) -> list[float]:
        """How findable the documents ``example``'s answer passes through
        (``extras["supporting_titles"]``) are with the retriever the agent searches, before any rollout:
        ``PROMPT_FEATURES``, each the share of those documents that

            [a search for the document's own title shows among its ``topk`` passages,
             that search ranks first,
             a search for the question itself shows]

        An agent fails where the document it needs is crowded out by others that share its
        words (a namesake's, a distractor's); the policy's features of the prompt cannot see
        the corpus. Zeros for an example without supporting titles. One batched retriever
        call per prompt, kept for this environment's life (a training step builds its own, so
        a prompt is described once per step it is a candidate in)."""
        key = (example.dataset, example.id)
        if key in self._described:
            return self._described[key]
        titles = list(example.extras.get("supporting_titles", []))
        out = [0.0] * len(PROMPT_FEATURES)
        if titles:
            if self.retriever is None:
                raise RuntimeError("this SearchEnvironment was built without a retriever "
                                   "(prompts only); pass one to describe prompts")
            queries = [q[: self.max_query_chars] for q in titles + [example.question]]
            *by_title, by_question = self.retriever.search(queries, self.topk)
            shown = [t in {p.title for p in r[: self.topk]} for t, r in zip(titles, by_title)]
            first = [bool(r) and r[0].title == t for t, r in zip(titles, by_title)]
            asked = {p.title for p in by_question[: self.topk]}
            out = [sum(shown) / len(titles), sum(first) / len(titles),
                   sum(t in asked for t in titles) / len(titles)]
        self._described[key] = out
        return out

    def score(self, final: Turn, example: Example, state: None = None
              ) -> tuple[float, dict[str, float]]:
        """The reward of a trajectory of ``example`` that ended on ``final`` and its ``em``
        and ``f1``; 0 unless it answered."""
        answer = final.argument if final.kind == "answer" else None
        em, f1 = score_answer(answer, example.answers)
        reward = reward_from_scores(em, f1, self.reward_kind, self.f1_threshold)
        return reward, {"em": em, "f1": f1}
