"""viewer.html in a real headless browser (Debian's chromium): the page loads without script errors
and stepping through an episode (pressing Next) shows the memory of that step."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from atommem_rl.eval.harness import evaluate
from atommem_rl.eval.methods import EvalSettings
from atommem_rl.eval.viewer import write_viewer
from atommem_rl.tasks.synth import generate_tasks

from .conftest import require

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(autouse=True)
def _needs_chromium():
    require(CHROMIUM is not None, "needs Debian's chromium (apt-get install -y chromium)")


def dump_dom(page: Path, fragment: str, tmp: Path) -> str:
    out = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage", f"--user-data-dir={tmp / 'profile'}",
         "--virtual-time-budget=5000", "--dump-dom", page.resolve().as_uri() + fragment],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


class _Dom(HTMLParser):
    """Collects body attributes, #errors text and the memory table's rows (handle, role, text)."""

    def __init__(self):
        super().__init__()
        self.body, self.errors, self.rows, self.pos = {}, "", [], ""
        self._in, self._row, self._cell = None, None, None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body = a
        if a.get("id") in ("errors", "pos", "memory"):
            self._in = a["id"]
        if self._in == "memory" and tag == "tr":
            self._row = []
        if self._row is not None and tag == "td":
            self._cell = ""

    def handle_endtag(self, tag):
        if tag == "td" and self._row is not None and self._cell is not None:
            self._row.append(self._cell)
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None
        elif tag in ("div", "span", "tbody") and self._in in ("errors", "pos", "memory"):
            self._in = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data
        elif self._in == "errors":
            self.errors += data
        elif self._in == "pos":
            self.pos += data


def parse(dom: str) -> _Dom:
    p = _Dom()
    p.feed(dom)
    return p


def test_viewer_steps_show_that_steps_memory(tmp_path):
    tasks = generate_tasks(1, seed=4, docs=10, questions=2, confounders=2)
    evaluate({"synth": tasks}, ["oracle"], tmp_path, settings=EvalSettings(viewer_tasks=1, chunk_tokens=128),
             log=lambda *_: None)
    import json

    rec = json.loads((tmp_path / "trajectories.jsonl").read_text().splitlines()[0])
    steps = rec["steps"]
    assert len(steps) >= 3
    page = tmp_path / "viewer.html"
    sizes = [len(s["memory"]) for s in steps]
    # a step after which memory grew, reached by pressing Next k times from step 0
    k = next(i for i in range(1, len(steps)) if sizes[i] > sizes[0])
    dom = parse(dump_dom(page, f"#ep=0&click={k}", tmp_path))
    assert dom.body.get("data-ready") == "1"
    assert dom.errors.strip() == ""
    assert dom.body.get("data-step") == str(k) and dom.pos.strip() == f"step {k + 1} / {len(steps)}"
    shown = [(r[0], r[1], r[2]) for r in dom.rows]
    want = [(m["handle"], m["role"], m["text"]) for m in steps[k]["memory"]]
    assert shown == want and len(shown) == sizes[k]
    # step 0 shows step 0's memory (a different one)
    dom0 = parse(dump_dom(page, "#ep=0", tmp_path))
    assert [r[0] for r in dom0.rows] == [m["handle"] for m in steps[0]["memory"]] and dom0.errors.strip() == ""


def test_viewer_reports_script_errors_and_escapes_data(tmp_path):
    rec = {"method": "m", "dataset": "d", "task_id": "</script><script>boom()</script><!--",
           "questions": [], "steps": [{"kind": "chunk", "input": "</script>", "actions": [], "memory": [
               {"handle": "M1", "text": "<b>x</b>", "role": "primary", "relations": {}}], "retrieved": [], "answer": None}]}
    page = write_viewer([rec], tmp_path / "v.html")
    dom = parse(dump_dom(page, "", tmp_path))
    assert dom.errors.strip() == "" and dom.body.get("data-ready") == "1"
    assert [r[2] for r in dom.rows] == ["<b>x</b>"]  # data shown as text, never as markup
    broken = tmp_path / "broken.html"
    broken.write_text(page.read_text().replace('$("kind").textContent', 'undefinedFunction(); $("kind").textContent'))
    dom = parse(dump_dom(broken, "", tmp_path))
    assert re.search(r"undefinedFunction", dom.errors)
