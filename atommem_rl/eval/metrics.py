"""Aggregation of per-task records into ``metrics.json``.

Schema (all scores in 0-1; ``null`` where a metric does not apply)::

    {"settings": {seed, methods, datasets: {name: {file, tasks, questions, sources}}, backend, model,
                  retrieval_k, embedder, reader/manager/policy max_new_tokens, context_tokens,
                  rag_chunk_tokens, mem0_k, memagent_*, roam_*, chunk_tokens, max_prompt_tokens,
                  judge, methods_info: {method: {llm, model, backend}}, ...},
     "results": {"<method>": {"<dataset>": {
          "tasks", "questions", "em", "f1", "bleu1", "locomo_f1" (LoCoMo only), "judge" (when on),
          "by_category": {"<category>": {"questions", "em", "f1", "bleu1"[, "locomo_f1"][, "judge"]}},
          "evidence_recall"        answer-critical source recall (mean over tasks),
          "confounder_token_share" share of shown tokens from confounder/distractor units,
          "relation_pairs", "relation_accuracy", "relation_macro_f1"   vs gold labels,
          "llm_calls_per_task", "prompt_tokens_per_task", "completion_tokens_per_task",
          "tokens_per_task" (prompt + completion of the method's LLM calls), "tokens_by_role_per_task"
          and "calls_by_role_per_task" ({role: n}: the same split by what each call was for: "extract",
          "verify", "reader" (answers), "manage" (mem0, MemAgent), "label" (ROAM)), "env_tokens_per_task"
          (policy methods: the prompt + completion tokens the environment counted, LLM or not),
          "seconds_per_task", "ops_per_task": {op: n}, "memory_size", "context_truncated" (full
          context: mean share of input tokens cut), "cut_prompts", "crashes",
          "tool_errors_per_task" (policy methods: failed tool calls per episode), "unanswered" (share
          of questions with no answer recorded: a policy that never called answer for them)}}},
     "sweeps": {"docs": {"<method>": {"<n docs>": {"tasks", "em", "f1", "tokens_per_task",
                                                    "llm_calls_per_task", "seconds_per_task"}}},
                "confounders": {... same by confounders per question ...}},
     "efficiency": {"<dataset>": {"atommem_vs_mem0": {...}, "atommem_vs_full_context": {...}}},
     "plots": [file names]}
"""

from __future__ import annotations

from collections import defaultdict

from atommem_rl.scoring import relation_scores

SCORES = ("em", "f1", "bleu1", "locomo_f1", "judge")


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _score_block(rows: list[dict]) -> dict:
    out = {"questions": len(rows)}
    for k in SCORES:
        if any(k in r for r in rows):
            out[k] = _mean([r.get(k) for r in rows])
    return out


