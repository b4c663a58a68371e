"""The rollout tree: the one data model from sampling to loss.

A tree holds one prompt's rollouts. The root is the prompt; every other node is one agent
turn: the tokens the policy generated (thought + action) followed by the tokens the
environment appended (the observation), if any. A path root -> leaf is one complete
trajectory; a leaf is a node whose episode ended (answer, malformed output, or a limit).

Bare rollouts are the first rollouts sampled from the root (stage 1); each gets an index
``rollout`` = 0..m-1 that every node of its subtree keeps, continuations included (stage 2
branches from turn-level prefixes of bare rollouts). The tree-aware advantage groups leaves
by prompt and by ``rollout``.

Bottom-up values: a leaf's value is its reward; an inner node's value is the mean reward of
the leaves below it, and ``n_leaves`` counts them. The predictor's targets are these values,
weighted by ``n_leaves``.

Everything here is plain Python (lists, not tensors) so a tree serialises to one JSON line
that a person can read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from trace_lightning.jsonl import write_records


@dataclass
class Node:
    """One node: the root (prompt) or one turn of the agent.

    ``token_ids`` are the tokens this node adds to its parent's sequence. For a turn they
    are the policy's tokens followed by the observation's; ``policy_mask`` is 1 exactly on
    the policy's tokens and ``logprobs`` holds the behaviour log-prob of each policy token
    (0.0 elsewhere).
    """

    id: int
    parent: int | None
    depth: int
    rollout: int  # index of the bare rollout whose subtree holds this node; -1 for the root
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_mask: list[int] = field(default_factory=list)
    text: str = ""  # the policy's text of this turn (the prompt's text for the root)
    observation: str = ""  # the environment's text appended after the action, if any
    action: str = ""  # a tool's name ("search") | "answer" | "invalid" | "" (root)
    argument: str = ""  # the tool call's input (a search query) or the answer
    finished: bool = False  # True on leaves: the episode ended at this node
    finish_reason: str = ""  # "answer" | "invalid" | "max_turns" | "max_tokens" | ""
    reward: float | None = None  # leaves only
    metrics: dict[str, float] | None = None  # leaves only: the task's (search QA: em, f1)
    children: list[int] = field(default_factory=list)
    n_leaves: int = 0
    value: float | None = None  # mean leaf reward below (bottom-up)
    prediction: float | None = None  # predictor's success probability from this prefix
    # rollouts the prediction is worth, read as a Beta belief with mean ``prediction``
    # (PromptHistory sets it on roots); None: taken as exact
    prediction_count: float | None = None
    # roots: rolled out within the last few steps (PromptHistory's ``rest``), so stage 1
    # opens it only when the other candidates cannot take the budget
    resting: bool = False
    continuations: int = 0  # continuations allocated to branch from this prefix

    @property
    def n_policy_tokens(self) -> int:
        return sum(self.policy_mask)


@dataclass
class Budget:
    """What a tree (or a step) cost: the units of equal sampling cost."""

    leaves: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens sent to the engine (before prefix caching)
    cached_tokens: int = 0  # of those, served from the engine's prefix cache, where reported
    tool_calls: int = 0

    def add(self, other: Budget) -> Budget:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)
        return self


@dataclass
class RolloutTree:
    """All rollouts of one prompt."""

    tree_id: str
    question: str
    answers: list[str]
    dataset: str = ""
    nodes: list[Node] = field(default_factory=list)
    budget: Budget = field(default_factory=Budget)
    # the task's description of the prompt (``Task.prompt_features``), the same for every
    # node; empty unless the featuriser asks for it (``Featuriser(task_features=...)``)
    prompt_features: list[float] = field(default_factory=list)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def new(cls, tree_id: str, question: str, answers: list[str], prompt_ids: list[int],
            prompt_text: str = "", dataset: str = "",
            prompt_features: list[float] | None = None) -> RolloutTree:
        root = Node(id=0, parent=None, depth=0, rollout=-1, token_ids=list(prompt_ids),
                    logprobs=[0.0] * len(prompt_ids), policy_mask=[0] * len(prompt_ids),
                    text=prompt_text)
        return cls(tree_id=tree_id, question=question, answers=list(answers), dataset=dataset,
                   nodes=[root], prompt_features=list(prompt_features or []))

    @property
    def root(self) -> Node:
        return self.nodes[0]

    def add_child(self, parent: int, *, rollout: int | None = None, **fields) -> Node:
        """Append a turn under ``parent``; a child of the root starts a new bare rollout."""
        p = self.nodes[parent]
        assert not p.finished, f"node {parent} of tree {self.tree_id} is a leaf"
        if rollout is None:
            assert parent != 0, "children of the root need an explicit rollout index"
            rollout = p.rollout
        node = Node(id=len(self.nodes), parent=parent, depth=p.depth + 1, rollout=rollout,
                    **fields)
        assert len(node.token_ids) == len(node.logprobs) == len(node.policy_mask)
        self.nodes.append(node)
        p.children.append(node.id)
        return node

    # ---- structure ----------------------------------------------------------------------
    def path(self, node_id: int) -> list[Node]:
        """Nodes from the root to ``node_id`` inclusive."""
        out = []
        i: int | None = node_id
        while i is not None:
            out.append(self.nodes[i])
            i = self.nodes[i].parent
        return out[::-1]

    def prefix_ids(self, node_id: int) -> list[int]:
        """The exact token ids of the prefix ending at ``node_id`` (what a continuation resumes)."""
        return [t for n in self.path(node_id) for t in n.token_ids]

    def leaves(self) -> list[Node]:
        return [n for n in self.nodes if n.finished]

    def bare_rollouts(self) -> list[int]:
        """Ids of the root's children, one per bare rollout, in rollout order."""
        return sorted(self.root.children, key=lambda i: self.nodes[i].rollout)

    def prefixes(self) -> list[Node]:
        """Non-leaf turn nodes of the tree: the turn-level prefixes a continuation can resume."""
        return [n for n in self.nodes if n.parent is not None and not n.finished]

    def compute_values(self) -> None:
        """Bottom-up: ``n_leaves`` and ``value`` (mean leaf reward below) for every node.

        A node without finished leaves below (only possible mid-construction) keeps
        ``value=None`` and ``n_leaves=0``.
        """
        sums = [0.0] * len(self.nodes)
        counts = [0] * len(self.nodes)
        for n in reversed(self.nodes):  # children always come after their parent
            if n.finished:
                assert n.reward is not None, f"leaf {n.id} of tree {self.tree_id} has no reward"
                sums[n.id] += n.reward
                counts[n.id] += 1
            if n.parent is not None:
                sums[n.parent] += sums[n.id]
                counts[n.parent] += counts[n.id]
        for n in self.nodes:
            n.n_leaves = counts[n.id]
            n.value = sums[n.id] / counts[n.id] if counts[n.id] else None

    @property
    def mixed(self) -> bool:
        """True when the tree holds a success and a failure (an 'effective' tree)."""
        rewards = {n.reward for n in self.leaves()}
        return len(rewards) > 1

    # ---- training sequences -------------------------------------------------------------
    def flatten(self) -> list[LeafSequence]:
        """One training sequence per leaf: the path's tokens, masks and behaviour log-probs."""
        out = []
        for leaf in self.leaves():
            path = self.path(leaf.id)
            out.append(LeafSequence(
                tree_id=self.tree_id, leaf_id=leaf.id, rollout=leaf.rollout,
                input_ids=[t for n in path for t in n.token_ids],
                policy_mask=[m for n in path for m in n.policy_mask],
                logprobs=[x for n in path for x in n.logprobs],
                reward=float(leaf.reward), ancestors=[n.id for n in path],
            ))
        return out

    # ---- serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RolloutTree:
        d = dict(d)
        known = {f.name for f in fields(Node)}
        unknown = sorted({k for n in d["nodes"] for k in n} - known)
        if unknown:
            raise ValueError(f"tree {d.get('tree_id')!r} has node fields {unknown} that "
                             f"RolloutTree's nodes do not have: it was written by another "
                             f"version of trace-lightning; read it with that version")
        nodes = [Node(**n) for n in d.pop("nodes")]
        budget = Budget(**d.pop("budget"))
        return cls(nodes=nodes, budget=budget, **d)


