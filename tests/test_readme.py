"""The README a newcomer reads: short blocks, the first screen, and code blocks that run as written.

* every prose paragraph and list item is at most 120 words (tables, code blocks and headings aside);
* the first screen (40 lines) holds the two set-up commands and the recorded quickstart table;
* its links to files and to headings of the docs resolve;
* its ``bash`` and ``python`` code blocks run, as written, from a folder that looks like the repository
  (each top-level entry linked, ``checkpoints/`` its own with the converted base model linked in), except
  the commands in ``NOT_RUN``: they need a GPU cluster or take more than a few minutes. That part is slow.

    .venv/bin/python -m pytest tests/test_readme.py -m "not slow"     # structure only, a second
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

README = REPO / "README.md"
MAX_WORDS = 120
FIRST_SCREEN = 40
SETUP_COMMANDS = ("bash scripts/setup.sh && .venv/bin/atommem quickstart", "bash scripts/test.sh")

# Commands the doc test does not run, by how they start, with the reason. Each must still appear in the README
# (test_not_run_list_names_readme_commands), so the list cannot go stale.
NOT_RUN = {
    # minutes to an hour on a 2-core CPU
    "bash scripts/setup.sh": "installs the environment the test runs in (minutes)",
    "bash scripts/test.sh": "the test suite itself",
    ".ci/run": "the whole CI on a fresh clone",
    "bash scripts/setup_vllm.sh": "installs vLLM's CPU build (minutes)",
    ".venv/bin/atommem quickstart --grpo-set": "continues a full quickstart run (minutes)",
    ".venv/bin/atommem sft --config recipes/quickstart_learning": "trains SmolLM2-135M (minutes)",
    ".venv/bin/atommem grpo --config recipes/quickstart_learning": "trains SmolLM2-135M (minutes)",
    ".venv/bin/atommem eval --tasks demo=checkpoints/demo/tasks.jsonl --methods oracle,rag --checkpoint":
        "needs a finished quickstart and runs a model reader (minutes)",
    ".venv/bin/atommem data synth --out data/train_200docs.jsonl": "2,000 tasks of 200 documents (cluster data)",
    # a GPU cluster
    "sbatch ": "needs Slurm with GPU nodes",
}


# Python blocks the doc test does not run (a line starting with one of these), with the reason
PYTHON_NOT_RUN = (
    # needs a trained checkpoint; tests/test_memory_agent.py runs this example, with a tiny checkpoint, in two processes
    "agent = MemoryAgent.from_pretrained(",
)


def _blocks(text: str):
    """(kind, lines, first line number) for each block: 'code' (with its language), 'table', 'heading',
    'list' (one per item) or 'para'."""
    lines = text.splitlines()
    i, out = 0, []
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            lang, j = line[3:].strip(), i + 1
            while not lines[j].startswith("```"):
                j += 1
            out.append((f"code:{lang}", lines[i + 1:j], i + 1))
            i = j + 1
        elif not line.strip():
            i += 1
        elif line.startswith("#"):
            out.append(("heading", [line], i + 1))
            i += 1
        elif line.startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            out.append(("table", lines[i:j], i + 1))
            i = j
        else:
            j = i + 1
            item = re.match(r"\s*([-*]|\d+\.) ", line)
            while j < len(lines) and lines[j].strip() and not lines[j].startswith(("#", "|", "```")) and \
                    not (item and re.match(r"\s*([-*]|\d+\.) ", lines[j])):
                j += 1
            out.append(("list" if item else "para", lines[i:j], i + 1))
            i = j
    return out


def test_no_paragraph_or_list_item_over_120_words():
    long = [(n, kind, len(" ".join(ls).split())) for kind, ls, n in _blocks(README.read_text())
            if kind in ("para", "list") and len(" ".join(ls).split()) > MAX_WORDS]
    assert not long, f"README blocks over {MAX_WORDS} words (line, kind, words): {long}"


def test_the_block_parser_counts_what_it_should():
    """The counter must see a long paragraph and a long list item, and skip tables and code."""
    words = " ".join(["word"] * 130)
    sample = f"# T\n\n{words}\n\n- short\n- {words}\n\n| {words} |\n|---|\n\n```\n{words}\n```\n"
    kinds = [(k, len(" ".join(ls).split())) for k, ls, _ in _blocks(sample)]
    assert kinds == [("heading", 2), ("para", 130), ("list", 2), ("list", 131), ("table", 133), ("code:", 130)]


def test_first_screen_holds_the_commands_and_the_results_table():
    head = "\n".join(README.read_text().splitlines()[:FIRST_SCREEN])
    code = "\n".join("\n".join(ls) for k, ls, _ in _blocks(head) if k.startswith("code"))
    for cmd in SETUP_COMMANDS:
        assert cmd in code, f"the first screen has no code block with `{cmd}`"
    tables = [ls for k, ls, _ in _blocks(head) if k == "table"]
    assert tables, "the first screen has no table"
    table = "\n".join(tables[0])
    for needed in ("SFT - base", "GRPO - SFT", "wall time"):
        assert needed in table, f"the first screen's table does not show {needed!r}"
    assert re.search(r"\d+ min \d+ s", table), "the table gives no recorded wall time"


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_resolve():
    """Relative links of the README and the docs name files that exist and headings that exist in them."""
    bad = []
    for doc in [README, *sorted((REPO / "docs").rglob("*.md"))]:
        for url in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if url.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, frag = url.partition("#")
            target = (doc.parent / path) if path else doc
            if not target.exists():
                bad.append(f"{doc.relative_to(REPO)}: {url} (no such file)")
            elif frag and target.suffix == ".md":
                heads = {_slug(b[0].lstrip("#")) for k, b, _ in _blocks(target.read_text()) if k == "heading"}
                if frag not in heads:
                    bad.append(f"{doc.relative_to(REPO)}: {url} (no such heading)")
    assert not bad, bad


def _commands(lines: list[str]) -> list[str]:
    """Shell commands of a bash block, backslash-continued lines joined."""
    cmds, cur = [], ""
    for line in lines:
        cur += line.rstrip()
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        if cur.strip():
            cmds.append(cur.strip())
        cur = ""
    return cmds


def _code_blocks():
    return [(k.split(":", 1)[1], ls, n) for k, ls, n in _blocks(README.read_text()) if k.startswith("code:")]


def test_not_run_list_names_readme_commands():
    cmds = [c for lang, ls, _ in _code_blocks() if lang == "bash" for c in _commands(ls)]
    for prefix in NOT_RUN:
        assert any(c.startswith(prefix) for c in cmds), f"NOT_RUN names `{prefix}`, which no README command starts with"
    runnable = [c for c in cmds if not c.startswith(tuple(NOT_RUN))]
    assert len(runnable) >= 5, runnable


@pytest.fixture
def repo_like(tmp_path):
    """A folder that looks like the repository: every top-level entry linked, its own checkpoints/ with the
    converted base model linked in (what the README's commands write stays in tmp_path)."""
    for entry in REPO.iterdir():
        if entry.name not in ("checkpoints", ".git"):
            (tmp_path / entry.name).symlink_to(entry)
    (tmp_path / "checkpoints").mkdir()
    base = REPO / "checkpoints" / "base"
    if base.exists():
        (tmp_path / "checkpoints" / "base").symlink_to(base)
    return tmp_path


@pytest.mark.slow
def test_readme_code_blocks_run_as_written(repo_like):
    """Every bash command of the README not in NOT_RUN, in order, each block in one shell with ``set -e``; each
    python block in the venv's Python, its printed lines equal to the ``# `` comment lines that end the block."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "ANONYMIZED_TELEMETRY": "False",
           "WANDB_MODE": "offline", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    ran = 0
    for lang, lines, lineno in _code_blocks():
        if lang == "bash":
            cmds = [c for c in _commands(lines) if not c.startswith(tuple(NOT_RUN))]
            if not cmds:
                continue
            script = "set -euo pipefail\n" + "\n".join(cmds) + "\n"
            out = subprocess.run(["bash", "-c", script], cwd=repo_like, env=env, capture_output=True, text=True,
                                 timeout=900)
            assert out.returncode == 0, f"README block at line {lineno} failed:\n{script}\n{out.stderr[-3000:]}"
            ran += len(cmds)
        elif lang == "python":
            if any(line.startswith(PYTHON_NOT_RUN) for line in lines):
                continue
            expected = []
            for line in reversed(lines):
                if not line.startswith("# "):
                    break
                expected.insert(0, line[2:])
            out = subprocess.run([sys.executable, "-c", "\n".join(lines)], cwd=repo_like, env=env,
                                 capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, f"README python block at line {lineno} failed:\n{out.stderr[-3000:]}"
            assert out.stdout.splitlines()[-len(expected):] == expected, (lineno, out.stdout)
            ran += 1
    assert ran >= 6, ran
    # what the environment section's commands wrote: tasks, and an oracle rollout that answers them
    assert (repo_like / "checkpoints" / "demo" / "eval" / "metrics.json").exists()


def test_named_benchmark_references_resolve():
    """Code and docs cite run logs as (docs/BENCHMARKS.md, then the section title in quotes); since the logs moved to
    docs/benchmarks/, BENCHMARKS.md indexes every title. Each cited title must begin a heading there."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    index = (REPO / "docs" / "BENCHMARKS.md").read_text()
    titles = [m.group(1) for m in re.finditer(r"^- \[(.+)\]\(benchmarks/", index, re.M)]
    heads = [b[0].lstrip("#").strip() for k, b, _ in _blocks(index) if k == "heading"]
    cited = set()
    for name in files:
        path = REPO / name
        if path.suffix not in (".py", ".sh", ".md", ".yaml", ".txt") or not path.is_file():
            continue
        cited |= {(name, t) for t in re.findall(r'BENCHMARKS\.md,? "([^"\n]+)"', path.read_text(errors="ignore"))}
    assert len(cited) >= 5, cited
    missing = [(n, t) for n, t in sorted(cited) if not any(h.startswith(t) for h in titles + heads)]
    assert not missing, missing
