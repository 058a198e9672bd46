"""``atommem quickstart --tiny``: every phase runs and writes its artefacts; a second run skips every
phase; a GRPO phase cut short resumes from its last checkpoint-N and only what follows it reruns.

Real components: the CLI, TRL's SFT and GRPO trainers on a random-weight tiny model with the real
SmolLM2 tokenizer, the real environments and Chroma, the evaluation harness, the LoCoMo file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from .conftest import REPO, DATA, require

os.environ.setdefault("WANDB_MODE", "offline")
LOCOMO = DATA / "locomo" / "locomo10.json"
PHASES = ["model", "data", "sft", "grpo", "eval", "retrieval"]


def test_config_rejects_bad_values():
    from atommem_rl.pipeline.quickstart import QuickstartConfig

    with pytest.raises(ValueError, match="KEY=VALUE"):
        QuickstartConfig(sft_set=["max_steps"])
    with pytest.raises(ValueError, match="skipped"):
        QuickstartConfig(skip=["sft"])
    with pytest.raises(ValueError, match="heldout_tasks"):
        QuickstartConfig(heldout_tasks=0)
    with pytest.raises(ValueError, match="eval_autocast"):
        QuickstartConfig(eval_autocast="fp16")


def test_bad_overrides_fail_before_any_phase(tmp_path):
    from atommem_rl.pipeline.quickstart import Quickstart, QuickstartConfig

    for kw, msg in ((dict(sft_set=["max_stepz=2"]), "max_stepz"), (dict(grpo_set=["max_steps=two"]), "max_steps"),
                    (dict(eval_set=["chunk_tokens=lots"]), "chunk_tokens")):
        with pytest.raises(ValueError, match=msg):
            Quickstart(QuickstartConfig(out=str(tmp_path), tiny=True, **kw)).run()
        assert not list((tmp_path / "phases").glob("*.json"))  # nothing ran


def test_mean_se_by_hand():
    from atommem_rl.pipeline.stats import mean_se

    s = mean_se([0.0, 1.0, 1.0, 0.0])
    assert s["n"] == 4 and s["mean"] == 0.5
    assert s["se"] == pytest.approx((1 / 3) ** 0.5 / 2)  # sample variance 1/3, n = 4


def test_informative_steps_are_those_whose_groups_scored_differently():
    from atommem_rl.pipeline.report import informative_steps

    rows = [{"step": 1, "reward": 0.5, "reward_std": 0.53}, {"step": 2, "reward": 0.0, "reward_std": 0.0},
            {"step": 3, "reward": 1.0, "reward_std": 0.0}, {"step": 4, "reward": 0.1, "reward_std": 0.08}]
    assert [r["step"] for r in informative_steps(rows)] == [1, 4]


def test_verdict_two_standard_errors_either_way():
    from atommem_rl.pipeline.stats import verdict

    assert verdict({"mean": 0.07, "se": 0.03}) == "beyond noise"
    assert verdict({"mean": -0.086, "se": 0.033}) == "WORSE, beyond noise"
    assert verdict({"mean": 0.039, "se": 0.031}).startswith("NOT beyond noise")
    assert verdict({"mean": -0.05, "se": 0.03}).startswith("NOT beyond noise")


def test_phases_skip_rerun_and_propagate(tmp_path):
    """Unchanged settings skip; changed settings rerun the phase and everything downstream of it;
    a phase that raised leaves no marker; work folders are kept for the same key, cleared otherwise."""
    from atommem_rl.pipeline.phases import Phases

    calls = []

    def go(phases, a, b):
        phases.run("a", {"x": a}, lambda: calls.append("a") or a)
        phases.run("b", {"y": b}, lambda: calls.append("b") or b, deps=("a",))
        return phases

    go(Phases(tmp_path), 1, 1)
    assert calls == ["a", "b"]
    p = go(Phases(tmp_path), 1, 1)
    assert calls == ["a", "b"] and p.ran == {"a": False, "b": False} and p.markers["b"]["result"] == 1
    go(Phases(tmp_path), 2, 1)  # upstream changed: b reruns although its own settings did not
    assert calls == ["a", "b", "a", "b"]
    go(Phases(tmp_path), 2, 3)
    assert calls[-1] == "b" and calls.count("a") == 2

    p = Phases(tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        p.run("c", {}, lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert not (tmp_path / "phases" / "c.json").exists()

    def work(value):
        p = Phases(tmp_path)

        def fn():
            d = p.work_dir("w", tmp_path / "w")
            (d / f"file{value}").write_text("x")
            raise RuntimeError("interrupted")  # no marker: the next attempt sees the folder again
        with pytest.raises(RuntimeError):
            p.run("w", {"v": value}, fn)
        return sorted(f.name for f in (tmp_path / "w").iterdir())

    assert work(1) == ["file1", "pipeline_key.txt"]
    assert work(1) == ["file1", "pipeline_key.txt"]  # same key: kept (a trainer resumes from it)
    assert work(2) == ["file2", "pipeline_key.txt"]  # other settings: cleared first
    with pytest.raises(RuntimeError, match="outside"):
        p = Phases(tmp_path / "inner")
        p.run("z", {}, lambda: p.work_dir("z", tmp_path / "w"))


@pytest.mark.slow
def test_tiny_pipeline_runs_then_resumes(tmp_path, capsys):
    from atommem_rl.cli import main
    from atommem_rl.pipeline.quickstart import Quickstart, QuickstartConfig

    require(LOCOMO.exists(), f"LoCoMo file missing: {LOCOMO}")
    out = tmp_path / "qs"
    args = ["quickstart", "--tiny", "--out", str(out), "--locomo", str(LOCOMO), "--heldout-tasks", "2",
            "--methods", "oracle,heuristic,rag"]
    assert main(args) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1] == f"report: {out / 'report.md'}"

    # every phase ran and left its artefacts
    markers = {p: json.loads((out / "phases" / f"{p}.json").read_text()) for p in PHASES}
    for name in ("sft_train", "grpo_train", "heldout"):
        assert (out / "data" / f"{name}.jsonl").stat().st_size > 0
    for stage in ("sft", "grpo"):
        assert (out / stage / "config.json").exists() and any((out / stage).glob("*.safetensors"))
        assert sorted(p.name for p in (out / stage).glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
        assert markers[stage]["result"]["global_step"] == 2
    for f in ("metrics.json", "report.md", "trajectories.jsonl", "viewer.html", "accuracy_by_method.png",
              "ops_over_training.png"):
        assert (out / "eval" / f).stat().st_size > 0, f
    ev = json.loads((out / "eval" / "metrics.json").read_text())
    assert set(ev["results"]) == {"oracle", "heuristic", "rag", "checkpoint:base", "checkpoint:sft", "checkpoint:grpo"}
    assert ev["results"]["oracle"]["synthetic"]["em"] == 1.0  # the harness scored real answers
    eps = markers["eval"]["result"]["episodes"]
    assert eps["oracle"]["em"] == {"n": 2, "mean": 1.0, "se": 0.0}
    assert {"sft - base", "grpo - sft", "grpo - base"} <= set(eps)
    assert markers["retrieval"]["result"]["strategies"][0]["questions"] > 0
    report = (out / "report.md").read_text()
    for text in ("## Phases", "## Training", "checkpoint:grpo", "recall@10", "eval/viewer.html", "training_curves.png",
                 "GRPO informative steps", "GRPO tool calls per environment step", "- sft - base: EM", "Beyond noise: more than 2 standard errors"):
        assert text in report, text
    assert (out / "training_curves.png").stat().st_size > 0
    top = json.loads((out / "metrics.json").read_text())
    assert all(top["phases"][p]["ran"] for p in PHASES)

    # re-measured on fresh held-out tasks (scripts/confirm_heldout.py): another seed, the run's evaluation
    # settings, SFT once, paired differences for the run's GRPO and a second GRPO from the same SFT phase
    confirm = [sys.executable, str(REPO / "scripts" / "confirm_heldout.py"), str(out), "--tasks", "2"]
    same = subprocess.run(confirm + ["--seed", "1000"], capture_output=True, text=True)  # the run's own seed
    assert same.returncode != 0 and "own held-out seed" in same.stderr
    done = subprocess.run(confirm + ["--seed", "7", "--also", f"twin={out}", "--batch-size", "1",
                                     "--out", str(out / "c7")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (out / "confirm-7").exists()  # --out: written there, not in RUN/confirm-SEED
    assert json.loads((out / "c7" / "metrics.json").read_text())["settings"]["batch_size"] == 1
    paired = json.loads((out / "c7" / "paired.json").read_text())
    assert {"checkpoint:sft", "checkpoint:grpo", "checkpoint:twin"} <= set(paired)
    assert paired["grpo - sft"]["em"]["n"] == paired["twin - sft"]["em"]["n"] == 2
    assert paired["twin - sft"] == paired["grpo - sft"]  # the same checkpoint, greedy: the same answers
    assert all(t.startswith("synth-doc-7-") for t in
               (json.loads(x)["id"] for x in (out / "c7" / "heldout.jsonl").read_text().splitlines()))
    assert "GRPO - SFT" in done.stdout

    # tool ablations of the trained policy on the run's own held-out tasks (scripts/ablate_policy.py)
    ablate = [sys.executable, str(REPO / "scripts" / "ablate_policy.py"), str(out), "--variants",
              "full,no_update,capacity", "--capacity", "1"]
    done = subprocess.run(ablate, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((out / "ablations" / "ablations.json").read_text())["variants"]
    assert set(rows) == {"full", "no_update", "capacity"} and rows["full"]["em_minus_full"] is None
    assert "update" in rows["no_update"]["policy_env"]["disable"] and rows["no_update"]["ops_per_task"]["update"] == 0
    assert rows["capacity"]["policy_env"]["capacity"] == 1 and rows["capacity"]["memory_size"] <= 1
    assert rows["capacity"]["em_minus_full"]["n"] == 2
    assert "| capacity |" in done.stdout and (out / "ablations" / "table.md").exists()
    # ... and on the fresh tasks of the confirmation above, the first one only, in its own folder
    done = subprocess.run(ablate[:3] + ["--variants", "full,no_delete", "--tasks", str(out / "c7" / "heldout.jsonl"),
                                        "--limit", "1", "--out", str(out / "abl7")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    fresh = json.loads((out / "abl7" / "ablations.json").read_text())
    assert fresh["limit"] == 1 and fresh["tasks"].endswith("c7/heldout.jsonl") and set(fresh["variants"]) == {"full", "no_delete"}
    assert fresh["variants"]["no_delete"]["em_minus_full"]["n"] == 1
    assert json.loads((out / "ablations" / "ablations.json").read_text())["variants"] == rows  # the first kept

    # a second run skips every phase and reports the same results
    cfg = dict(out=str(out), tiny=True, locomo=str(LOCOMO), heldout_tasks=2, methods="oracle,heuristic,rag")
    q = Quickstart(QuickstartConfig(**cfg))
    q.run()
    assert q.phases.ran == dict.fromkeys(PHASES, False)
    assert {p: q.phases.markers[p]["stamp"] for p in PHASES} == {p: markers[p]["stamp"] for p in PHASES}
    assert "skipped (done)" in (out / "report.md").read_text()

    # GRPO interrupted after checkpoint-1 (no marker, no final model, no checkpoint-2): it resumes from
    # checkpoint-1 and finishes step 2; what comes before is kept
    (out / "phases" / "grpo.json").unlink()
    shutil.rmtree(out / "grpo" / "checkpoint-2")
    for f in (out / "grpo").glob("*.safetensors"):
        f.unlink()
    q = Quickstart(QuickstartConfig(**cfg, skip=["retrieval", "eval"]))  # eval left out: its rerun costs time
    q.run()
    assert q.phases.ran == {"model": False, "data": False, "sft": False, "grpo": True}
    grpo = q.phases.markers["grpo"]["result"]
    assert grpo["resumed_from"] == "last" and grpo["global_step"] == 2
    assert (out / "grpo" / "checkpoint-2").exists()

    # a GRPO setting that does not change the tasks reruns GRPO only (the data and SFT are kept)
    q = Quickstart(QuickstartConfig(**cfg, grpo_set=["learning_rate=0.002"], skip=["retrieval", "eval"]))
    q.run()
    assert q.phases.ran == {"model": False, "data": False, "sft": False, "grpo": True}

    # made longer under the recipe's constant learning rate: GRPO continues from checkpoint-2 instead of
    # starting over (the first 2 steps of a 3-step run are those of the 2-step run)
    def grpo_run(*extra):
        q = Quickstart(QuickstartConfig(**cfg, grpo_set=["learning_rate=0.002", *extra], skip=["retrieval", "eval"]))
        q.run()
        assert q.phases.ran == {"model": False, "data": False, "sft": False, "grpo": True}
        return json.loads((out / "grpo" / "grpo_summary.json").read_text())

    longer = grpo_run("max_steps=3")
    assert longer["global_step"] == 3 and longer["resume_checkpoint"] == str(out / "grpo" / "checkpoint-2")
    # made shorter: the checkpoints past the new length are dropped (save_total_limit 2 left 2 and 3), so
    # it starts over rather than resume from a step it should not have reached
    shorter = grpo_run("max_steps=1")
    assert shorter["global_step"] == 1 and shorter["resume_checkpoint"] is None
    assert sorted(p.name for p in (out / "grpo").glob("checkpoint-*")) == ["checkpoint-1"]
    # the SFT recipe's schedule is cosine, which depends on the run's length: a longer SFT starts over,
    # and so does the GRPO that follows it (its folder was written from another SFT checkpoint)
    q = Quickstart(QuickstartConfig(**cfg, sft_set=["max_steps=3"], skip=["retrieval", "eval"]))
    q.run()
    assert q.phases.ran == {"model": False, "data": False, "sft": True, "grpo": True}
    for stage in ("sft", "grpo"):
        summary = json.loads((out / stage / f"{stage}_summary.json").read_text())
        assert summary["resume_checkpoint"] is None, stage
    assert summary["global_step"] == 2
