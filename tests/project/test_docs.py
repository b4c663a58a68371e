"""The front door holds: the README's commands are what CI runs, every relative link in the
README and docs/ resolves and every repository path they name exists, the results table is
what the benchmarks' JSON files say, and the dashboard picture is of what the callbacks draw
now."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import results_table  # noqa: E402

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "callbacks" / "METRICS.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped but ``-`` and ``_``,
    spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in ``path`` (GitHub numbers repeats: ``x``, ``x-1``, ...)."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = re.match(r"#{1,6} (.+)", line)
        if m and not in_code:
            a = anchor(m.group(1))
            out.add(a if a not in seen else f"{a}-{seen[a]}")
            seen[a] = seen.get(a, 0) + 1
    return out


def test_anchor_follows_github():
    # hand-derived from GitHub's rendering of these headings
    assert anchor("Allocation (`python benchmarks/allocation.py`)") == \
        "allocation-python-benchmarksallocationpy"
    assert anchor("Why GRPO and not Tree-GRPO here") == "why-grpo-and-not-tree-grpo-here"
    assert anchor("The demo: commit `c60cf04`, before per-prompt stage 2") == \
        "the-demo-commit-c60cf04-before-per-prompt-stage-2"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # links in code are code
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, frag = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target} (no {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest})")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            broken.append(f"{target} (no heading #{frag} in {dest.name})")
    assert not broken, f"{doc.relative_to(REPO)}: broken links: {broken}"


REPO_PATH = re.compile(r"`((?:configs|scripts|benchmarks|trace_lightning|callbacks|docs|tests|\.ci)"
                       r"/[\w/.\-]*[\w/])`")


def test_repo_paths_named_in_the_docs_exist():
    """A file the docs name in backticks (`configs/x.yaml`) is in the checkout: a removed
    config or script leaves no pointer behind."""
    missing = [f"{doc.relative_to(REPO)}: {p}" for doc in DOCS
               for p in REPO_PATH.findall(doc.read_text()) if not (REPO / p).exists()]
    assert not missing, f"named in the docs but not in the checkout: {missing}"


def readme_commands() -> list[str]:
    """The commands of the README's first ``bash`` block, comments dropped."""
    block = re.search(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    assert block, "README.md has no ```bash block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines()
            if line.split("#")[0].strip()]


def test_readme_commands_are_what_ci_runs():
    """``.ci/run`` runs the README's setup and test commands, exactly and in order (the
    main job is the README's only other command)."""
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")
          and not line.startswith(("set ", "cd "))]
    commands = readme_commands()
    main_job = [c for c in commands if " fit --config configs/demo.yaml" in c]
    assert len(main_job) == 1, commands
    assert [c for c in commands if c not in main_job] == ci


def test_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail to docs/"


def test_readme_names_no_commits_dates_or_cpu_models():
    """Instructions, not lab notes: the README's prose names no commit, date or CPU model;
    those stay in the JSON lines it links to (their provenance)."""
    text = re.sub(r"\]\([^)]*\)", "]", (REPO / "README.md").read_text())  # link targets
    assert not re.findall(r"`[0-9a-f]{7,12}(?:-dirty)?`", text), "a commit hash in README.md"
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", text), "a date in README.md"
    assert not re.findall(r"EPYC|Xeon|Ryzen|Core i[3579]", text), "a CPU model in README.md"


def test_results_are_the_current_evidence():
    """docs/results/ holds the JSON of the claims the docs make now, at most 15 files, each
    linked from the README or a page of docs/; results.md stays a summary of them."""
    files = sorted(p.name for p in (REPO / "docs" / "results").iterdir())
    assert len(files) <= 15, f"{len(files)} files in docs/results/; move superseded ones to " \
        "docs/results_log.md (one line each) and git rm them"
    docs = "\n".join(d.read_text() for d in DOCS)
    unlinked = [f for f in files if f"results/{f})" not in docs]
    assert not unlinked, f"in docs/results/ but backing no claim in the docs: {unlinked}"
    lines = (REPO / "docs" / "results.md").read_text().splitlines()
    assert len(lines) <= 400, f"docs/results.md has {len(lines)} lines; history goes to the log"


def test_results_table_is_what_the_json_files_say(capsys):
    assert results_table.main(["--check"]) == 0, capsys.readouterr().err
    # every claim's row is there, with its JSON, and the table stays a summary
    table = (REPO / "README.md").read_text().split(results_table.BEGIN)[1]
    table = table.split(results_table.END)[0]
    for name in ("allocation.json", "allocation_seed1.json", "allocation_new_prompts.json",
                 "allocation_new_prompts_seed1.json", "predictability.json", "learning.json",
                 "learning_world3_update_features_15.json", "learning_e16_oracle.json",
                 "update.json", "engines.json", "retrieval.json"):
        assert f"docs/results/{name}" in table
    rows = [line for line in table.splitlines() if line.startswith("| ")][2:]  # less the head
    assert len(rows) <= results_table.MAX_ROWS == 8


def test_results_table_quotes_the_json(tmp_path, monkeypatch):
    """A figure changed in a JSON file changes the table: the table is read, not typed."""
    results = tmp_path / "results"
    shutil.copytree(REPO / "docs" / "results", results)
    r = json.loads((results / "allocation.json").read_text())
    r["allocators"]["trace"]["effective_ratio"] = 0.987654
    (results / "allocation.json").write_text(json.dumps(r))
    monkeypatch.setattr(results_table, "RESULTS", results)
    assert "trace's effective ratio is 0.988 and 0.600" in results_table.table()


def test_dashboard_picture_is_of_what_the_callbacks_draw():
    meta = json.loads((REPO / "docs" / "dashboard.json").read_text())
    digest = hashlib.sha256((REPO / "callbacks" / "METRICS.md").read_bytes()).hexdigest()
    assert meta["metrics_md_sha256"] == digest, (
        "callbacks/METRICS.md changed since docs/dashboard.png was taken; take it again: "
        "python scripts/dashboard.py <a finished demo run's version_<N> folder>")
    assert (REPO / "docs" / "dashboard.png").stat().st_size > 10_000
    assert "docs/dashboard.png" in (REPO / "README.md").read_text()


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="headless Chromium is not installed (apt-get install chromium)")
def test_dashboard_script_photographs_a_run(tmp_path):
    """The script starts TensorBoard on a run's event file, waits for its scalars and writes
    a picture and its record (a run written here with TensorBoard's own writer)."""
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "version_0"
    with SummaryWriter(run) as w:
        for step in range(4):
            w.add_scalar("val/em", 0.4 + 0.01 * step, step)
            w.add_scalar("rollout/effective_ratio", 0.5, step)
    out = tmp_path / "dashboard.png"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "dashboard.py"), str(run),
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["run"] == str(run) and len(meta["metrics_md_sha256"]) == 64


def test_dashboard_shows_keys_the_callbacks_write():
    import dashboard

    keys = re.fullmatch(r"\^\((.*)\)\$", dashboard.TAGS).group(1).split("|")
    metrics = (REPO / "callbacks" / "METRICS.md").read_text()
    assert [k for k in keys if f"`{k}`" not in metrics] == []
