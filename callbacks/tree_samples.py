"""TreeSamples: read a few of each epoch's rollout trees (``samples/*``).

Per epoch (rank 0's trees): ``samples/trees``, a text panel with a few trees (question, gold
answers, then every turn as an indented tree: action and argument, the policy's text and the
observation shortened, predictions and values, where continuations branched off, and each
leaf's reward); ``samples/tree``, a picture of the first of them (nodes at (depth, order),
coloured by value; leaves as squares coloured by reward; branched prefixes ringed); and
optionally every tree of the epoch as JSONL (``write_jsonl``) under
``<log_dir>/trees/epoch_<E>_rank_<R>.jsonl``, one file per rank.

Trees are chosen mixed first (a success and a failure), then by branched prefixes and
leaves, so the samples show the contrast the allocation found.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import numpy as np

from callbacks._common import (RolloutCallback, check_datamodule, current_step,
                               figure_to_chw, log_step, tensorboard_logger)
from trace_lightning.tree import RolloutTree, write_jsonl


class TreeSamples(RolloutCallback):
    """A few rollout trees per epoch as text and a picture (``samples/*``).

    Args:
        n_trees: trees shown as text per epoch.
        max_chars: each text or observation is shortened to this many characters.
        image: also draw the first shown tree as an image.
        jsonl: also write every tree of the epoch as JSONL into the logger's log_dir.
        every_n_epochs: log every n-th epoch (1 = every epoch).
    """

    def __init__(self, n_trees: int = 2, max_chars: int = 160, image: bool = True,
                 jsonl: bool = False, every_n_epochs: int = 1):
        if n_trees < 1 or max_chars < 8 or every_n_epochs < 1:
            raise ValueError(f"TreeSamples needs n_trees >= 1 ({n_trees}), max_chars >= 8 "
                             f"({max_chars}) and every_n_epochs >= 1 ({every_n_epochs})")
        self.n_trees = n_trees
        self.max_chars = max_chars
        self.image = image
        self.jsonl = jsonl
        self.every_n_epochs = every_n_epochs

    def tensorboard_for(self) -> str:
        return "text and images"

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epoch = trainer.current_epoch
        if epoch % self.every_n_epochs:
            return
        dm = check_datamodule(trainer.datamodule, "TreeSamples")
        step = current_step(trainer, dm, "TreeSamples")
        if self.jsonl:
            log_dir = trainer.log_dir  # a broadcast: every rank asks
            if step is not None and log_dir is not None:
                write_jsonl(step.trees, Path(log_dir) / "trees" /
                            f"epoch_{epoch}_rank_{trainer.global_rank}.jsonl")
        tb = tensorboard_logger(trainer)
        if step is None or not step.trees or tb is None or not trainer.is_global_zero:
            return
        shown = pick_trees(step.trees, self.n_trees)
        text = f"epoch {epoch}: {len(shown)} of this rank's {len(step.trees)} trees\n\n"
        text += "\n\n---\n\n".join(tree_markdown(t, self.max_chars) for t in shown)
        tb.experiment.add_text("samples/trees", text, global_step=log_step(trainer))
        if self.image:
            fig = tree_figure(shown[0], title=f"epoch {epoch}: {shorten(shown[0].question, 70)}")
            tb.experiment.add_image("samples/tree", figure_to_chw(fig),
                                    global_step=log_step(trainer))


def pick_trees(trees: list[RolloutTree], n: int) -> list[RolloutTree]:
    """Mixed trees first, then more branched prefixes, then more leaves; stable."""
    def key(i: int):
        t = trees[i]
        return (not t.mixed, -sum(x.continuations > 0 for x in t.nodes), -len(t.leaves()), i)

    return [trees[i] for i in sorted(range(len(trees)), key=key)[:n]]


def shorten(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def tree_markdown(tree: RolloutTree, max_chars: int = 160) -> str:
    """One tree as markdown: a header, then the turns as an indented (code-block) tree."""
    leaves = tree.leaves()
    mean_r = sum(float(n.reward or 0.0) for n in leaves) / max(len(leaves), 1)
    head = [f"**tree** `{tree.tree_id}`" + (f" ({tree.dataset})" if tree.dataset else ""),
            f"**question:** {shorten(tree.question, 4 * max_chars)}",
            f"**gold:** {' | '.join(tree.answers) or '-'}",
            f"**leaves:** {len(leaves)}, mean reward {mean_r:.2f}, "
            f"{'mixed' if tree.mixed else 'not mixed'}; root prediction "
            f"{_num(tree.root.prediction)}, value {_num(tree.root.value)}"]
    lines: list[str] = []

    def walk(node_id: int, indent: str, last: bool) -> None:
        n = tree.nodes[node_id]
        branch = "└─ " if last else "├─ "
        more = "   " if last else "│  "
        what = f"{n.action or 'turn'}"
        if n.argument:
            what += f': "{shorten(n.argument, max_chars // 2)}"'
        cont = n.parent != 0 and tree.nodes[n.parent].children.index(n.id) > 0
        info = [f"[{n.id}] r{n.rollout} d{n.depth}{' (continuation)' if cont else ''} {what}"]
        if n.prediction is not None:
            info.append(f"pred {n.prediction:.2f}")
        if not n.finished and n.value is not None:
            info.append(f"value {n.value:.2f} over {n.n_leaves}")
        if n.continuations:
            info.append(f"<< branched: +{n.continuations} continuations")
        if n.finished:
            mark = "ok" if (n.reward or 0.0) > 0 else "x"
            scores = "".join(f"{k} {_num(v)}, " for k, v in (n.metrics or {}).items())
            info.append(f"=> reward {_num(n.reward)} {mark} ({scores}{n.finish_reason or 'end'})")
        lines.append(indent + branch + "  ".join(info))
        if n.text:
            lines.append(indent + more + "   says: " + shorten(n.text, max_chars))
        if n.observation:
            lines.append(indent + more + "   obs:  " + shorten(n.observation, max_chars))
        for k, c in enumerate(n.children):
            walk(c, indent + more, k == len(n.children) - 1)

    lines.append(f"[0] root  value {_num(tree.root.value)} over {tree.root.n_leaves} leaves")
    for k, c in enumerate(tree.root.children):
        walk(c, "", k == len(tree.root.children) - 1)
    # a 4-space indent makes a markdown code block: the tree keeps its layout in TensorBoard
    return "  \n".join(head) + "\n\n" + "\n".join("    " + ln for ln in lines)


def tree_layout(tree: RolloutTree) -> dict[int, tuple[float, float]]:
    """(x, y) per node: x = depth; leaves at y = 0, 1, ... in depth-first order; an inner
    node at the mean y of its children."""
    pos: dict[int, tuple[float, float]] = {}
    next_y = [0.0]

    def place(node_id: int) -> float:
        n = tree.nodes[node_id]
        if not n.children:
            y = next_y[0]
            next_y[0] += 1.0
        else:
            y = float(np.mean([place(c) for c in n.children]))
        pos[node_id] = (float(n.depth), y)
        return y

    place(0)
    return pos


def tree_figure(tree: RolloutTree, title: str = ""):
    """A picture of one tree: edges, nodes coloured by value, leaves by reward, branches
    ringed with their continuation count."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    pos = tree_layout(tree)
    n_leaves = max(1, sum(1 for n in tree.nodes if not n.children))
    depth = max(n.depth for n in tree.nodes)
    fig = Figure(figsize=(min(3 + 1.4 * depth, 12), min(2 + 0.35 * n_leaves, 12)), dpi=100)
    ax = fig.subplots()
    cmap, norm = colormaps["RdYlGn"], Normalize(0.0, 1.0)
    for n in tree.nodes:
        if n.parent is not None:
            (x0, y0), (x1, y1) = pos[n.parent], pos[n.id]
            xm = x0 + 0.5 * (x1 - x0)
            ax.plot([x0, xm, xm, x1], [y0, y0, y1, y1], color="0.65", linewidth=1, zorder=1)
    for n in tree.nodes:
        x, y = pos[n.id]
        colour = "0.8" if n.value is None else cmap(norm(n.value))
        if n.finished:
            ax.scatter([x], [y], marker="s", s=70, color=colour, edgecolors="black",
                       linewidths=0.6, zorder=3)
            ax.annotate(f"r={_num(n.reward)}", (x, y), xytext=(6, -3),
                        textcoords="offset points", fontsize=7)
        else:
            ax.scatter([x], [y], marker="*" if n.parent is None else "o",
                       s=160 if n.parent is None else 50, color=colour, edgecolors="black",
                       linewidths=0.6, zorder=3)
            if n.prediction is not None:
                ax.annotate(f"p={n.prediction:.2f}", (x, y), xytext=(-10, 10),
                            textcoords="offset points", fontsize=6, color="0.3")
        if n.continuations:
            ax.scatter([x], [y], marker="o", s=260, facecolors="none", edgecolors="C0",
                       linewidths=1.5, zorder=2)
            ax.annotate(f"+{n.continuations}", (x, y), xytext=(-4, -13),
                        textcoords="offset points", fontsize=7, color="C0")
    fig.colorbar(ScalarMappable(norm, cmap), ax=ax, label="value (mean leaf reward)", fraction=0.05)
    ax.set_xlabel("depth (turn)")
    ax.set_xticks(range(depth + 1))
    ax.set_yticks([])
    ax.invert_yaxis()
    ax.margins(x=0.15, y=0.08)
    ax.set_title(title or tree.tree_id, fontsize=9)
    fig.tight_layout()
    return fig