def aggregate(records: list[dict]) -> dict:
    qs = [q for r in records for q in r["questions"]]
    res = {"tasks": len(records), **_score_block(qs)}
    for k in ("em", "f1"):
        res.setdefault(k, None)
    cats = defaultdict(list)
    for q in qs:
        cats[str(q.get("category"))].append(q)
    res["by_category"] = {c: _score_block(v) for c, v in sorted(cats.items())}
    res["evidence_recall"] = _mean([r.get("evidence_recall") for r in records])
    res["confounder_token_share"] = _mean([r.get("confounder_token_share") for r in records])
    rel = relation_scores([tuple(p) for r in records for p in r.get("relation_pairs") or []])
    res["relation_pairs"] = rel["pairs"]
    res["relation_accuracy"] = rel["accuracy"]
    res["relation_macro_f1"] = rel["macro_f1"]
    n = max(1, len(records))
    u = lambda k: sum((r.get("usage") or {}).get(k, 0) for r in records) / n  # noqa: E731
    res["llm_calls_per_task"] = u("calls")
    res["prompt_tokens_per_task"] = u("prompt_tokens")
    res["completion_tokens_per_task"] = u("completion_tokens")
    res["tokens_per_task"] = res["prompt_tokens_per_task"] + res["completion_tokens_per_task"]
    res["cut_prompts"] = int(u("cut_prompts") * n)
    from atommem_rl.inference.chat_backends import merge_roles

    roles = merge_roles((r.get("usage") or {}).get("by_role") or {} for r in records)
    res["tokens_by_role_per_task"] = {role: (v["prompt_tokens"] + v["completion_tokens"]) / n for role, v in sorted(roles.items())}
    res["calls_by_role_per_task"] = {role: v["calls"] / n for role, v in sorted(roles.items())}
    env = [r["extra"].get("env_tokens") for r in records if (r.get("extra") or {}).get("env_tokens")]
    res["env_tokens_per_task"] = (sum(e.get("prompt", 0) + e.get("completion", 0) for e in env) / len(env)) if env else None
    res["seconds_per_task"] = sum(r.get("seconds", 0.0) for r in records) / n
    ops = defaultdict(float)
    for r in records:
        for k, v in (r.get("ops") or {}).items():
            ops[k] += v / n
    res["ops_per_task"] = dict(sorted(ops.items()))
    res["memory_size"] = _mean([r.get("memory_size") for r in records])
    res["context_truncated"] = _mean([(r.get("extra") or {}).get("context_truncated") for r in records])
    res["crashes"] = sum(1 for r in records if (r.get("extra") or {}).get("crashed"))
    # a policy that degenerates (long, failing steps) stops answering: say so apart from wrong answers
    res["tool_errors_per_task"] = _mean([(r.get("extra") or {}).get("tool_errors") for r in records])
    res["unanswered"] = _mean([float(not (q.get("prediction") or "").strip()) for q in qs])
    return res


def _sweep(records: list[dict], field: str) -> dict:
    out: dict = {}
    groups = defaultdict(list)
    for r in records:
        if r.get(field) is not None:
            groups[(r["method"], int(r[field]))].append(r)
    values = {v for _, v in groups}
    if len(values) < 2:
        return {}
    for (m, v), rs in sorted(groups.items()):
        a = aggregate(rs)
        out.setdefault(m, {})[str(v)] = {k: a[k] for k in ("tasks", "em", "f1", "tokens_per_task", "llm_calls_per_task",
                                                           "seconds_per_task", "env_tokens_per_task")}
    return out


def _ratio(a, b):
    return None if a is None or not b else a / b


def efficiency(results: dict) -> dict:
    """Tokens per task of the AtomMem-style manager against mem0-style and full context."""
    out = {}
    datasets = {d for m in results.values() for d in m}
    for d in sorted(datasets):
        get = lambda m: (results.get(m) or {}).get(d)  # noqa: E731
        row = {}
        for base in ("mem0", "full_context"):
            for ours in ("atommem", "roam", "atommem_graph"):
                a, b = get(ours), get(base)
                if a and b:
                    r = _ratio(a["tokens_per_task"], b["tokens_per_task"])
                    row[f"{ours}_vs_{base}"] = {"ours_tokens_per_task": a["tokens_per_task"],
                                                "base_tokens_per_task": b["tokens_per_task"], "ratio": r,
                                                "fewer_tokens_pct": None if r is None else 100 * (1 - r)}
        if row:
            out[d] = row
    return out


def build_metrics(records: list[dict], settings, datasets: dict, method_info: dict, extra: dict) -> dict:
    from dataclasses import asdict

    results: dict = {}
    for m in dict.fromkeys(r["method"] for r in records):
        for d in dict.fromkeys(r["dataset"] for r in records):
            rs = [r for r in records if r["method"] == m and r["dataset"] == d]
            if rs:
                results.setdefault(m, {})[d] = aggregate(rs)
    st = asdict(settings)
    st.update({"methods": list(results), "methods_info": method_info,
               "datasets": {d: {"tasks": len(ts), "questions": sum(len(t.questions) for t in ts),
                                "sources": sorted({t.source for t in ts})} for d, ts in datasets.items()},
               "judge": bool(settings.judge_url and settings.judge_model)})
    st.update(extra)
    return {"settings": st, "results": results,
            "sweeps": {"docs": _sweep(records, "docs"), "confounders": _sweep(records, "confounders")},
            "efficiency": efficiency(results)}
