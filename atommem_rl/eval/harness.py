"""The evaluation harness: every method on every dataset under one protocol, scored the same way.

``evaluate(datasets, methods, out_dir, ...)`` runs each method on each dataset's tasks, scores every
answer (EM, F1, BLEU-1, LoCoMo F1 on LoCoMo, the LLM judge when configured), measures the mechanism
metrics (answer-critical source recall, confounder-token share, relation-label accuracy/macro-F1),
counts LLM calls and tokens per task through the backend, times each method, and writes
``metrics.json``, ``report.md``, the plots, ``trajectories.jsonl`` and ``viewer.html`` into ``out_dir``.

Evaluation trains nothing (models are put in eval mode, no optimiser exists) and no method but the
oracle reads gold: scoring happens here, on the full task, after the method returned its answers.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from atommem_rl import scoring
from atommem_rl.policies.base import Policy, memory_lines, sections, step_token_limit
from atommem_rl.tasks.schema import Task

from atommem_rl.inference.chat_backends import Backend, Request, RoutedBackend
from .methods import READERS, Episode, drive, public_task
from .resume import _Partial
from .settings import LLM_METHODS, PIPELINE_METHODS, EvalSettings


class BackendPolicy(Policy):
    """The AtomMem policy as a model prompted through the backend (one generate call per step)."""

    def __init__(self, backend: Backend, max_new_tokens: int, name: str = "atommem"):
        self.backend, self.max_new_tokens, self.name = backend, max_new_tokens, name

    def act(self, batch):
        return self.backend.generate([Request(obs, step_token_limit(info, self.max_new_tokens), key)
                                      for key, obs, info in batch])


def env_config(task: Task, s: EvalSettings, backend: Backend | None) -> dict:
    cfg = {"chunk_tokens": s.chunk_tokens, "max_prompt_tokens": s.max_prompt_tokens, "retrieval_k": s.retrieval_k,
           "embedder": s.embedder, "reward": "locomo_f1" if task.source == "locomo" else "em", **s.policy_env}
    if backend is not None:
        cfg["tokenizer"] = backend.tokenizer
        cfg["max_prompt_tokens"] = min(s.max_prompt_tokens, backend.context_window - s.policy_max_new_tokens)
    return cfg


def _env_memory(env) -> list[dict]:
    if env.store is None:
        return []
    out = []
    for a in env.store.snapshot():
        out.append({"handle": env.handle_of.get(a["id"], a["id"]), "text": a["text"], "role": a["role"],
                    "relations": {env.handle_of.get(k, k): v for k, v in a["relations"].items()},
                    "sources": sorted(set(a["source_ids"]) | env._extra_sources.get(a["id"], set()))})
    return out


def run_policy(tasks: list[Task], policy: Policy, s: EvalSettings, backend: Backend | None, prefix: tuple,
               gold: bool = False) -> list[dict]:
    """Episodes of a policy in the memory environment, ``batch_size`` at a time (one policy call per
    round); the viewer episodes record the memory after every step. An exception in the environment's
    reset or step, or in the policy's start or act, is that episode's crash (``extra["crashed"]``, counted
    in metrics.json; the traceback in ``extra["traceback"]``), never the evaluation's: the same guards as
    ``atommem rollout`` (:func:`atommem_rl.rollout.start_episode`, :func:`atommem_rl.rollout.act_or_crash`)."""
    from envs import make_env

    from atommem_rl.rollout import Crash, act_or_crash, start_episode

    queue = list(enumerate(tasks))
    active: dict[Any, dict] = {}
    out: list[dict] = []

    def finish(k, st: dict, info: dict, term: bool, crash: Crash | None) -> None:
        env, ep = st["env"], st["ep"]
        if st["obs"] is not None:  # not when the episode never started (reset or policy.start raised)
            ep.predictions = dict(env.answers)
            ep.memory = _env_memory(env)
        ep.ops = dict(info.get("ops") or {})
        ep.extra.update({"evidence_recall": info.get("evidence_recall"),
                         "confounder_token_share": info.get("confounder_token_share"),
                         "env_tokens": info.get("tokens"), "terminated": bool(term),
                         "tool_errors": info.get("tool_errors", 0), "crashed": crash.error if crash else None})
        if crash is not None:
            ep.extra["traceback"] = crash.traceback
        env.close()
        out.append({"i": st["i"], "ep": ep, "key": k})

    while queue or active:
        while queue and len(active) < s.batch_size:
            i, task = queue.pop(0)
            key = prefix + (i,)
            env = make_env(task, **env_config(task, s, backend))  # a configuration error is the run's
            st = {"env": env, "obs": None, "info": {}, "i": i,
                  "ep": Episode(task, i < s.viewer_tasks, s.viewer_memory_cap)}
            started = start_episode(env, policy, key, task if gold else public_task(task), s.seed + i)
            if isinstance(started, Crash):  # the policy has forgotten the key already
                finish(key, st, {}, False, started)
                continue
            st["obs"], st["info"] = started
            active[key] = st
        if not active:
            continue
        keys = list(active)
        actions = act_or_crash(policy, [(k, active[k]["obs"], active[k]["info"]) for k in keys])
        for k, action in zip(keys, actions):
            st = active[k]
            env, ep = st["env"], st["ep"]
            sec = sections(st["obs"])
            shown = [f"[{h}] {t}" for h, t in memory_lines(st["obs"]).items()]
            crash = action if isinstance(action, Crash) else None
            if crash is not None:
                action, term, trunc, info = f"(the policy crashed: {crash.error})", False, True, st["info"]
            else:
                try:
                    obs, _, term, trunc, info = env.step(action)
                except Exception as exc:  # noqa: BLE001 - a crash is a finding, recorded
                    crash, term, trunc, info = Crash(exc), False, True, st["info"]
            if ep.steps is not None:
                kind = "chunk" if st["info"].get("phase") == "chunks" else "answer"
                text = sec.get("chunk", "") if kind == "chunk" else sec.get("question", "")
                results = [f"{r.get('name')}: {'ok' if r.get('ok') else 'error'}: {r.get('message', '')}"
                           for r in info.get("results") or []]
                ep.step(kind, text, [action] + results, _env_memory(env), shown,
                        "; ".join(f"{q}: {a}" for q, a in env.answers.items()) or None)
            if crash is None:
                st["obs"], st["info"] = obs, info
            if term or trunc:
                finish(k, st, info, term, crash)
                policy.end(k)
                del active[k]
    return [r["ep"] for r in sorted(out, key=lambda r: r["i"])]


# ------------------------------------------------------------------------------ scoring
def score_questions(task: Task, predictions: dict[str, str], judge=None) -> list[dict]:
    out = []
    for q in task.questions:
        pred = predictions.get(q.id)
        p = pred if pred is not None else ""
        row = {"id": q.id, "question": q.question, "answers": q.answers, "category": q.category, "prediction": pred,
               "em": scoring.exact_match(p, q.answers), "f1": scoring.f1(p, q.answers), "bleu1": scoring.bleu1(p, q.answers)}
        if task.source == "locomo":
            cat = q.category if isinstance(q.category, int) else None
            row["locomo_f1"] = max(scoring.locomo_f1(p, g, cat) for g in q.answers)
        if judge is not None:
            try:
                row["judge"] = judge(q.question, p, q.answers)
            except ConnectionError as exc:
                row["judge"], row["judge_error"] = None, str(exc)[:200]
        out.append(row)
    return out


def relation_pairs(task: Task, memory: list[dict]) -> list[tuple[str, str]]:
    """(predicted, gold) labels for every labelled pair whose source units carry a gold label."""
    from atommem_rl.memory.atom import Relation

    gold = {(r.new, r.old): Relation.parse(r.label).value for r in task.relations}
    if not gold:
        return []
    exhaustive = bool(task.meta.get("relations_exhaustive"))
    by_handle = {m["handle"]: m for m in memory}
    pairs = []
    for m in memory:
        for old, label in (m.get("relations") or {}).items():
            o = by_handle.get(old)
            if o is None:
                continue
            golds = {gold[(a, b)] for a in m["sources"] for b in o["sources"] if (a, b) in gold}
            if not golds and exhaustive and m["sources"] and o["sources"]:
                golds = {"independent"}
            if golds:
                pairs.append((label, label if label in golds else sorted(golds)[0]))
    return pairs


def mechanism(task: Task, ep: Episode, count) -> tuple[float | None, float | None]:
    """(answer-critical source recall, confounder-token share) of what the reader was shown."""
    if ep.extra.get("no_sources"):
        return None, None
    roles = {u.id: u.role for b in task.blocks for u in b.units}
    gold = task.evidence_ids()
    shown: set[str] = set()
    total = conf = 0.0
    for items in ep.shown.values():
        for it in items:
            shown.update(it.sources)
            n = count(it.text)
            total += n
            if it.sources:
                conf += n * sum(roles.get(x) in ("confounder", "distractor") for x in it.sources) / len(it.sources)
    recall = len(gold & shown) / len(gold) if gold else None
    return recall, (conf / total if total else None)


# ------------------------------------------------------------------------------ the run
def evaluate(datasets: dict[str, list[Task]], methods: list[str], out_dir: str | Path, *,
             settings: EvalSettings | None = None, backend: Backend | None = None, backend_factory=None,
             checkpoints: dict[str, Any] | None = None, run_logs: str | None = None,
             extra_settings: dict | None = None, extractor=None, resume: bool = False, log=print) -> dict:
    """Run and score every method on every dataset; write all outputs; return metrics.json's dict.

    ``backend`` (or ``backend_factory()``, called once when an LLM method needs it) is the reader;
    ``checkpoints`` maps ``checkpoint:NAME`` methods to a backend or a factory for it; ``extractor``
    (a backend or a factory) answers the graph-memory pipeline's extraction calls instead of the
    reader (a trained extractor beside a general reader); their tokens are counted together.

    Each finished (method, dataset) is appended to ``records.partial.jsonl`` in ``out_dir`` (removed
    when the run completes), so a run that is killed loses only the pair in progress; with ``resume``
    a rerun with the same settings, datasets and methods' models skips the pairs recorded there.
    """
    from . import metrics as M
    from .report import write_report
    from .viewer import write_viewer

    s = settings or EvalSettings()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    checkpoints = dict(checkpoints or {})
    judge = scoring.LLMJudge(s.judge_url, s.judge_model) if s.judge_url and s.judge_model else None
    from atommem_rl.memory.embeddings import make_embedder

    embedder = make_embedder(s.embedder)
    records: list[dict] = []
    method_info: dict[str, dict] = {}
    partial = _Partial(out / "records.partial.jsonl", s, datasets, extra_settings, log)
    done = partial.load() if resume else set()
    records += partial.records
    method_info.update(partial.method_info)
    partial.start(keep=resume)
    for method in methods:
        if all((method, d) in done for d in datasets):
            continue
        mb: Backend | None = None
        if method.startswith("checkpoint:"):
            spec = checkpoints[method]
            mb = spec() if callable(spec) else spec
        elif method in LLM_METHODS:
            if backend is None:
                backend = backend_factory()
            mb = backend
            if extractor is not None and method in PIPELINE_METHODS:
                if callable(extractor):
                    extractor = extractor()
                mb = RoutedBackend(backend, {"extract": extractor})
        elif method not in ("oracle", "heuristic"):
            raise ValueError(f"unknown method {method!r}")
        method_info[method] = {"llm": mb is not None, "model": mb.model_name if mb else None,
                               "backend": mb.name if mb else None}
        if isinstance(mb, RoutedBackend):
            method_info[method]["models"] = {"reader": mb.reader.model_name,
                                             **{r: b.model_name for r, b in mb.routes.items()}}
        partial.write({"method_info": {method: method_info[method]}})
        for dname, tasks in datasets.items():
            if (method, dname) in done:
                continue
            t0 = time.perf_counter()
            prefix = (method, dname)
            if method in READERS:
                keys = [prefix + (i,) for i in range(len(tasks))]
                episodes = {k: Episode(public_task(t), i < s.viewer_tasks, s.viewer_memory_cap)
                            for i, (k, t) in enumerate(zip(keys, tasks))}
                for start in range(0, len(keys), s.batch_size):  # at most batch_size episodes in flight
                    part = keys[start:start + s.batch_size]
                    drive({k: READERS[method](episodes[k], mb, s, k, embedder) for k in part}, mb)
                eps = [episodes[k] for k in keys]
            else:
                if method == "oracle":
                    from atommem_rl.policies.oracle import OraclePolicy

                    policy = OraclePolicy()
                elif method == "heuristic":
                    from atommem_rl.policies.heuristic import HeuristicPolicy

                    policy = HeuristicPolicy()
                else:
                    policy = BackendPolicy(mb, s.policy_max_new_tokens, method)
                eps = run_policy(tasks, policy, s, mb, prefix, gold=(method == "oracle"))
            seconds = time.perf_counter() - t0
            count = (mb.count if mb is not None else _word_count)
            for i, (task, ep) in enumerate(zip(tasks, eps)):
                rec = _record(method, dname, task, ep, judge, count)
                rec["usage"] = mb.take_usage(prefix + (i,)) if mb is not None else {
                    "calls": 0, "prompt_tokens": 0, "completion_tokens": 0, "cut_prompts": 0}
                rec["seconds"] = seconds / max(1, len(tasks))
                records.append(rec)
                partial.write({"record": rec})
            res = M.aggregate([r for r in records if r["method"] == method and r["dataset"] == dname])
            log(json.dumps({"method": method, "dataset": dname, "tasks": len(tasks), "em": res["em"], "f1": res["f1"],
                            "tokens_per_task": res["tokens_per_task"], "seconds_per_task": res["seconds_per_task"]}))
        if method.startswith("checkpoint:") and mb is not None:
            mb.close()
    metrics = M.build_metrics(records, s, datasets, method_info, extra_settings or {})
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str))
    with (out / "trajectories.jsonl").open("w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, default=str) + "\n")
    from .plots import write_plots

    plots = write_plots(metrics, out, run_logs=run_logs)
    metrics["plots"] = plots
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str))
    write_report(metrics, out / "report.md")
    write_viewer(records, out / "viewer.html")
    partial.remove()
    return metrics


def _word_count(text: str) -> int:
    return len(text.split())


def _record(method: str, dname: str, task: Task, ep: Episode, judge, count) -> dict:
    recall, conf = mechanism(task, ep, count)
    if method in ("oracle", "heuristic", "atommem") or method.startswith("checkpoint:"):
        recall, conf = ep.extra.get("evidence_recall"), ep.extra.get("confounder_token_share")
    extra = {k: v for k, v in ep.extra.items() if k not in ("evidence_recall", "confounder_token_share", "no_sources")}
    return {
        "method": method, "dataset": dname, "task_id": task.id, "source": task.source, "kind": task.kind,
        "docs": task.meta.get("docs", len(task.blocks)), "confounders": task.meta.get("confounders"),
        "questions": score_questions(task, ep.predictions, judge),
        "evidence_recall": recall, "confounder_token_share": conf,
        "relation_pairs": relation_pairs(task, ep.memory), "ops": ep.ops, "extra": extra,
        "memory_size": sum(1 for m in ep.memory if m.get("role") != "deleted"),
        "steps": ep.steps, "shown": {q: [{"text": i.text[:2000], "sources": i.sources} for i in items]
                                     for q, items in ep.shown.items()} if ep.steps is not None else None,
    }