@dataclass
class LeafSequence:
    """One training sequence: a root-to-leaf path, flattened."""

    tree_id: str
    leaf_id: int
    rollout: int
    input_ids: list[int]
    policy_mask: list[int]  # 1 on tokens the policy generated (the only ones trained on)
    logprobs: list[float]  # behaviour log-probs on policy tokens, 0.0 elsewhere
    reward: float
    ancestors: list[int]  # node ids root..leaf, for ancestor-group advantages
    advantage: float = 0.0  # the leaf's advantage (mean over policy tokens for "segment")
    token_advantages: list[float] | None = None  # per token, aligned with input_ids


def bare_end(tree: RolloutTree, start: int) -> Node:
    """Where the bare rollout that starts at the root's child ``start`` ends.

    Its chain follows each node's first child (the bare rollout's own next turn;
    continuations are added later) to its leaf, or to the node it stopped at unfinished.
    """
    node = tree.nodes[start]
    while not node.finished and node.children:
        node = tree.nodes[node.children[0]]
    return node


def bare_rewards(tree: RolloutTree) -> list[float]:
    """The terminal rewards of the tree's bare rollouts, in rollout order (``bare_reward``
    of each)."""
    return [bare_reward(tree, tree.nodes[i].rollout) for i in tree.bare_rollouts()]


def bare_reward(tree: RolloutTree, rollout: int) -> float:
    """The terminal reward of bare rollout ``rollout``'s own chain (``bare_end``); raises
    unless that rollout is finished and scored."""
    starts = [i for i in tree.root.children if tree.nodes[i].rollout == rollout]
    if len(starts) != 1:
        raise ValueError(f"tree {tree.tree_id} has {len(starts)} bare rollouts with index "
                         f"{rollout}; expected exactly one")
    node = bare_end(tree, starts[0])
    if not node.finished:
        raise ValueError(f"bare rollout {rollout} of tree {tree.tree_id} stops at unfinished "
                         f"node {node.id}; finish the bare rollouts before planning "
                         f"continuations")
    if node.reward is None:
        raise ValueError(f"leaf {node.id} of tree {tree.tree_id} has no reward; score the bare "
                         f"rollouts before planning continuations")
    return float(node.reward)


def write_jsonl(trees: Iterable[RolloutTree], path: str | Path) -> None:
    """Write trees one JSON object per line (written to a temp file, then renamed)."""
    write_records((t.to_dict() for t in trees), path)


def read_jsonl(path: str | Path) -> Iterator[RolloutTree]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tree file {path} does not exist; pass the path a run wrote "
                                f"with write_jsonl (e.g. <log_dir>/trees/epoch_0.jsonl)")
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield RolloutTree.from_dict(json.loads(line))
            except (ValueError, TypeError, KeyError) as e:  # JSONDecodeError is a ValueError
                raise ValueError(f"{path}:{lineno} is not a rollout tree ({e}); each line must be "
                                 f"one tree as written by write_jsonl") from e
