"""The repository stands alone: no tracked file names a path outside it, and the benchmark files the tests,
the quickstart and the documented commands read are shipped inside it (atommem_rl/data/benchmarks)."""

from __future__ import annotations

import re
import subprocess

from atommem_rl.data import BENCHMARKS, FILES, benchmark_file

from .conftest import REPO

# a folder beside the repository (the shared folder of the machines it was written on), or an absolute path
# under one of those machines' roots; spelled as alternations so that this file does not name them itself
OUTSIDE = re.compile(r"\.\./(?:sh)ared\b|(?<![\w.])/(?:(?:wor)k|(?:chec)k|(?:roo)t)/")


def tracked_text_files():
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in out.splitlines():
        p = REPO / name
        if p.suffix in (".json", ".png", ".safetensors") or not p.is_file():
            continue
        try:
            yield name, p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue


def test_no_tracked_file_names_a_path_outside_the_repository():
    hits = [f"{name}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
            for name, text in tracked_text_files()
            for m in OUTSIDE.finditer(text)]
    assert not hits, "paths outside the repository:\n" + "\n".join(hits[:30])


def test_the_benchmark_files_are_shipped_with_their_licences(monkeypatch):
    monkeypatch.delenv("ATOMMEM_DATA_DIR", raising=False)
    for source in FILES:
        path = benchmark_file(source)
        assert path.is_file() and path.stat().st_size > 100_000 and BENCHMARKS in path.parents, path
    assert (BENCHMARKS / "locomo" / "LICENSE.txt").read_text().startswith("Attribution-NonCommercial 4.0")
    readme = (BENCHMARKS / "README.md").read_text()
    for licence in ("CC BY-NC 4.0", "CC BY-SA 4.0", "CC BY 4.0"):
        assert licence in readme
    # the loaders read them: LoCoMo's 10 conversations, 100 HotpotQA questions
    from atommem_rl.tasks import prepare

    assert len(prepare.prepare_locomo(benchmark_file("locomo"), limit=10)) >= 10
    assert sum(len(t.questions) for t in prepare.prepare_hotpotqa(benchmark_file("hotpotqa"), docs=10)) == 100
