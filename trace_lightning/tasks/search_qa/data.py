"""Search QA's ``TaskData``: questions, corpora, retrievers and the generated demo world.

Training questions come from a QA JSONL (``--data.task.init_args.train``) or the demo world
(``--data.task.init_args.demo``); the agent searches BM25 over a corpus JSONL
(``--data.task.init_args.corpus``) or a Search-R1 retrieval server
(``--data.task.init_args.retriever_url``); each validation set (``--data.task.init_args.val``)
may search its own corpus. Every file and setting is checked before any work: here on
construction (the flags) and in ``setup`` (files, the server), before the engine starts.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from trace_lightning.tasks.search_qa.config import DemoConfig, EnvConfig, EvalSet
from trace_lightning.tasks.search_qa.datasets import load_qa
from trace_lightning.tasks.search_qa.environment import SEARCH_R1_INSTRUCTION, SearchEnvironment
from trace_lightning.tasks.search_qa.retrieval import BM25Retriever, HTTPRetriever, Retriever
from trace_lightning.tasks.base import Example, TaskData


class SearchQAData(TaskData):
    """The search-QA task's data and resources (the flags are ``TraceDataModule``'s own:
    see its docstring for each)."""

    metric = "em"

    def __init__(self, train: str | None = None, corpus: str | None = None,
                 retriever_url: str | None = None, retriever_timeout_s: float = 10.0,
                 retriever_retries: int = 2, retriever_reconnect_wait_s: float = 30.0,
                 val: list[EvalSet] | None = None, env: EnvConfig | None = None,
                 demo: DemoConfig | None = None):
        self.train_path, self.corpus, self.retriever_url = train, corpus, retriever_url
        self.retriever_timeout_s, self.retriever_retries = retriever_timeout_s, retriever_retries
        self.retriever_reconnect_wait_s = retriever_reconnect_wait_s
        self.val_sets = list(val or [])
        self.env_cfg = env or EnvConfig()
        self.demo = demo
        self.max_seq_tokens = self.env_cfg.max_seq_tokens
        self.train_examples: list[Example] = []
        self.val_examples: dict[str, list[Example]] = {}
        self._retrievers: dict[str, Retriever] = {}
        self._check_flags()

    # ---- checks -------------------------------------------------------------------------
    def _check_flags(self) -> None:
        """The settings alone, refused before any work."""
        if self.demo is None and not self.train_path:
            raise ValueError("--data.task.init_args.train is not set; give a QA JSONL of training "
                             "questions or set --data.task.init_args.demo to use the generated "
                             "demo world")
        if self.demo is None and not (self.corpus or self.retriever_url):
            raise ValueError("neither --data.task.init_args.corpus nor "
                             "--data.task.init_args.retriever_url is set; the agent "
                             "needs a retriever: give a corpus JSONL for BM25 or the URL of "
                             "`trace-lightning-retriever`")
        if self.demo is None and self.corpus and self.retriever_url:
            raise ValueError(f"both --data.task.init_args.corpus ({self.corpus!r}) and "
                             f"--data.task.init_args.retriever_url "
                             f"({self.retriever_url!r}) are set: training would search the "
                             f"corpus, validation sets without a corpus the server; set one "
                             f"(a validation set can name its own corpus in "
                             f"--data.task.init_args.val)")
        for flag, _, limit in self._qa_files():
            if limit is not None and limit < 0:
                raise ValueError(f"{flag}: limit ({limit}) must be >= 0 or null (all)")
        if self.retriever_url:
            self._http_retriever()  # its flags are checked now (no request is made)
        names = [v.name for v in self.val_sets]
        if len(set(names)) < len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"--data.task.init_args.val names {twice} more than once; a set's "
                             f"name is its metric key (val/<name>/em), so one would replace the "
                             f"other: give each set its own name")
        if self.demo is not None:
            # the demo trains on its own questions and searches its own corpora (its held-out
            # set too): these would be ignored; the server still serves a
            # --data.task.init_args.val set without a corpus of its own
            ignored = [(f, v) for f, v in (("--data.task.init_args.train", self.train_path),
                                           ("--data.task.init_args.corpus", self.corpus)) if v]
            if self.retriever_url and all(v.corpus for v in self.val_sets):
                ignored.append(("--data.task.init_args.retriever_url", self.retriever_url))
            if ignored:
                given = ", ".join(f"{f} ({v!r})" for f, v in ignored)
                flags = ", ".join(f for f, _ in ignored)
                raise ValueError(
                    f"{given} and --data.task.init_args.demo are both set: the demo world "
                    f"trains on its own questions and searches its own corpora, so {flags} "
                    f"would be ignored; set --data.task.init_args.demo=null to use yours "
                    f"(configs/demo.yaml sets data.task.init_args.demo), or leave them out to "
                    f"train on the demo world")

    def _check_policy(self, policy_path: str) -> None:
        """The demo trains its own policy: ``--model.policy_path`` must be it."""
        if self.demo is not None:
            from trace_lightning.tasks.search_qa.demo.prepare import DemoPaths

            model_dir = DemoPaths.under(self.demo.out_dir).model
            if Path(policy_path).resolve() != model_dir.resolve():
                raise ValueError(f"--model.policy_path ({policy_path!r}) must be the demo's "
                                 f"policy {str(model_dir)!r} when --data.task.init_args.demo is "
                                 f"set; set it so")

    def _qa_files(self, fitting: bool = True) -> list[tuple[str, str, int | None]]:
        """(flag, path, limit) of every QA file named (the training file when ``fitting``
        and not a demo run, whose files prepare writes)."""
        named = [(f"--data.task.init_args.val[{i}] (set {v.name!r})", v.path, v.limit)
                 for i, v in enumerate(self.val_sets)]
        if self.demo is None and fitting:
            named.insert(0, ("--data.task.init_args.train", self.train_path, None))
        return named

    def _check_files(self, fitting: bool, before_demo: bool = False) -> None:
        """Every QA file and corpus named exists: before prepare downloads a policy or
        builds the demo (``before_demo``: files the demo writes are not there yet), and
        before the first epoch trains (a validation set's files are read only at the first
        validation)."""
        named = [(flag, "QA file", path) for flag, path, _ in self._qa_files(fitting)]
        named += [("--data.task.init_args.corpus", "corpus", self.corpus)] + [
            (f"--data.task.init_args.val[{i}].corpus (set {v.name!r})", "corpus", v.corpus)
            for i, v in enumerate(self.val_sets)]
        demo_dir = Path(self.demo.out_dir).resolve() if before_demo and self.demo else None
        for flag, what, path in named:
            if demo_dir is not None and path and demo_dir in Path(path).resolve().parents:
                continue
            if path and Path(path).is_dir():
                raise IsADirectoryError(f"{flag}: {what} {path!r} is a directory, not a file; "
                                        f"give the path of the JSONL inside it")
            if path and not Path(path).is_file():
                line = "passage" if what == "corpus" else "question"
                raise FileNotFoundError(f"{flag}: {what} {path!r} does not exist; give the "
                                        f"path of a {what} JSONL (one {line} per line)")

    # ---- preparing and loading ------------------------------------------------------------
    def prepare(self, policy_path: str, fitting: bool) -> None:
        """Files checked and the server asked (before the minutes of a hub download or the
        demo's build), then the demo world and its warm-started policy built once."""
        self._check_files(fitting, before_demo=True)
        if self.retriever_url:
            self._check_retriever()
        self._check_policy(policy_path)
        if self.demo is not None:
            from trace_lightning.tasks.search_qa.demo.prepare import prepare_demo

            prepare_demo(self.demo.out_dir, seed=self.demo.seed, eval_seed=self.demo.eval_seed,
                         warm_start_steps=self.demo.warm_start_steps, **self.demo.options)

    def setup(self, fitting: bool, train_limit: int | None, processes: int,
              prompts_needed: int) -> None:
        """The questions read and the corpora indexed on this process, failing before the
        engine starts (a bad line, a missing file, a server that does not answer)."""
        if self.demo is not None:
            from trace_lightning.tasks.search_qa.demo.prepare import DemoPaths

            paths = DemoPaths.under(self.demo.out_dir)
            self.train_path, self.corpus = str(paths.train_qa), str(paths.train_corpus)
            if not self.val_sets:
                self.val_sets = [EvalSet("demo_heldout", str(paths.eval_qa),
                                         corpus=str(paths.eval_corpus), limit=None)]
        self._check_files(fitting)
        if self.retriever_url:  # on every process (prepare ran on one per node)
            self._check_retriever()
        if fitting and not self.train_examples:
            self.train_examples = load_qa(self.train_path, limit=train_limit)
            if len(self.train_examples) < prompts_needed:
                raise ValueError(
                    f"{self.train_path} holds {len(self.train_examples)} training questions "
                    f"(--data.task.init_args.train, --data.train_limit {train_limit}), fewer "
                    f"than the {prompts_needed} prompts the allocator needs per step; give more "
                    f"questions or lower --data.allocator.roots")
        if not self.val_examples:
            # the set's name is the metric key, whatever the records call themselves
            self.val_examples = {v.name: [replace(e, dataset=v.name)
                                          for e in load_qa(v.path, limit=v.limit)]
                                 for v in self.val_sets}
        for v in self.val_sets:
            examples = self.val_examples[v.name]
            if not examples:
                raise ValueError(
                    f"validation set {v.name!r} ({v.path}) holds no questions (limit "
                    f"{v.limit}); give it a QA file with records and a limit of at least "
                    f"{processes}, or leave it out of --data.task.init_args.val")
            if len(examples) < processes:
                raise ValueError(
                    f"validation set {v.name!r} ({v.path}) holds {len(examples)} questions, "
                    f"fewer than the {processes} processes: one without any would skip "
                    f"validation while the others wait for it to gather accuracy (a hang); "
                    f"give it at least {processes} (its limit in --data.task.init_args.val) or "
                    f"leave it out")
        # corpora are read (and indexed, cached on disk) now: a bad line fails before the
        # engine starts, not at the first rollout or validation epochs later
        if fitting and not self.retriever_url:
            self._retriever(None)
        for v in self.val_sets:
            if v.corpus:
                self._retriever(v.corpus)

    # ---- the environment ------------------------------------------------------------------
    def environment(self, tokenizer, val_set: str | None = None) -> SearchEnvironment:
        """The search environment of the training questions (``val_set`` None) or of a
        validation set, on its corpus's retriever (the server's, where it names none)."""
        corpus = None
        if val_set is not None:
            corpus = next(v.corpus for v in self.val_sets if v.name == val_set)
        c = self.env_cfg
        return SearchEnvironment(tokenizer, self._retriever(corpus), topk=c.topk,
                                 max_turns=c.max_turns, max_obs_tokens=c.max_obs_tokens,
                                 max_seq_tokens=c.max_seq_tokens,
                                 max_query_chars=c.max_query_chars,
                                 instruction=c.instruction or SEARCH_R1_INSTRUCTION,
                                 use_chat_template=c.use_chat_template, reward=c.reward,
                                 f1_threshold=c.f1_threshold)

    def _retriever(self, corpus: str | None) -> Retriever:
        """BM25 over ``corpus``; None: the retrieval server, or else the training corpus.
        One retriever per corpus or server (a validation set on the training corpus shares
        the training retriever's index)."""
        if corpus is None and self.retriever_url:
            key = self.retriever_url
            if key not in self._retrievers:
                self._retrievers[key] = self._http_retriever()
        else:
            key = corpus or self.corpus
            if key not in self._retrievers:
                self._retrievers[key] = BM25Retriever(key)
        return self._retrievers[key]

    def _check_retriever(self) -> None:
        """The retrieval server answers, and fits the client's batches (``HTTPRetriever.check``)."""
        self._retriever(None).check(self.env_cfg.topk, max_query_chars=self.env_cfg.max_query_chars)

    def _http_retriever(self) -> HTTPRetriever:
        return HTTPRetriever(self.retriever_url, timeout_s=self.retriever_timeout_s,
                             retries=self.retriever_retries,
                             reconnect_wait_s=self.retriever_reconnect_wait_s)
