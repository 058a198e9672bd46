"""PNG plots (matplotlib, Agg backend):

    accuracy_by_method.png       EM (F1 on LoCoMo) per method, one group per dataset
    accuracy_by_category.png     F1 (LoCoMo F1 on LoCoMo) per category and method, one panel per dataset
    scaling_docs.png             EM, LLM tokens per task and seconds per task against the number of
                                 documents (when the tasks span several, e.g. 200 to 800)
    scaling_confounders.png      the same against confounders per question (0 to 8)
    ops_over_training.png        operation frequencies per step over training steps, read from a run's
                                 logs (``trainer_state.json`` log history, or a JSONL of log dicts, with
                                 keys ``ops/<op>_per_step``)
"""

from __future__ import annotations

import json
from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _main_score(r: dict) -> float:
    v = r.get("locomo_f1") if r.get("locomo_f1") is not None else r.get("em")
    return 100 * (v or 0.0)


def read_training_ops(run: str | Path) -> dict[str, list[tuple[float, float]]]:
    """{op: [(step, per-step frequency)]} from a run folder or log file."""
    run = Path(run)
    if not run.exists():
        raise FileNotFoundError(f"run logs {run} do not exist")
    logs: list[dict] = []
    if run.is_dir():
        states = sorted(run.rglob("trainer_state.json"), key=lambda p: json.loads(p.read_text()).get("global_step", 0))
        if states:
            logs = json.loads(states[-1].read_text()).get("log_history", [])
        else:
            for f in sorted(run.rglob("*.jsonl")):
                logs += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    elif run.suffix == ".jsonl":
        logs = [json.loads(x) for x in run.read_text().splitlines() if x.strip()]
    else:
        data = json.loads(run.read_text())
        logs = data.get("log_history", data) if isinstance(data, dict) else data
    out: dict[str, list] = {}
    for i, row in enumerate(logs):
        if not isinstance(row, dict):
            continue
        step = row.get("step", row.get("global_step", i))
        for k, v in row.items():
            if isinstance(k, str) and k.startswith("ops/") and k.endswith("_per_step") and isinstance(v, (int, float)):
                out.setdefault(k[4:-9], []).append((step, v))
    return out


def write_plots(metrics: dict, out_dir: str | Path, run_logs: str | None = None) -> list[str]:
    plt = _plt()
    out = Path(out_dir)
    res = metrics["results"]
    methods = list(res)
    datasets = list(dict.fromkeys(d for m in res.values() for d in m))
    files = []
    # accuracy by method
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(methods) * max(1, len(datasets)) * 0.6), 4))
    w = 0.8 / max(1, len(datasets))
    for j, d in enumerate(datasets):
        xs = [i + j * w for i in range(len(methods))]
        ax.bar(xs, [_main_score(res[m].get(d) or {}) for m in methods], width=w, label=d)
    ax.set_xticks([i + w * (len(datasets) - 1) / 2 for i in range(len(methods))])
    ax.set_xticklabels(methods, rotation=30, ha="right")
    ax.set_ylabel("EM % (LoCoMo: F1 %)")
    ax.set_title("Accuracy by method")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "accuracy_by_method.png", dpi=100)
    plt.close(fig)
    files.append("accuracy_by_method.png")
    # accuracy by category
    fig, axes = plt.subplots(1, max(1, len(datasets)), figsize=(5 * max(1, len(datasets)), 4), squeeze=False)
    for ax, d in zip(axes[0], datasets):
        cats = list(dict.fromkeys(c for m in methods for c in ((res[m].get(d) or {}).get("by_category") or {})))
        w = 0.8 / max(1, len(methods))
        for j, m in enumerate(methods):
            bc = (res[m].get(d) or {}).get("by_category") or {}
            key = "locomo_f1" if any("locomo_f1" in v for v in bc.values()) else "f1"
            ax.bar([i + j * w for i in range(len(cats))], [100 * ((bc.get(c) or {}).get(key) or 0) for c in cats],
                   width=w, label=m)
        ax.set_xticks([i + w * (len(methods) - 1) / 2 for i in range(len(cats))])
        ax.set_xticklabels(cats, rotation=20, fontsize=8)
        ax.set_title(f"{d}: F1 by category")
        ax.set_ylabel("F1 %")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "accuracy_by_category.png", dpi=100)
    plt.close(fig)
    files.append("accuracy_by_category.png")
    # scaling
    for name, label in (("docs", "documents per task"), ("confounders", "confounders per question")):
        sw = (metrics.get("sweeps") or {}).get(name) or {}
        if not sw:
            continue
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for m, by in sw.items():
            xs = sorted(by, key=int)
            axes[0].plot([int(x) for x in xs], [100 * (by[x]["em"] or 0) for x in xs], marker="o", label=m)
            axes[1].plot([int(x) for x in xs], [by[x]["tokens_per_task"] or by[x].get("env_tokens_per_task") or 0 for x in xs],
                         marker="o", label=m)
            axes[2].plot([int(x) for x in xs], [by[x]["seconds_per_task"] for x in xs], marker="o", label=m)
        for ax, t in zip(axes, ("EM %", "tokens per task (LLM; env tokens for LLM-free methods)", "seconds per task")):
            ax.set_xlabel(label)
            ax.set_title(t, fontsize=9)
        axes[1].set_yscale("symlog")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"scaling_{name}.png", dpi=100)
        plt.close(fig)
        files.append(f"scaling_{name}.png")
    if run_logs:
        ops = read_training_ops(run_logs)
        if ops:
            fig, ax = plt.subplots(figsize=(7, 4))
            for op, pts in sorted(ops.items()):
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=op)
            ax.set_xlabel("training step")
            ax.set_ylabel("operations per episode step")
            ax.set_title(f"Operation frequencies over training ({Path(run_logs).name})")
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(out / "ops_over_training.png", dpi=100)
            plt.close(fig)
            files.append("ops_over_training.png")
    return files
