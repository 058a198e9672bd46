"""``viewer.html``: one self-contained page (inline CSS and JS, the episodes embedded as JSON) that
steps through recorded episodes: the chunk or fact the method saw, its actions, the memory after the
step (roles and relations), the entries retrieved, and the answers.

Navigation: the episode menu, Prev/Next buttons, the step slider, or the arrow keys. The URL hash
``#ep=I&step=S`` opens episode I at step S; ``&click=N`` presses Next N times after loading (used by
the headless-browser test). Script errors are caught by ``window.onerror`` and shown in
``#errors``; ``body[data-ready]`` is set once the page has rendered.
"""

from __future__ import annotations

import json
from pathlib import Path

_PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>AtomMem-RL episode viewer</title>
<script>
window.__errors = [];
window.onerror = function (msg, src, line, col) {
  window.__errors.push(msg + " (" + line + ":" + col + ")");
  var el = document.getElementById("errors");
  if (el) { el.textContent = window.__errors.join("\n"); }
  return false;
};
</script>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; color: #222; }
header { background: #24364b; color: #fff; padding: 8px 14px; display: flex; gap: 12px; align-items: center; flex-wrap: wrap; }
header select, header button, header input { font-size: 14px; }
main { display: grid; grid-template-columns: 1fr 1fr; gap: 10px; padding: 10px; }
section { border: 1px solid #ccd; border-radius: 6px; padding: 6px 10px; overflow: auto; max-height: 46vh; }
h2 { font-size: 14px; margin: 2px 0 6px; color: #24364b; }
pre { white-space: pre-wrap; margin: 0; font-size: 12px; }
table { border-collapse: collapse; width: 100%; font-size: 12px; }
td, th { border-bottom: 1px solid #eee; padding: 2px 4px; text-align: left; vertical-align: top; }
tr.role-evidence td { color: #777; } tr.role-deleted td { color: #b00; text-decoration: line-through; }
.badge { font-size: 11px; padding: 0 4px; border-radius: 3px; background: #e3e8f0; }
#errors { color: #b00; white-space: pre-wrap; }
</style></head>
<body>
<header>
  <strong>Episode viewer</strong>
  <select id="episode"></select>
  <button id="prev">&larr; Prev</button>
  <input id="step" type="range" min="0" max="0" value="0">
  <button id="next">Next &rarr;</button>
  <span id="pos"></span> <span id="kind" class="badge"></span>
</header>
<div id="errors"></div>
<main>
  <section><h2>Input at this step</h2><pre id="input"></pre></section>
  <section><h2>Actions</h2><ol id="actions"></ol></section>
  <section><h2>Memory after the step (<span id="memcount">0</span>)</h2>
    <table><thead><tr><th>id</th><th>role</th><th>text</th><th>relations</th></tr></thead><tbody id="memory"></tbody></table></section>
  <section><h2>Retrieved / shown</h2><ol id="retrieved"></ol><h2>Answer</h2><pre id="answer"></pre></section>
  <section style="grid-column: 1 / span 2"><h2>Questions (final)</h2>
    <table><thead><tr><th>id</th><th>question</th><th>prediction</th><th>gold</th><th>EM</th><th>F1</th></tr></thead><tbody id="questions"></tbody></table></section>
</main>
<script type="application/json" id="data">__DATA__</script>
<script>
(function () {
  var data = JSON.parse(document.getElementById("data").textContent);
  var $ = function (id) { return document.getElementById(id); };
  var state = { ep: 0, step: 0 };
  function el(tag, text, cls) { var e = document.createElement(tag); if (text !== undefined) e.textContent = text; if (cls) e.className = cls; return e; }
  function fill(list, items) { list.innerHTML = ""; items.forEach(function (t) { list.appendChild(el("li", t)); }); }
  data.forEach(function (ep, i) {
    var o = el("option", ep.method + " | " + ep.dataset + " | " + ep.task_id + " (" + ep.steps.length + " steps)");
    o.value = i; $("episode").appendChild(o);
  });
  function render() {
    if (!data.length) { $("pos").textContent = "no episodes recorded"; return; }
    var ep = data[state.ep], st = ep.steps[state.step] || {};
    $("episode").value = state.ep;
    $("step").max = Math.max(0, ep.steps.length - 1); $("step").value = state.step;
    $("pos").textContent = "step " + (state.step + 1) + " / " + ep.steps.length;
    $("kind").textContent = st.kind || "";
    $("input").textContent = st.input || "";
    fill($("actions"), st.actions || []);
    var body = $("memory"); body.innerHTML = "";
    (st.memory || []).forEach(function (m) {
      var tr = el("tr", undefined, "role-" + m.role); tr.setAttribute("data-handle", m.handle);
      tr.appendChild(el("td", m.handle)); tr.appendChild(el("td", m.role)); tr.appendChild(el("td", m.text));
      var rel = Object.keys(m.relations || {}).map(function (k) { return m.relations[k] + "(" + m.handle + ", " + k + ")"; });
      tr.appendChild(el("td", rel.join("; "))); body.appendChild(tr);
    });
    $("memcount").textContent = (st.memory || []).length + (st.memory_total > (st.memory || []).length ? " of " + st.memory_total : "");
    fill($("retrieved"), st.retrieved || []);
    $("answer").textContent = st.answer || "";
    var qb = $("questions"); qb.innerHTML = "";
    (ep.questions || []).forEach(function (q) {
      var tr = el("tr"); [q.id, q.question, q.prediction === null ? "(none)" : q.prediction, (q.answers || []).join(" | "),
        (q.em * 100).toFixed(0), (q.f1 * 100).toFixed(0)].forEach(function (v) { tr.appendChild(el("td", String(v))); });
      qb.appendChild(tr);
    });
    document.body.setAttribute("data-ep", state.ep); document.body.setAttribute("data-step", state.step);
  }
  function go(d) { var n = data.length ? data[state.ep].steps.length : 0; state.step = Math.max(0, Math.min(n - 1, state.step + d)); render(); }
  $("prev").addEventListener("click", function () { go(-1); });
  $("next").addEventListener("click", function () { go(1); });
  $("step").addEventListener("input", function () { state.step = parseInt(this.value, 10) || 0; render(); });
  $("episode").addEventListener("change", function () { state.ep = parseInt(this.value, 10) || 0; state.step = 0; render(); });
  document.addEventListener("keydown", function (e) { if (e.key === "ArrowRight") go(1); if (e.key === "ArrowLeft") go(-1); });
  var h = {}; location.hash.replace(/^#/, "").split("&").forEach(function (kv) { var p = kv.split("="); if (p[0]) h[p[0]] = parseInt(p[1], 10) || 0; });
  if (h.ep && h.ep < data.length) state.ep = h.ep;
  if (h.step) state.step = h.step;
  render();
  for (var i = 0; i < (h.click || 0); i++) { $("next").click(); }
  document.body.setAttribute("data-ready", "1");
})();
</script>
</body></html>
"""


def viewer_episodes(records: list[dict]) -> list[dict]:
    out = []
    for r in records:
        if not r.get("steps"):
            continue
        out.append({"method": r["method"], "dataset": r["dataset"], "task_id": r["task_id"], "steps": r["steps"],
                    "questions": [{k: q.get(k) for k in ("id", "question", "prediction", "answers", "em", "f1")}
                                  for q in r["questions"]]})
    return out


def write_viewer(records: list[dict], path: str | Path) -> Path:
    blob = json.dumps(viewer_episodes(records), ensure_ascii=True, default=str)
    blob = blob.replace("</", "<\\/").replace("<!--", "<\\u0021--")
    page = _PAGE.replace("__DATA__", blob)
    Path(path).write_text(page, encoding="utf-8")
    return Path(path)


__all__ = ["write_viewer", "viewer_episodes"]
