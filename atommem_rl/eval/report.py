"""``report.md``: the run's settings and tables by dataset, category and method (percentages)."""

from __future__ import annotations

from pathlib import Path


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _num(x, nd: int = 0) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def write_report(metrics: dict, path: str | Path) -> None:
    s, res = metrics["settings"], metrics["results"]
    datasets = list(dict.fromkeys(d for m in res.values() for d in m))
    L = ["# Evaluation report", "",
         f"Methods: {', '.join(res)}. Datasets: "
         + ", ".join(f"{d} ({v['tasks']} tasks, {v['questions']} questions)" for d, v in s["datasets"].items()) + ".",
         f"Reader/policy model: {s.get('model')} via {s.get('backend')}; seed {s['seed']}; retrieval k={s['retrieval_k']}; "
         f"embedder {s['embedder']}; LLM judge {'on' if s.get('judge') else 'off'}.",
         "Scores in percent; EM/F1/BLEU-1 with HotpotQA normalisation, LoCoMo F1 with the official rules. "
         "Recall = answer-critical source recall; conf. share = confounder-token share of what the answer step saw.", ""]
    for d in datasets:
        L += [f"## {d}", ""]
        has_locomo = any("locomo_f1" in (res[m].get(d) or {}) for m in res)
        has_judge = any("judge" in (res[m].get(d) or {}) for m in res)
        head = ["method", "EM", "F1", "BLEU-1"] + (["LoCoMo F1"] if has_locomo else []) + (["judge"] if has_judge else []) + [
            "recall", "conf. share", "rel. acc", "rel. macro-F1", "LLM calls/task", "tokens/task", "s/task"]
        rows = []
        for m in res:
            r = res[m].get(d)
            if not r:
                continue
            rows.append([m, _pct(r["em"]), _pct(r["f1"]), _pct(r.get("bleu1"))]
                        + ([_pct(r.get("locomo_f1"))] if has_locomo else []) + ([_pct(r.get("judge"))] if has_judge else [])
                        + [_pct(r["evidence_recall"]), _pct(r["confounder_token_share"]), _pct(r["relation_accuracy"]),
                           _pct(r["relation_macro_f1"]), _num(r["llm_calls_per_task"], 1), _num(r["tokens_per_task"]),
                           _num(r["seconds_per_task"], 2)])
        L += _table(head, rows) + [""]
        cats = list(dict.fromkeys(c for m in res for c in ((res[m].get(d) or {}).get("by_category") or {})))
        if len(cats) > 1 or (cats and cats[0] != "None"):
            key = "locomo_f1" if has_locomo else "f1"
            L += [f"### {d}: {'LoCoMo F1' if has_locomo else 'F1'} by category", ""]
            rows = []
            for m in res:
                r = res[m].get(d)
                if r:
                    bc = r["by_category"]
                    rows.append([m] + [_pct((bc.get(c) or {}).get(key)) for c in cats])
            L += _table(["method"] + [f"{c} (n={((res[next(iter(res))].get(d) or {}).get('by_category') or {}).get(c, {}).get('questions', '?')})" for c in cats], rows) + [""]
        L += [f"### {d}: operations per task", ""]
        ops = list(dict.fromkeys(o for m in res for o in ((res[m].get(d) or {}).get("ops_per_task") or {})))
        rows = [[m] + [_num(res[m][d]["ops_per_task"].get(o), 1) for o in ops] + [_num(res[m][d].get("memory_size"), 1),
                _num(res[m][d].get("tool_errors_per_task"), 1), _pct(res[m][d].get("unanswered")),
                _pct(res[m][d].get("context_truncated"))] for m in res if res[m].get(d)]
        L += _table(["method"] + ops + ["memory size", "failed calls", "unanswered %", "context cut %"], rows) + [""]
    for name, title in (("docs", "number of documents"), ("confounders", "confounders per question")):
        sw = metrics.get("sweeps", {}).get(name) or {}
        if sw:
            L += [f"## Cost and accuracy against the {title}", ""]
            rows = []
            for m, by in sw.items():
                for v, r in by.items():
                    rows.append([m, v, str(r["tasks"]), _pct(r["em"]), _pct(r["f1"]), _num(r["llm_calls_per_task"], 1),
                                 _num(r["tokens_per_task"]), _num(r.get("env_tokens_per_task")), _num(r["seconds_per_task"], 2)])
            L += _table(["method", name, "tasks", "EM", "F1", "LLM calls/task", "LLM tokens/task", "env tokens/task", "s/task"], rows) + [""]
    eff = metrics.get("efficiency") or {}
    if eff:
        L += ["## Token efficiency", ""]
        rows = [[d, k, _num(v["ours_tokens_per_task"]), _num(v["base_tokens_per_task"]), _num(v["fewer_tokens_pct"], 1)]
                for d, row in eff.items() for k, v in row.items()]
        L += _table(["dataset", "comparison", "ours tokens/task", "baseline tokens/task", "% fewer tokens"], rows) + [""]
    if metrics.get("plots"):
        L += ["## Plots", ""] + [f"![{p}]({p})" for p in metrics["plots"]] + [""]
    L += ["## Settings", "", "```json"]
    import json

    L += [json.dumps({k: v for k, v in s.items() if k != "methods_info"}, indent=1, default=str), "```", ""]
    Path(path).write_text("\n".join(L), encoding="utf-8")
