"""Each prompt's own past outcomes: sharper root predictions for prompts seen before.

The shared predictor generalises across prompts from their features; for a prompt that was
rolled out in earlier steps, its own outcomes are direct evidence that the features may not
carry (which questions a policy always fails is hard to read from its prompt states alone).
The predictor's root prediction ``p`` is read as a Beta prior worth ``strength`` rollouts and
updated by the prompt's past bare rollouts, each discounted by ``decay`` per step since it
was sampled (the policy has moved since):

    v = (strength * p + s) / (strength + n)
    s = sum_k decay^(t - t_k) r_k,    n = sum_k decay^(t - t_k)

where rollout k of the prompt was sampled at step t_k with reward r_k, and t is the current
step. A prompt never rolled out keeps ``v = p``. Only bare rollouts count (``bare_reward``:
from each root child, the path through first children); continuations start at prefixes the
allocator chose, so their outcomes are a biased sample of the root's success.

Choosing ``strength``: a Beta prior matching success rates with mean mu and variance s2
across prompts has strength ``mu (1 - mu) / s2 - 1`` (method of moments). On the demo world
(mu = 0.30, s2 = 0.107 after removing the binomial noise of 8 samples) that is about 1.

With ``belief=True`` the root solver reads the posterior as a belief, not a point: with
``prediction_count = strength + n`` it maximises the expected chance of mixed leaves under
``Beta(v c, (1-v) c)`` (``math.solvers.expected_root_values``). Two rollouts of a prompt never
seen, predicted 0.5 from its features alone (worth 1), are then worth 0.25, against 0.42 for
a prompt whose 4 past rollouts came out 2 right and 0.5 for an exact 0.5: the unseen one may
well be a prompt that always fails. Ranking prompts by a noisy point estimate instead picks
the ones whose noise looks best.

Prefix predictions are left alone: a prefix is new every time. The same idea, as a filter
rather than a posterior, is GRESO's skipping of prompts whose recent groups had no variance.

``rest`` is a floor on breadth: a prompt rolled out at step t_k rests through step
t_k + rest (``Node.resting`` on its root), and the root solver leaves resting prompts closed
while the other candidates can take its budget. Beliefs make the solver re-open the prompts
whose history says they are mixed, step after step, which can narrow training to a few
prompts (docs/results_log.md, "Where allocation pays"). With ``rest`` r a prompt is
opened at most once in r + 1 steps.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

from trace_lightning.tree import bare_rewards
from trace_lightning.tree import RolloutTree

log = logging.getLogger(__name__)

# (prompt id, step of the last record, discounted successes s, discounted rollouts n)
Outcome = tuple[str, int, float, float]


class PromptHistory:
    """Discounted success counts per prompt, and the posterior they give a root prediction.

    Args:
        strength: the predictor's root prediction counts as this many rollouts (> 0); the
            smaller, the more one past group outweighs the predictor.
        decay: weight of a rollout per step of age, in (0, 1]; 1 keeps every past rollout
            at full weight, smaller values follow a moving policy.
        belief: hand the root solver the posterior as a belief worth ``strength + n``
            rollouts (``Node.prediction_count``); False: as an exact prediction. Measured on
            the demo: better when most candidates were rolled out before (many epochs over
            a small set), worse when most are new.
        rest: steps a prompt rests after it was rolled out, closed to the root solver
            unless the other candidates cannot take its budget (0: never rests).
    """

    def __init__(self, strength: float = 2.0, decay: float = 0.8, belief: bool = False,
                 rest: int = 0) -> None:
        if not strength > 0 or not math.isfinite(strength):
            raise ValueError(f"history strength ({strength}) must be a finite number > 0: the "
                             f"predictor's prediction counts as that many rollouts")
        if not 0 < decay <= 1:
            raise ValueError(f"history decay ({decay}) must be in (0, 1]; 1 never forgets")
        if isinstance(rest, bool) or not isinstance(rest, int) or rest < 0:
            raise ValueError(f"history rest ({rest!r}) must be a whole number of steps >= 0; "
                             f"0 lets the solver re-open a prompt at the next step")
        self.strength, self.decay, self.belief, self.rest = strength, decay, belief, rest
        self._counts: dict[str, tuple[int, float, float]] = {}  # id -> (step, s, n)

    def __len__(self) -> int:
        return len(self._counts)

    def counts(self, prompt_id: str, step: int) -> tuple[float, float]:
        """``(s, n)`` of a prompt, discounted to ``step``; ``(0, 0)`` if never seen."""
        if prompt_id not in self._counts:
            return 0.0, 0.0
        last, s, n = self._counts[prompt_id]
        w = self.decay ** max(step - last, 0)
        return s * w, n * w

    def record(self, outcomes: Iterable[Outcome]) -> None:
        """Add outcomes (from ``outcomes_of``, possibly gathered from every rank)."""
        for prompt_id, step, s_new, n_new in outcomes:
            s, n = self.counts(prompt_id, step)
            self._counts[prompt_id] = (step, s + s_new, n + n_new)

    @staticmethod
    def outcomes_of(trees: Iterable[RolloutTree], step: int) -> list[Outcome]:
        """One step's bare-rollout outcomes per tree, ready for ``record``."""
        out = []
        for t in trees:
            rewards = bare_rewards(t)
            if rewards:
                out.append((t.tree_id, step, float(sum(rewards)), float(len(rewards))))
        return out

    def resting(self, prompt_id: str, step: int) -> bool:
        """Whether the prompt was rolled out within the ``rest`` steps before ``step``."""
        last = self._counts.get(prompt_id)
        return last is not None and 0 < step - last[0] <= self.rest

    def posterior(self, prompt_id: str, prior: float, step: int) -> float:
        """``(strength * prior + s) / (strength + n)`` with the prompt's counts at ``step``."""
        s, n = self.counts(prompt_id, step)
        return (self.strength * prior + s) / (self.strength + n)

    def adjust(self, trees: Iterable[RolloutTree], step: int) -> None:
        """Replace each root's ``prediction`` by its posterior mean and, with ``belief``, set
        ``prediction_count`` to the rollouts it is worth, ``strength + n`` (roots without a
        prediction are left); mark the roots of resting prompts (``Node.resting``).

        A count the prediction already carries (``RootNeighbours``' belief) stands in for
        ``strength`` in it; without ``belief`` it is kept for a prompt never rolled out (no
        evidence of its own) and dropped for the others (their posterior is exact)."""
        for t in trees:
            t.root.resting = self.resting(t.tree_id, step)
            if t.root.prediction is not None:
                n = self.counts(t.tree_id, step)[1]
                given = t.root.prediction_count
                t.root.prediction = self.posterior(t.tree_id, t.root.prediction, step)
                if self.belief:
                    t.root.prediction_count = (self.strength if given is None else given) + n
                else:
                    t.root.prediction_count = given if n == 0 else None

    def state_dict(self) -> dict:
        return {"strength": self.strength, "decay": self.decay, "belief": self.belief,
                "rest": self.rest, "counts": {k: list(v) for k, v in self._counts.items()}}

    def load_state_dict(self, state: dict) -> None:
        """The prompts' counts come back; ``strength``, ``decay``, ``belief`` and ``rest``
        stay as configured (a resumed run with new settings uses them, and says what
        changed)."""
        saved = {k: state[k] for k in ("strength", "decay", "belief", "rest") if k in state}
        changed = {k: v for k, v in saved.items() if v != getattr(self, k)}
        if changed:
            log.warning("model.history: the checkpoint's %s differ from this run's %s; the "
                        "run's settings apply to the restored counts", changed,
                        {k: getattr(self, k) for k in changed})
        self._counts = {k: (int(v[0]), float(v[1]), float(v[2]))
                        for k, v in state["counts"].items()}


__all__ = ["Outcome", "PromptHistory"]
