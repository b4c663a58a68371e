"""TraceModule: the policy, the shared success predictor, and the tree-aware update.

The policy is any transformers causal LM, built in ``configure_model`` so FSDP can shard it.
The predictor ``V(H)`` steers allocation only: it trains on each step's bottom-up tree values
(with a replay of recent steps) by its own optimizer and never enters the policy gradient.
With ``neighbours`` set, root predictions are updated by the outcomes of the most similar
prompts rolled out before (``RootNeighbours``); with ``history``, those of prompts rolled out
before by their own past outcomes (``PromptHistory``).

Optimisation is manual: one ``training_step`` is one mini-batch of the step's trees, each
forwarded once (``tree_packing``; or of loose leaves, one row each), split into token-packed
micro-batches whose losses are normalised by the mini-batch's (leaf, policy token) pairs, so the gradient is the token-mean over the whole mini-batch (over all ranks: the
divisor is their summed tokens over the rank count, and DDP / FSDP average the gradients).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Literal, get_args

import lightning as L
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from trace_lightning.math.advantage import ADVANTAGE_KINDS, AdvantageKind
from trace_lightning.rollout.step import RolloutStep
from trace_lightning.rollout.engines.sync import sync_weights
from trace_lightning.allocation.history import PromptHistory
from trace_lightning.allocation.neighbours import RootNeighbours
from trace_lightning.logs import log_scalars
from trace_lightning.math.loss import selected_token_logprobs, weighted_policy_loss
from trace_lightning.allocation.features import Featuriser, take_node_features
from trace_lightning.allocation.predictor import SuccessPredictor
from trace_lightning.training.predictor_life import PredictorLife
from trace_lightning.tree import RolloutTree
from trace_lightning.packing.attention import TREE_SDPA, attention_inputs
from trace_lightning.packing.trees import WEIGHT_KEYS
from trace_lightning.math.rollout_correction import RolloutIS, RolloutRS
from trace_lightning.training.checkpoints import check_checkpoint
from trace_lightning.training.rollout_correction import RolloutCorrection, start_logprobs



AttentionKind = Literal["auto", "sdpa", "flex_attention"]
ATTENTION_KINDS: tuple[str, ...] = get_args(AttentionKind)


def flex_attention_available() -> bool:
    """Whether torch has FlexAttention and transformers can run a model on it."""
    from transformers.utils import is_torch_flex_attn_available

    return is_torch_flex_attn_available()


# Dropout probabilities in transformers configs (names vary by architecture).
DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "dropout", "attn_pdrop", "resid_pdrop",
                "embd_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob",
                "classifier_dropout", "activation_dropout")


def without_dropout(config):
    """``config`` with every dropout probability 0: the policy trains in train mode, and a
    dropout mask there would make its log-probs differ from the sampler's (which runs in eval
    mode) before any update, so the PPO ratio and its clipping would see noise, not policy
    change (as TRL and verl do)."""
    for key in DROPOUT_KEYS:
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)
    return config


class TraceModule(L.LightningModule):
    """Policy + shared predictor, trained with TRACE's tree rollouts; the ``Learner`` the
    DataModule's RL step works through (``trace_lightning.learner``).

    Args:
        policy_path: directory of a transformers causal LM and its tokenizer
            (``save_pretrained``), or a hub id (owner/name), fetched once into the Hugging
            Face cache (``trace_lightning.hub``).
        dtype: the policy's parameter dtype ("float32", "bfloat16", "float16"; mixed
            precision is ``--trainer.precision``).
        lr: policy learning rate (AdamW).
        weight_decay: policy weight decay.
        betas: AdamW betas.
        max_grad_norm: clip the policy's gradient norm (0 = off).
        advantage: tree advantage: "tree_grpo" (default), "treepo", "segment", "grpo",
            "branch_grpo" (trace_lightning/math/advantage.py).
        clip_low: lower clip of the importance ratio (1 - clip_low).
        clip_high: upper clip of the importance ratio (1 + clip_high).
        dual_clip: for a negative advantage, cap the loss term -A ratio at -A dual_clip
            (dual-clip PPO, verl's clip_ratio_c; > 1, None: off).
        kl_coef: weight of the k3 KL to a frozen copy of the initial policy (0 = no reference).
        featuriser: how prefixes become predictor features.
        predictor_hidden: width of the predictor's hidden layer.
        predictor_lr: predictor learning rate (AdamW).
        predictor_epochs: most passes over the replay per step (early-stopped on a held-out
            share, ``predictor_holdout``).
        predictor_holdout: share of the replay held out to stop the predictor's fit early
            (0: no early stopping).
        predictor_batch_size: predictor mini-batch size.
        replay_steps: steps of tree nodes kept for the predictor.
        history: update root predictions with each prompt's own past outcomes (a
            ``PromptHistory``: prompts revisited across epochs); None: the predictor alone.
        neighbours: update root predictions with the outcomes of the most similar prompts
            rolled out before (a ``RootNeighbours``: prompts never seen, as in one pass over
            a large set); None: the predictor alone.
        prefix_outcomes: update each prefix's prediction with what stage 2 has seen of its
            prompt: its own bare rollout's reward and its siblings' (a ``PrefixPosterior``
            fitted on the last ``replay_steps`` steps' continuations); False: the predictor
            alone.
        gradient_checkpointing: trade compute for memory in the policy.
        lr_warmup_steps: raise the policy's lr linearly over its first this many optimizer
            steps (0: full lr from the first step).
        compile_layers: ``torch.compile`` each of the policy's decoder layers (regional
            compilation: one layer's code, compiled once and reused) before FSDP wraps them,
            for faster training steps once compiled; the first steps pay the compilation, and
            new batch shapes may recompile.
        tree_packing: forward each tree's tokens once in the update (its leaves' shared
            prefixes are not recomputed per leaf) and its nodes' predictor features in one
            pass per tree; the objective is the per-leaf one exactly
            (``trace_lightning.packing.trees``). False: one row per leaf, mini-batches of
            loose leaves (for comparison).
        attention: the policy's attention kernel: "auto" (with ``tree_packing`` on CUDA,
            FlexAttention with a block mask where torch and transformers offer it; else
            "sdpa"), "sdpa" (a packed tree's nodes each attend their root path in one SDPA
            call, ``trace_lightning.packing.attention``; per-leaf rows plain causal SDPA) or
            "flex_attention".
        rollout_is: rollout correction's importance weights (verl's
            ``rollout_correction.rollout_is``): "token" or "sequence" truncated IS of
            ``pi_old / pi_rollout`` (trainer at the step's start over sampler), or null (none);
            any correction on makes the loss's ratio ``pi / pi_old``
            (``trace_lightning.training.rollout_correction``). The mismatch is logged either
            way (``rollout_correction/*``).
        rollout_is_threshold: truncation ``C`` of the IS weights; the mismatch's
            ``share_past_bound`` counts ratios outside ``[1/C, C]``.
        rollout_rs: rejection (masked IS): "token", "sequence" or "geometric" (a leaf's
            mean log-ratio), or null (none).
        rollout_rs_threshold: upper bound of the kept ratios (null: ``rollout_is_threshold``).
        rollout_rs_threshold_lower: lower bound (null: 1 / upper).
        rollout_token_veto_threshold: drop a leaf holding a token whose ratio is below this
            (null: no veto).
    """

    def __init__(self, policy_path: str, dtype: str = "float32", lr: float = 1e-5,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 max_grad_norm: float = 1.0, advantage: AdvantageKind = "tree_grpo",
                 clip_low: float = 0.2, clip_high: float = 0.28,
                 dual_clip: float | None = None, kl_coef: float = 0.0,
                 featuriser: Featuriser | None = None, predictor_hidden: int = 256,
                 predictor_lr: float = 1e-3, predictor_epochs: int = 4,
                 predictor_batch_size: int = 256, predictor_holdout: float = 0.2,
                 replay_steps: int = 4, history: PromptHistory | None = None,
                 neighbours: RootNeighbours | None = None, prefix_outcomes: bool = False,
                 gradient_checkpointing: bool = False, lr_warmup_steps: int = 0,
                 compile_layers: bool = False, tree_packing: bool = True,
                 attention: AttentionKind = "auto", rollout_is: RolloutIS | None = None,
                 rollout_is_threshold: float = 2.0, rollout_rs: RolloutRS | None = None,
                 rollout_rs_threshold: float | None = None,
                 rollout_rs_threshold_lower: float | None = None,
                 rollout_token_veto_threshold: float | None = None):
        super().__init__()
        self.correction = RolloutCorrection(rollout_is, rollout_is_threshold, rollout_rs,
                                            rollout_rs_threshold, rollout_rs_threshold_lower,
                                            rollout_token_veto_threshold)
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"--model.attention ({attention!r}): expected one of "
                             f"{', '.join(map(repr, ATTENTION_KINDS))}")
        if advantage not in ADVANTAGE_KINDS:
            raise ValueError(f"--model.advantage ({advantage!r}): expected one of "
                             f"{', '.join(map(repr, ADVANTAGE_KINDS))}")
        for flag, value, ok, rule in (
                ("lr", lr, lr > 0, "> 0"),
                ("lr_warmup_steps", lr_warmup_steps, lr_warmup_steps >= 0, ">= 0 (0: no warm-up)"),
                ("max_grad_norm", max_grad_norm, max_grad_norm >= 0, ">= 0 (0: measure only)"),
                ("kl_coef", kl_coef, kl_coef >= 0, ">= 0 (0: no KL term, no reference model)"),
                ("predictor_lr", predictor_lr, predictor_lr > 0, "> 0"),
                ("predictor_epochs", predictor_epochs, predictor_epochs >= 0, ">= 0"),
                ("predictor_batch_size", predictor_batch_size, predictor_batch_size >= 1, ">= 1"),
                ("predictor_holdout", predictor_holdout, 0 <= predictor_holdout < 1,
                 "in [0, 1) (0: no early stopping)"),
                ("replay_steps", replay_steps, replay_steps >= 1, ">= 1 (1: this step only)")):
            if not ok:
                raise ValueError(f"--model.{flag} ({value}) must be {rule}")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--model.dtype ({dtype!r}) must be 'float32', 'bfloat16' or "
                             f"'float16' (the weights' dtype; mixed precision is "
                             f"--trainer.precision)")
        if not 0 <= clip_low < 1 or clip_high < 0:
            raise ValueError(f"--model.clip_low ({clip_low}) must be in [0, 1) and "
                             f"--model.clip_high ({clip_high}) >= 0")
        if dual_clip is not None and not dual_clip > 1.0:
            raise ValueError(f"--model.dual_clip ({dual_clip}) must be > 1 (verl uses 3.0) or "
                             f"null (off)")
        self.save_hyperparameters(ignore=["featuriser", "history", "neighbours"])
        self.automatic_optimization = False
        # the predictor's features, replay, neighbours, history, posterior, optimizer and
        # counters
        self.predictor_life = PredictorLife(
            featuriser or Featuriser(), predictor_hidden, predictor_lr, predictor_epochs,
            predictor_batch_size, predictor_holdout, replay_steps, history, prefix_outcomes,
            neighbours)
        self.policy: PreTrainedModel | None = None
        self.reference: PreTrainedModel | None = None
        self.predictor: SuccessPredictor | None = None
        self._last_sync: tuple | None = None  # (engine, probe, policy probe log-probs)
        self._grad_norm = float("nan")  # the policy's, before clipping, of the last step
        self._predictor_restore: dict | None = None  # see on_load_checkpoint

    # ---- models -------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.policy is not None:
            return
        dtype = getattr(torch, self.hparams.dtype)
        path = os.path.expanduser(self.hparams.policy_path)  # a directory, or a hub id
        attn = self.attention_implementation()
        try:
            config = without_dropout(AutoConfig.from_pretrained(path))
            self.policy = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype,
                                                               attn_implementation=attn)
        except OSError as e:
            raise FileNotFoundError(
                f"--model.policy_path ({self.hparams.policy_path!r}) could not be loaded ({e}); "
                f"give a directory saved with save_pretrained, or the policy a task builds "
                f"(search QA's --data.task.init_args.demo, calc's model/ under its out_dir) "
                f"there") from e
        self.policy.train()  # from_pretrained returns eval mode (dropout is off: see above)
        for m in self.policy.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        if self.hparams.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
        if self.hparams.kl_coef > 0:
            self.reference = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation=attn).eval()
            self.reference.requires_grad_(False)
        if self.hparams.compile_layers:
            compile_decoder_layers(self.policy)
        self.predictor = self.predictor_life.new_predictor(self.policy.config)
        self.shard_models()
        if self._trainer is not None:  # an unwrapped LightningModule is not moved by FSDP
            self.predictor.to(self.trainer.strategy.root_device)
        # The predictor is updated identically on every rank from all ranks' nodes (see
        # train_predictor), so data-parallel wrappers must leave it alone.
        from torch.nn.parallel import DistributedDataParallel

        names = [f"predictor.{n}" for n, _ in self.predictor.named_parameters()]
        names += [f"predictor.{n}" for n, _ in self.predictor.named_buffers()]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(self, names)

    def attention_implementation(self) -> str:
        """The policy's ``attn_implementation``: ``--model.attention``, "auto" resolved on
        the device the policy trains on."""
        kind = self.hparams.attention
        on_cuda = self._trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        if kind == "auto":  # per-leaf rows are causal: SDPA's flash kernel needs no mask
            packed = self.hparams.tree_packing and flex_attention_available()
            return "flex_attention" if on_cuda and packed else TREE_SDPA
        if kind == "sdpa":  # per-leaf rows: plain SDPA; packed trees: per node (see there)
            return TREE_SDPA
        if kind == "flex_attention" and not flex_attention_available():
            raise ValueError("--model.attention ('flex_attention'): this torch/transformers "
                             "has no FlexAttention; use 'sdpa' or 'auto'")
        return kind

    def on_fit_start(self) -> None:
        # "bf16-true" / "16-true" cast the whole module (the predictor was even built in that
        # dtype); it reads float32 features and is tiny, so it trains in float32. The same
        # Parameter objects: the optimizer already holding them stays valid.
        self.predictor.float()
        self.predictor_life.forget_features()  # an earlier fit's (a notebook), other weights
        if self._predictor_restore is not None:  # the checkpoint's float32 values, unrounded
            self.predictor.load_state_dict(self._predictor_restore)
            self._predictor_restore = None

    def on_train_start(self) -> None:
        # (after Lightning restored the optimizers and schedulers) a resumed schedule keeps
        # its step count but takes this run's lr and warm-up length, as history and replay
        # do: the checkpoint restores the groups' lr, the base lrs and the factor's length
        scheduler = self.lr_schedulers()
        if not (isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
                and isinstance(scheduler.lr_lambdas[0], LinearWarmup)):
            return  # a subclass's configure_optimizers without the warm-up
        warmup = scheduler.lr_lambdas[0]
        warmup.steps = self.hparams.lr_warmup_steps
        scheduler.base_lrs = [self.hparams.lr] * len(scheduler.optimizer.param_groups)
        for group in scheduler.optimizer.param_groups:  # the next step's lr
            group["initial_lr"] = self.hparams.lr
            group["lr"] = self.hparams.lr * warmup(scheduler.last_epoch)

    def shard_models(self) -> None:
        """Under Lightning's FSDP strategy make the policy (and the reference) FSDP roots of
        their own, the strategy's ``auto_wrap_policy`` wrapping their layers.

        The LightningModule itself then stays unwrapped, so a manual backward inside
        ``training_step`` follows a finished root forward (FSDP1 fails when training_step
        runs inside the root's forward), and rollout-phase forwards and the weight sync
        gather every parameter. ``wrap`` is a no-op under any other strategy.
        """
        from torch.distributed.fsdp.wrap import wrap

        self.policy = wrap(self.policy)
        if self.reference is not None:
            self.reference = wrap(self.reference)

    def configure_optimizers(self):
        h = self.hparams
        on_cuda = next(self.policy.parameters()).is_cuda
        policy_opt = torch.optim.AdamW(self.policy.parameters(), lr=h.lr, fused=on_cuda,
                                       weight_decay=h.weight_decay, betas=tuple(h.betas))
        # linear warm-up of the policy's lr over its first optimizer steps (0: constant lr):
        # Adam's first updates are sign-like (every weight moves by about lr), which a tiny
        # policy on few rollouts does not survive at the lr it can use later. The predictor's
        # optimizer is not Lightning's: see PredictorLife.optimizer.
        warmup = torch.optim.lr_scheduler.LambdaLR(policy_opt, LinearWarmup(h.lr_warmup_steps))
        return [policy_opt], [{"scheduler": warmup, "interval": "step"}]

    # ---- called by the DataModule during the rollout phase ------------------------------
    def sync_to_engine(self, engine, probe: list[list[int]], atol: float,
                       any_failed: Callable[[bool], bool] | None = None) -> float:
        """Load the policy's weights into ``engine`` and check its log-probs; returns the
        largest log-prob difference on ``probe`` (raises WeightSyncError above ``atol``).

        Under FSDP the policy is its own FSDP root (see ``configure_model``): its forward
        gathers every parameter, and the sync gathers its units one at a time under full HF
        names (``sync.policy_weights``). The policy's
        probe log-probs of the last sync into the same engine and probe let the check catch
        an engine the load left unchanged (see ``sync_weights``). ``any_failed``: several
        processes agree on a failure (``sync_weights``)."""
        last = self._last_sync
        previous = last[2] if last and last[0] is engine and last[1] == probe else None
        synced = sync_weights(self.policy, engine, probe, atol=atol, previous=previous,
                              any_failed=any_failed)
        self._last_sync = (engine, probe, synced.policy_logprobs)
        return synced.diff

    def prepare_update(self, batches: list[dict]) -> None:
        """Before the step's update, at its start weights (the DataModule calls it with the
        step's mini-batches): with rollout correction on, the micro-batches after the first
        mini-batch get the policy's log-probs now (``rollout_correction.start_logprobs``);
        off, nothing runs."""
        if self.correction.on:
            start_logprobs(lambda mb, tau: self._logprobs(self.policy, mb, temperature=tau)[0],
                           batches, self.device)

    @property
    def reads_prompt_features(self) -> bool:
        """Whether the featuriser appends the task's description of each prompt."""
        return self.predictor_life.reads_prompt_features

    @property
    def predictor_nodes_seen(self) -> int:
        """Tree nodes the predictor has learnt from (the allocator's cold start)."""
        return self.predictor_life.nodes_seen

    def predict_trees(self, trees: list[RolloutTree]) -> None:
        """Set ``node.prediction`` on every root and non-leaf turn of ``trees``."""
        self.predictor_life.predict(self.predictor, self.policy, trees, self.global_step,
                                    self.current_epoch)

    def receive_step(self, step: RolloutStep) -> None:
        """Take the step's finished trees; the predictor learns from them once the update
        has run (at the end of the step's last mini-batch; ``PredictorLife.receive``)."""
        self.predictor_life.receive(step, self.global_step)

    def fit_predictor(self) -> None:
        """The predictor learns from the received step (``PredictorLife.fit``), on every
        rank; the figures are logged once per RL step."""
        logged = self.predictor_life.fit(self.predictor, self.policy,
                                         self.trainer if self._trainer is not None else None,
                                         self.current_epoch)
        if logged and self._trainer is not None:
            log_scalars(self.trainer, logged)

    # ---- training -----------------------------------------------------------------------
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        h = self.hparams
        # the token-mean's divisor: the mini-batch's policy tokens over all ranks / ranks
        # (packing.leaves.equalise_over_ranks); one process, or a batch without it: this rank's count
        normalizer = float(batch.get("normalizer", batch["n_tokens"]))
        # no policy token on any rank (filler micro-batches only: a step with fewer leaves
        # than mini-batches): no update, which Adam's moments and weight decay would still make
        empty = normalizer == 0.0  # the same on every rank
        normalizer = normalizer if normalizer > 0 else 1.0  # below 1 too: see equalise_over_ranks
        # Statistics stay on the device until the mini-batch ends (then one sync, and one for
        # the gradient norm): a float() per micro-batch would wait for the GPU each time and
        # leave it idle while the next one is queued.
        zero = torch.zeros((), device=self.device)
        sums: dict[str, torch.Tensor] = {"loss": zero, "tokens": zero}  # stats: token-weighted
        ratio_max = zero
        # the rollout correction's extremes over the mini-batch (min kept as max of -min)
        extremes: dict[str, torch.Tensor] = {}
        # the rollouts' sampling temperature: their log-probs are the engine's at it
        tau = float(batch.get("temperature", 1.0))
        # the nodes' final hidden states, for the predictor's fit after the update
        read = self.predictor_life.update_features()
        for mb in batch["micro"]:
            logp, entropy = self._logprobs(self.policy, mb, with_entropy=True,
                                           temperature=tau, features=read)  # (B, T) each
            ref = None
            if self.reference is not None:
                with torch.no_grad():
                    ref, _ = self._logprobs(self.reference, mb, temperature=tau)  # (B, T)
            weights = {k: mb[k] for k in WEIGHT_KEYS}  # (B, T) each: (leaf, token) pairs
            # the mismatch at the step's start weights; with correction on, pi_old and weights
            old, corrected, rc = self.correction.apply(mb, logp, first=batch_idx == 0)
            weights = corrected if corrected is not None else weights
            loss, stats = weighted_policy_loss(logp, old, weights,
                                               clip_low=h.clip_low, clip_high=h.clip_high,
                                               dual_clip=h.dual_clip, ref_logprobs=ref,
                                               kl_coef=h.kl_coef, normalizer=normalizer,
                                               entropy=entropy)
            self.manual_backward(loss)
            w = stats.pop("tokens")
            r = stats.pop("ratio_max")
            ratio_max = torch.maximum(ratio_max, r)
            for k in ("max_ratio", "min_ratio"):
                if (key := f"rollout_correction/{k}") in rc:
                    v = rc.pop(key).float() * (1 if k == "max_ratio" else -1)
                    extremes[key] = torch.maximum(extremes.get(key, v), v)
            rc_pairs = rc.pop("rollout_correction/pairs", None)
            # the correction's stats are means over the same pairs as the loss's (w)
            parts = ({k: v * w for k, v in stats.items()} | {"loss": loss.detach(), "tokens": w}
                     | {k: v.float() * rc_pairs.float() for k, v in rc.items()})
            for k, v in parts.items():
                sums[k] = sums.get(k, zero) + v
        totals = torch.stack(list(sums.values()))  # (K,): token-weighted sums, loss, tokens
        world = self.trainer.world_size if self._trainer is not None else 1
        if world > 1 and torch.distributed.is_initialized():
            # the mini-batch's statistics over every rank's tokens (each rank's own would be
            # logged from rank 0 alone); a NaN anywhere then stops every rank alike
            torch.distributed.all_reduce(totals)
            torch.distributed.all_reduce(ratio_max, op=torch.distributed.ReduceOp.MAX)
            for v in extremes.values():  # the same keys on every rank (the same batch_idx)
                torch.distributed.all_reduce(v, op=torch.distributed.ReduceOp.MAX)
            totals[list(sums).index("loss")] /= world  # DDP averages the ranks' gradients
        values = dict(zip([*sums, "ratio_max", *extremes],
                          torch.cat([totals, ratio_max[None],
                                     *(v[None] for v in extremes.values())]).tolist()))  # one sync
        extremes = {k: (v if k.endswith("max_ratio") else -v)
                    for k, v in ((k, values.pop(k)) for k in list(extremes))}
        if not math.isfinite(values["loss"]):
            opt.zero_grad(set_to_none=True)
            raise FloatingPointError(
                f"policy loss is {values['loss']} at epoch {self.current_epoch}, mini-batch "
                f"{batch_idx}; the step was not applied and no checkpoint was written. "
                f"Check rewards and advantages for NaN, or lower --model.lr")
        lr = opt.param_groups[0]["lr"]  # the lr this step used
        self._grad_norm = float("nan")
        if not empty:
            opt.step()  # clips first, in on_before_optimizer_step
            scheduler = self.lr_schedulers()
            if scheduler is not None:
                scheduler.step()
        grad_norm = self._grad_norm
        opt.zero_grad(set_to_none=True)
        if self._trainer is not None and batch_idx == self.trainer.num_training_batches - 1:
            # the step's last mini-batch (one epoch is one RL step): the predictor learns
            # from the step now that its update has run, inside the batch, so the batch's
            # time counts it (perf/train_s) and any checkpoint after it holds the fit
            self.fit_predictor()
        tokens, total_loss = values.pop("tokens"), values.pop("loss")
        ratio_max = values.pop("ratio_max")
        metrics = {(k if "/" in k else f"train/{k}"): v / max(tokens, 1.0)
                   for k, v in values.items()} | extremes
        metrics.update({"train/loss": total_loss, "train/grad_norm": float(grad_norm),
                        "train/policy_tokens": tokens, "train/ratio_max": ratio_max,
                        "train/lr": lr})
        # written once: self.log would repeat the step's first mini-batch's mismatch at the
        # later steps that do not measure it (correction off)
        # (a mini-batch without a policy token on any rank measures nothing)
        rc = {k: metrics.pop(k) for k in list(metrics) if k.startswith("rollout_correction/")}
        if rc and tokens > 0 and self._trainer is not None:
            log_scalars(self.trainer, rc)
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        return torch.tensor(total_loss)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Clip the policy's gradients (``max_grad_norm``) as its optimizer steps: Lightning
        calls this after a loss scaler (``16-mixed`` on GPU) has unscaled them, so the norm
        and the clip are in true units (clipping in ``training_step`` would clip the scaled
        gradients, by the loss scale too much). ``max_grad_norm`` 0: the norm is measured,
        not clipped."""
        if optimizer is not self.optimizers().optimizer:
            return
        max_norm = self.hparams.max_grad_norm
        self._grad_norm = self.clip_policy_gradients(max_norm if max_norm > 0 else math.inf)

    def clip_policy_gradients(self, max_norm: float) -> float:
        """Clip the policy's gradient norm through the strategy (FSDP-aware)."""
        params = [p for p in self.policy.parameters() if p.grad is not None]
        if not params:
            return 0.0
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        if isinstance(self.policy, FSDP):  # the norm over all shards
            return float(self.policy.clip_grad_norm_(max_norm))
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    @staticmethod
    def _logprobs(model, mb: dict, with_entropy: bool = False, temperature: float = 1.0,
                  features: dict | None = None):
        """Token log-probs (and entropies) of a collated micro-batch, ``(B, T)`` each, on its
        policy tokens (0 elsewhere: the loss reads nothing else), at the ``temperature`` the
        rollouts were sampled at (the engines' log-probs are of that distribution).

        - A per-leaf micro-batch (``packing.leaves.collate``) runs without an attention mask:
          it is right-padded and attention is causal, so a real token never attends to
          padding and its positions are unchanged, and SDPA takes its fused causal (flash)
          kernel. A packed one (``packing.trees.collate_units``) brings position ids and the
          tree in the form the attention takes (``packing.attention.attention_inputs``).
        - The LM head runs only on the rows that predict a policy token (a pre-hook on the
          output embedding hands it those rows, ``prev`` of each policy token: the token
          before it on its path), so the ``(B, T, V)`` logits and their gradient are never
          built; prompt and observation tokens are often most of a search agent's
          sequence. The head runs inside the model's own forward, where an FSDP root has
          its parameters gathered and in the compute dtype.
        - ``features``: a packed micro-batch's node features are read into this dict from
          the same hidden states (``take_node_features``), the predictor's input for free.
        """
        ids = mb["input_ids"]  # (B, T)
        b, t = mb["policy_mask"].bool().nonzero(as_tuple=True)  # (M,) each: policy tokens
        src = mb["prev"][b, t]  # (M,): the rows that predict them
        head = model.get_output_embeddings()
        if head is None:
            raise TypeError(f"{type(model).__name__} has no output embedding (LM head) to run "
                            f"on policy rows; --model.policy_path must be a causal LM with one")
        def policy_rows(_, args):
            if features is not None and "node_ends" in mb:
                take_node_features(args[0], mb, features)  # (R, T, D) final hidden states
            return (args[0][b, src],)

        hook = head.register_forward_pre_hook(policy_rows)
        try:
            logits = model(input_ids=ids, use_cache=False,
                           **attention_inputs(model, mb)).logits  # (M, V): policy rows
        finally:
            hook.remove()
        return selected_token_logprobs(logits, ids, b, t, with_entropy=with_entropy,
                                       temperature=temperature)  # (B, T) each

    # ---- validation: the DataModule ran the agent; metrics come from the callbacks ------
    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> dict:
        return batch

    # ---- checkpoint: predictor replay and counters --------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["trace"] = self.predictor_life.state_dict()

    def check_checkpoint(self, path: str, meta: dict, policy_dir: str, fitting: bool) -> None:
        """A ValueError naming the settings when the checkpoint at ``path`` (``meta``: read
        without its tensors) does not hold what this run loads: its predictor's shapes
        first, then every key, shape, record and value (``checkpoints.check_checkpoint``)."""
        self.check_checkpoint_predictor(meta.get("state_dict", {}))
        h = self.hparams
        check_checkpoint(path, meta, policy_dir, fitting,
                         new_predictor=self.predictor_life.new_predictor,
                         reference=h.kl_coef > 0,
                         settings=f"--model.policy_path {h.policy_path!r}, --model.kl_coef "
                                  f"{h.kl_coef}, --model.featuriser, --model.predictor_hidden")

    def check_checkpoint_predictor(self, state_dict: dict) -> None:
        """The predictor in a checkpoint's ``state_dict`` has this run's shapes; otherwise a
        ValueError naming the settings that shape it. Before ``configure_model`` too (the
        DataModule checks a checkpoint before the engine starts): then the shapes are those
        of a predictor built on the meta device from the policy's config."""
        prefix = "predictor."
        if self.predictor is None:
            config = (AutoConfig.from_pretrained(os.path.expanduser(self.hparams.policy_path))
                      if self.predictor_life.featuriser.kind == "hidden" else None)
            with torch.device("meta"):
                predictor = self.predictor_life.new_predictor(config)
        else:
            predictor = self.predictor
        mine = {prefix + k: tuple(v.shape) for k, v in predictor.state_dict().items()}
        wrong = [f"{k} {tuple(v.shape)} (this run's: {mine[k]})"
                 for k, v in state_dict.items() if k in mine and tuple(v.shape) != mine[k]]
        if wrong:
            raise ValueError(
                f"--ckpt_path: the checkpoint's predictor does not fit this run's: "
                f"{', '.join(wrong[:3])}; its input width is the featuriser's "
                f"(--model.featuriser) and its hidden width --model.predictor_hidden: use "
                f"the settings of the run that wrote the checkpoint")

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # under "bf16-true" Lightning loads the weights into the predictor while it is still
        # bf16 (rounding them); on_fit_start loads them again once it is float32
        # (FSDP restores after on_fit_start, into the float32 predictor: nothing to redo)
        # (FSDP's strategy consumes "state_dict" itself when validating: nothing to redo)
        prefix = "predictor."
        self.check_checkpoint_predictor(checkpoint.get("state_dict", {}))
        if next(self.predictor.parameters()).dtype != torch.float32:
            self._predictor_restore = {k[len(prefix):]: v.clone() for k, v in
                                       checkpoint.get("state_dict", {}).items()
                                       if k.startswith(prefix)} or None
        self.predictor_life.load_state_dict(checkpoint["trace"],
                                            checkpoint.get("optimizer_states"))


def compile_decoder_layers(model: PreTrainedModel) -> int:
    """``torch.compile`` every decoder layer of ``model`` in place; returns how many.

    Decoder layers are the modules whose class the model names in ``_no_split_modules`` (the
    unit FSDP wraps, e.g. ``Qwen3DecoderLayer``).
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"--model.compile_layers: {type(model).__name__} names no decoder layer "
                         f"class in _no_split_modules ({sorted(names)}), so there is nothing to "
                         f"compile; set --model.compile_layers=false")
    for layer in layers:
        layer.compile()
    return len(layers)


class LinearWarmup:
    """``LambdaLR`` factor of optimizer step ``s`` (0-based): ``min(1, (s + 1) / steps)``;
    ``steps`` 0: always 1 (no warm-up).

    A class, not a lambda, so the scheduler's state dict (checkpoints) carries it."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / max(self.steps, 1))

