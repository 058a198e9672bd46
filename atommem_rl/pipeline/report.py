"""The quickstart's ``report.md``, ``metrics.json`` and ``training_curves.png`` (rewritten every run
from the phase markers, so a resumed run reports the same numbers as the run that produced them)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from atommem_rl.eval.plots import read_training_ops

from .stats import verdict


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _pm(s: dict | None) -> str:
    if not s or s.get("mean") is None:
        return "-"
    return f"{100 * s['mean']:.1f} ± {100 * s['se']:.1f}"


def training_log(folder: Path) -> list[dict]:
    """The log history of the last ``checkpoint-N/trainer_state.json`` in a stage folder."""
    states = sorted(folder.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    return json.loads(states[-1].read_text()).get("log_history", []) if states else []


def informative_steps(rows: list[dict]) -> list[dict]:
    """The GRPO log rows (one per step) whose groups did not all score the same: ``reward_std`` (TRL's
    mean over the step's groups of the within-group standard deviation) above 0, so some advantage was not
    0 and the step moved the policy. A step whose every group scored alike is held or skipped."""
    return [r for r in rows if (r.get("reward_std") or 0.0) > 0.0]


def plot_training(out: Path) -> str | None:
    """SFT loss and GRPO reward per optimisation step (matplotlib, Agg)."""
    from atommem_rl.eval.plots import _plt

    sft = [(r["step"], r["loss"]) for r in training_log(out / "sft") if "loss" in r]
    rows = [r for r in training_log(out / "grpo") if "reward" in r]
    grpo = [(r["step"], r["reward"]) for r in rows]
    if not sft and not grpo:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    axes[0].plot([s for s, _ in sft], [v for _, v in sft], marker=".")
    axes[0].set_title("SFT: loss per step")
    axes[1].plot([s for s, _ in grpo], [v for _, v in grpo], marker=".", color="C1", label="all steps")
    info = [(r["step"], r["reward"]) for r in informative_steps(rows)]
    if info:
        axes[1].plot([s for s, _ in info], [v for _, v in info], "o", color="C1", mfc="none",
                     label="informative (groups differ)")
        axes[1].legend(fontsize=8)
    axes[1].set_title("GRPO: mean episode return per step")
    for ax in axes:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out / "training_curves.png", dpi=100)
    plt.close(fig)
    return "training_curves.png"


def write_quickstart_report(q, wall_seconds: float) -> Path:
    out: Path = q.out
    P = q.phases
    m = P.markers
    L = ["# AtomMem-RL quickstart report", "",
         f"Run folder `{out}`; {'tiny random-weight model' if q.cfg.tiny else 'SmolLM2-135M-Instruct'} "
         f"(`{q.base}`); {os.cpu_count()} CPU cores, load average at the end "
         f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}; this invocation took {wall_seconds:.0f} s.", "",
         "## Phases", "",
         "Wall and CPU seconds (all threads) of the run that produced each phase, and the load average when it ended.", "",
         "| phase | this run | wall s | CPU s | load | finished |", "|---|---|---|---|---|---|"]
    for name, mk in m.items():
        load = mk.get("load_average")
        L.append(f"| {name} | {'ran' if P.ran.get(name) else 'skipped (done)'} | {mk['seconds']:.0f} | "
                 f"{mk.get('cpu_seconds', '-')} | {load[0] if load else '-'} | {mk['finished']} |")
    L.append("")
    if "data" in m:
        d = m["data"]["result"]
        L += ["## Data", ""] + [f"- {k}: {v['tasks']} tasks, {v['questions']} questions (`{v['file']}`)"
                                for k, v in d.items()] + [""]
    curves = plot_training(out)
    if "sft" in m or "grpo" in m:
        L += ["## Training", ""]
        if "sft" in m:
            s = m["sft"]["result"]
            L.append(f"- SFT: {s['examples']} step examples, {s['global_step']} steps, mean loss {s['train_loss']:.3f} "
                     f"-> `{s['output_dir']}`")
        if "grpo" in m:
            g = m["grpo"]["result"]
            rows = [r for r in training_log(out / "grpo") if "reward" in r]
            rewards = [r["reward"] for r in rows]
            informative = informative_steps(rows)
            L.append(f"- GRPO: {g['global_step']} steps, loss {g['train_loss']:.4f}, mean episode return per step "
                     f"{', '.join(f'{x:.2f}' for x in rewards) or '-'} -> `{g['output_dir']}`")
            L.append(f"- GRPO informative steps (some group's episodes scored differently, so the step had a "
                     f"gradient): {len(informative)} of {len(rows)}"
                     + (f" (steps {', '.join(str(r['step']) for r in informative)})" if informative else ""))
            # AtomMem's training dynamics in numbers (the curves: eval/ops_over_training.png): each tool's calls
            # per environment step, early against late in training; tools never called are left out
            logged = read_training_ops(out / "grpo") if (out / "grpo").is_dir() else {}
            ops = {op: pts for op, pts in logged.items() if any(v for _, v in pts)}
            if logged:
                k = max(1, len(rows) // 4)
                mean = lambda pts: sum(v for _, v in pts) / len(pts)  # noqa: E731
                L.append(f"- GRPO tool calls per environment step, mean of the first {k} steps -> the last {k}: "
                         + (", ".join(f"{op} {mean(p[:k]):.2f} -> {mean(p[-k:]):.2f}" for op, p in sorted(ops.items()))
                            or "no tool was called"))
        if curves:
            L += ["", f"![training curves]({curves})"]
        L.append("")
    if "eval" in m:
        e = m["eval"]["result"]
        ep = e["episodes"]
        L += ["## Held-out evaluation (synthetic tasks)", "",
              "EM and F1 in percent, mean ± standard error over held-out episodes (an episode's score is the mean "
              "over its questions). Baselines: oracle (gold evidence, upper bound), heuristic (no LLM), reader "
              "methods with the base model as reader; checkpoint:* are the memory policies in the environment "
              "they were trained in.", "",
              "Mechanism columns: relation-label macro-F1 against the gold labels, questions left unanswered, "
              "failed tool calls and operations per episode (C create, R read, U update, D delete, L label).", "",
              "| method | EM | F1 | evidence recall | relation macro-F1 | unanswered | failed calls | C / R / U / D / L "
              "| tokens/task | s/task |", "|---|---|---|---|---|---|---|---|---|---|"]
        for meth, by in e["results"].items():
            r = by.get("synthetic") or {}
            st = ep.get(meth, {})
            o = r.get("ops_per_task") or {}
            ops = " / ".join(f"{o[k]:.1f}" for k in ("create", "read", "update", "delete", "relate") if k in o) or "-"
            err = r.get("tool_errors_per_task")
            L.append(f"| {meth} | {_pm(st.get('em'))} | {_pm(st.get('f1'))} | {_pct(r.get('evidence_recall'))} | "
                     f"{_pct(r.get('relation_macro_f1'))} | {_pct(r.get('unanswered'))} | "
                     f"{'-' if err is None else f'{err:.1f}'} | {ops} | "
                     f"{r.get('tokens_per_task') or 0:,.0f} | {r.get('seconds_per_task') or 0:.2f} |")
        diffs = {k: v for k, v in ep.items() if " - " in k}
        if diffs:
            L += ["", "Paired differences on the same tasks (percentage points, mean ± standard error):", ""]
            L += [f"- {k}: EM {_pm(v['em'])} ({verdict(v['em'])}), F1 {_pm(v['f1'])} ({verdict(v['f1'])})"
                  for k, v in diffs.items() if v["em"]["n"]]
            L += ["", "Beyond noise: more than 2 standard errors of the paired difference away from 0."]
        L += ["", "Plots and per-episode traces: [eval/report.md](eval/report.md), "
              "[eval/viewer.html](eval/viewer.html)", ""]
        L += [f"![{p}](eval/{p})" for p in e.get("plots", [])] + [""]
    if "retrieval" in m:
        r = m["retrieval"]["result"]
        if "skipped" in r:
            L += ["## LoCoMo retrieval", "", f"Skipped: {r['skipped']}", ""]
        else:
            cols = ["multi-hop", "temporal", "open-domain", "single-hop", "all"]
            res = r["strategies"]
            L += [f"## LoCoMo evidence recall@{r['k']} by retrieval strategy (%)", "",
                  f"{r['conversations']} conversations, {res[0]['questions']} questions with evidence, "
                  f"embedder `{r['embedder']}`; all 10 conversations: `atommem bench retrieval` (docs/BENCHMARKS.md).", "",
                  "| strategy | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
            L += [f"| {x['strategy']} | " + " | ".join(f"{x['recall_at_k'][c]:.1f}" for c in cols) + " |" for x in res]
            L.append("")
    report = out / "report.md"
    report.write_text("\n".join(L) + "\n", encoding="utf-8")
    metrics = {"settings": asdict(q.cfg), "wall_seconds": round(wall_seconds, 1), "load_average": os.getloadavg(),
               "phases": {n: {"ran": P.ran.get(n), "seconds": mk["seconds"], "cpu_seconds": mk.get("cpu_seconds"),
                              "load_average": mk.get("load_average"), "finished": mk["finished"],
                              "key": mk["key"], "result": mk["result"]} for n, mk in m.items()},
               "plots": [curves] if curves else []}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str))
    return report
