"""The memory page of one ``atommem serve`` session: its atoms (handle, role, text, relations, the fused
view retrieval shows), its scratchpad, and, for a query typed in the box, the fused views the policy
would be shown. Server-rendered HTML without scripts; every stored text is escaped (atoms are written
by the policy from untrusted input)."""

from __future__ import annotations

from html import escape
from urllib.parse import quote

_STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#1d2430;background:#f7f8fa}
h1{font-size:20px}h2{font-size:16px;margin-top:24px}
table{border-collapse:collapse;width:100%;background:#fff}
td,th{border:1px solid #d5d9e0;padding:6px 8px;text-align:left;vertical-align:top;font-size:14px}
th{background:#eef1f5}.role{font-weight:600}.primary{color:#17663a}.evidence{color:#8a5a00}.deleted{color:#9aa;text-decoration:line-through}
pre{background:#fff;border:1px solid #d5d9e0;padding:8px;white-space:pre-wrap}.muted{color:#667}
"""


def _rows(memories: list[dict]) -> str:
    if not memories:
        return '<tr><td colspan="5" class="muted">no memories yet</td></tr>'
    out = []
    for m in memories:
        rel = ", ".join(f"{escape(str(label))} {escape(str(h))}" for h, label in (m.get("relations") or {}).items())
        role = escape(str(m.get("role")))
        view = m.get("view")
        out.append(f'<tr><td>{escape(str(m.get("handle")))}</td><td class="role {role}">{role}</td>'
                   f'<td>{escape(str(m.get("text")))}</td><td>{rel or "<span class=muted>none</span>"}</td>'
                   f'<td>{escape(view) if view and view != m.get("text") else "<span class=muted>same</span>"}</td></tr>')
    return "\n".join(out)


def memory_page(session: str, data: dict, query: str = "") -> str:
    views = data.get("views") or []
    found = "".join(f"<tr><td>{escape(str(v['handle']))}</td><td>{v['score']}</td><td>{escape(v['text'])}</td></tr>"
                    for v in views) or '<tr><td colspan="3" class="muted">nothing retrieved</td></tr>'
    search = (f'<h2>Retrieved for &ldquo;{escape(query)}&rdquo;</h2><table><tr><th>handle</th><th>score</th>'
              f'<th>fused view</th></tr>{found}</table>') if query else ""
    mems = data.get("memories") or []
    live = sum(1 for m in mems if m.get("role") != "deleted")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>memory of {escape(session)}</title>
<style>{_STYLE}</style></head><body>
<h1>Memory of session <code>{escape(session)}</code></h1>
<p class="muted">{live} memories. JSON: <a href="/sessions/{quote(session)}/memories">/sessions/{escape(session)}/memories</a></p>
<form method="get"><input name="q" value="{escape(query)}" size="60" placeholder="what would the policy be shown for..."> <button>retrieve</button></form>
{search}
<h2>Scratchpad</h2><pre>{escape(data.get("scratchpad") or "") or "(empty)"}</pre>
<h2>Atoms</h2>
<table><tr><th>handle</th><th>role</th><th>text</th><th>relations</th><th>fused view</th></tr>
{_rows(mems)}
</table></body></html>"""
