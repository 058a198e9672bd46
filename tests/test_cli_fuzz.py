"""CLI fuzz (issue 22): every subcommand against generated malformed input.

Inputs: task files with wrong types, missing and duplicate fields; folders where files are expected and
files where folders are; -1, 0, NaN and huge values for every numeric flag and recipe field; names
that escape their folder. For each run: either exit status 2 with a one-line error naming the input,
or correct behaviour (status 0 or 1 with its output); never a traceback; nothing written or removed
outside the run's output folder; done within a time bound.

Commands whose valid runs train or load a model (quickstart, sft, grpo, ppo, bench rollout|extractor|
gpu-check|retrieval) get only inputs that must be refused before work starts; their recipe fields are
checked through the same validation the stage runs first (``load_recipe``). ``test_cli_fuzz_sample``
runs a seeded sample of every group in the default test run; ``test_cli_fuzz_full`` runs them all.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from atommem_rl.cli import build_parser
from atommem_rl.tasks.schema import save_tasks
from atommem_rl.tasks.synth import generate_task, generate_tasks

from .cli_helpers import changed_outside, error_line, run_cli, tree
from .conftest import REPO

NUMBERS = ("-1", "0", "nan", "1e308", "99999999999999999999")
TIME_BOUND = 60.0  # seconds per run; every valid run here is a tiny task with the oracle
ENV = ["--tokenizer", "words"]


@dataclasses.dataclass
class Case:
    name: str
    argv: list[str]
    names: tuple[str, ...]  # the error line must mention one of these
    must_fail: bool = False


# ------------------------------------------------------------------------------------------ task files
# optional fields whose value is free text (null in the generated task): any string is a valid value
# (dates too: LoCoMo's are "1:56 pm on 8 May, 2023", shown to the policy as written)
FREE_TEXT = ("speaker", "date", "title", "fact")
def _mutations() -> list[tuple[str, dict | str, bool]]:
    """(name, task dict or raw line, must fail) from one good task: every field of the schema deleted
    and given each wrong JSON type, plus duplicate ids and lines that are not task objects."""
    good = generate_task(0, 0, docs=2, questions=2, confounders=0).to_dict()
    required = {"": ["id", "blocks", "questions"], "blocks.0": ["id", "units"], "blocks.0.units.0": ["id", "text"],
                "questions.0": ["id", "question", "answers"], }
    optional = {"": ["kind", "source", "relations", "meta"], "blocks.0": ["title", "date"],
                "blocks.0.units.0": ["role", "speaker", "fact"], "questions.0": ["evidence", "date"]}
    wrong = {"int": 7, "null": None, "string": "Oslo", "list": [], "object": {}, "bool": True, "float": 1.5}
    out = []

    def at(d, path):
        for k in filter(None, path.split(".")):
            d = d[int(k)] if isinstance(d, list) else d[k]
        return d

    for where, keys in list(required.items()) + list(optional.items()):
        for key in keys:
            must = key in required.get(where, [])
            d = json.loads(json.dumps(good))
            at(d, where).pop(key, None)
            out.append((f"missing {where}.{key}", d, must))
            for tname, v in wrong.items():
                d = json.loads(json.dumps(good))
                current = at(d, where).get(key)
                if type(current) is type(v) or (key == "id" and where in ("", "blocks.0") and tname == "int") \
                        or (key in FREE_TEXT and tname == "string"):
                    continue  # the right type, an id the schema accepts as an int, or text where text goes
                at(d, where)[key] = v
                out.append((f"{where}.{key} {tname}", d, must or v is not None))  # null: optional fields take it
    d = json.loads(json.dumps(good))
    d["questions"][1]["id"] = d["questions"][0]["id"]
    out.append(("duplicate question id", d, True))
    d = json.loads(json.dumps(good))
    d["blocks"][1]["units"][0]["id"] = d["blocks"][0]["units"][0]["id"]
    out.append(("duplicate unit id", d, True))
    d = json.loads(json.dumps(good))
    d["questions"][0]["answers"] = ["Oslo", 3]
    out.append(("answers with a number", d, True))
    for name, raw in (("not json", "{not json"), ("a list", "[1, 2]"), ("a string", '"task"'), ("null", "null")):
        out.append((name, raw, True))
    return out


def task_file_cases(tmp: Path) -> list[Case]:
    cases = []
    good = json.dumps(generate_task(1, 0, docs=2, questions=1, confounders=0).to_dict())
    for i, (name, task, must) in enumerate(_mutations()):
        path = tmp / "in" / f"task{i}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(good + "\n" + (task if isinstance(task, str) else json.dumps(task)) + "\n")
        names = (str(path),)
        cases.append(Case(f"rollout task: {name}", ["rollout", "--tasks", str(path), "--policy", "oracle", "--out",
                                                    "OUT/r.jsonl", *ENV], names, must))
        cases.append(Case(f"eval task: {name}", ["eval", "--tasks", str(path), "--methods", "oracle,heuristic",
                                                 "--out", "OUT/e"], names, must))
    undecodable = tmp / "in" / "latin1.jsonl"
    undecodable.write_bytes(good.encode() + b"\n\xff\xfe{}\n")
    cases.append(Case("rollout task: not UTF-8", ["rollout", "--tasks", str(undecodable), "--policy", "oracle",
                                                  "--out", "OUT/r.jsonl", *ENV], (str(undecodable),), True))
    empty = tmp / "in" / "empty.jsonl"
    empty.write_text("\n")
    cases.append(Case("rollout task: empty", ["rollout", "--tasks", str(empty), "--policy", "oracle",
                                              "--out", "OUT/r.jsonl", *ENV], (str(empty),), True))
    return cases


# ------------------------------------------------------------------------------ folders and files swapped
def path_cases(tmp: Path, tasks: Path) -> list[Case]:
    folder, file = tmp / "in" / "a-folder", tmp / "in" / "a-file.jsonl"
    folder.mkdir(parents=True, exist_ok=True)
    file.write_text("not a model, not a recipe\n")
    F, D = str(file), str(folder)
    rollout = ["rollout", "--tasks", str(tasks), "--policy", "oracle", "--out", "OUT/r.jsonl", *ENV]
    ev = ["eval", "--tasks", str(tasks), "--methods", "oracle", "--out", "OUT/e"]
    qs = ["quickstart", "--tiny", "--out", "OUT/q", "--skip", "retrieval,eval"]
    table = [
        (["rollout", "--tasks", D, "--policy", "oracle", "--out", "OUT/r.jsonl", *ENV], D, True),
        (rollout[:5] + ["--out", D] + ENV, D, True),
        (rollout + ["--out", F + "/r.jsonl"], F, True),
        (["rollout", "--tasks", str(tasks), "--policy", "model", "--model", F, "--out", "OUT/r.jsonl", *ENV], F, True),
        (["rollout", "--tasks", str(tasks), "--policy", "model", "--model", D, "--out", "OUT/r.jsonl", *ENV], D, True),
        (rollout + ["--tokenizer", F], F, True),
        (rollout + ["--tokenizer", D], D, True),
        (["eval", "--tasks", D, "--methods", "oracle", "--out", "OUT/e"], D, True),
        (ev[:5] + ["--out", F], F, True),
        (ev + ["--model", F, "--methods", "rag"], F, True),
        (ev + ["--checkpoint", D], D, True),
        (ev + ["--checkpoint", F], F, True),
        (ev + ["--extractor-model", D], D, True),
        (["data", "synth", "--out", D, "--tasks", "1", "--docs", "2"], D, True),
        (["data", "synth", "--out", F + "/x.jsonl", "--tasks", "1", "--docs", "2"], F, True),
        (["data", "prepare", "--source", "hotpotqa", "--path", D, "--out", "OUT/p.jsonl"], D, True),
        (["data", "prepare", "--source", "hotpotqa", "--path", F, "--out", D], D, True),
        (["data", "prepare", "--source", "locomo", "--path", str(tmp / "in" / "missing.json"), "--out", "OUT/p.jsonl"],
         "missing.json", True),
        (["quickstart", "--tiny", "--out", F], F, True),
        (qs + ["--sft-recipe", D], D, True),
        (qs + ["--grpo-recipe", F], F, True),
        (["sft", "--config", D], D, True),
        (["grpo", "--config", F], F, True),
        (["ppo", "--config", str(tmp / "in" / "missing.yaml")], "missing.yaml", True),
        (["bench", "retrieval", "--path", D, "--embedder", "hashing"], D, True),
    ]
    return [Case(f"path: {' '.join(a[:2])} {n}", a, (n,), m) for a, n, m in table]


# --------------------------------------------------------------------------------------- numeric flags
FLOAT_TYPES = ("nonneg_float", "unit_float", "positive_float", "fraction")


def _numeric_flags(parser) -> list[str]:
    flags = []
    for a in parser._actions:
        if not a.option_strings or a.nargs == 0 or a.choices is not None:
            continue
        t = getattr(a.type, "__name__", "")
        if a.type in (int, float) or t in ("positive_int", "nonneg_int", "seed_int", "parse") + FLOAT_TYPES \
                or isinstance(a.default, (int, float)) and not isinstance(a.default, bool):
            flags.append(a.option_strings[-1])
    return flags


def _subparser(*path: str):
    p = build_parser()
    for name in path:
        p = next(a for a in p._actions if a.dest in ("command", "data_command", "benchmark")).choices[name]
    return p


def number_cases(tasks: Path) -> list[Case]:
    bases = {
        ("rollout",): ["rollout", "--tasks", str(tasks), "--policy", "oracle", "--out", "OUT/r.jsonl", "--limit", "1",
                       *ENV, "--chunk-tokens", "96", "--max-prompt-tokens", "2400"],
        ("eval",): ["eval", "--tasks", str(tasks), "--methods", "oracle,heuristic", "--out", "OUT/e", "--limit", "1",
                    "--chunk-tokens", "96", "--max-prompt-tokens", "2400"],
        ("data", "synth"): ["data", "synth", "--out", "OUT/s.jsonl", "--tasks", "1", "--docs", "2"],
        # small valid runs: a value that passes measures a few steps (they print to stdout, write nothing)
        ("bench", "env"): ["bench", "env", "--tokenizer", "words", "--atoms", "50", "--steps", "5", "--warmup", "1",
                           "--json"],
        ("bench", "memory"): ["bench", "memory", "--sizes", "40", "--rwr-sizes", "40", "--repeats", "3", "--json"],
    }
    # valid runs of these train, load models or read benchmark data: only values that must be refused
    refuse_only = {("quickstart",): ["quickstart", "--tiny", "--out", "OUT/q", "--skip", "retrieval,eval"],
                   ("data", "prepare"): ["data", "prepare", "--source", "hotpotqa", "--path", str(tasks),
                                         "--out", "OUT/p.jsonl"]}
    cases = []
    for path, base in list(bases.items()) + list(refuse_only.items()):
        for flag in _numeric_flags(_subparser(*path)):
            for v in NUMBERS:
                if path in refuse_only and v == "0" and flag in ("--heldout-seed", "--seed"):
                    continue  # a valid seed: it would run the pipeline
                # data prepare's input is no benchmark file: a value that passes reaches the file's error
                names = (flag, flag.lstrip("-").replace("-", "_")) + ((str(tasks),) if path == ("data", "prepare") else ())
                cases.append(Case(f"number: {' '.join(path)} {flag} {v}", base + [flag, v], names,
                                  must_fail=path == ("quickstart",)))
    # these load a model or read benchmark data: only values argparse must refuse (NaN, negative, and for
    # counts a number beyond the flag's limit; a float as large as 1e20 is a valid temperature)
    for bench in ("rollout", "extractor", "retrieval", "update"):
        parser = _subparser("bench", bench)
        floats = {a.option_strings[-1] for a in parser._actions if getattr(a.type, "__name__", "") in FLOAT_TYPES}
        for flag in _numeric_flags(parser):
            for v in ("nan", "-1") if flag in floats else ("nan", "-1", "99999999999999999999"):
                argv = ["bench", bench, flag, v] + (["--path", "x"] if bench == "retrieval" else [])
                cases.append(Case(f"number: bench {bench} {flag} {v}", argv, (flag,), True))
    return cases


# --------------------------------------------------------------------------------- recipes and stages
RECIPES = {"sft": REPO / "recipes" / "quickstart" / "sft.yaml", "grpo": REPO / "recipes" / "quickstart" / "grpo.yaml",
           "ppo": REPO / "recipes" / "quickstart" / "ppo.yaml"}


def stage_cases() -> list[Case]:
    """Through the CLI: recipe values that must stop a stage before it loads anything."""
    cases = []
    for stage, recipe in RECIPES.items():
        base = [stage, "--config", str(recipe), "--output_dir", "OUT/" + stage]
        for key, v in (("max_steps", "-3"), ("max_steps", "0"), ("learning_rate", "nan"), ("learning_rate", "-1"),
                       ("per_device_train_batch_size", "0"), ("run_name", "../../escaped"), ("run_name", "/tmp/x"),
                       ("synth_tasks", "0"), ("save_steps", "-1"), ("seed", "-1"), ("num_train_epochs", "0"),
                       ("learning_rat", "1e-5"), ("env_config", '{"chunk_tokns": 64}'),
                       ("env_config", '{"max_steps": -1}'), ("env_config", '{"evidence_bonus": NaN}'),
                       ("env_config", '{"chunk_tokens": "big"}')):
            named = "chunk_tokns" if "chunk_tokns" in v else key
            cases.append(Case(f"stage: {stage} --{key} {v}", base + [f"--{key}", v], (named,), True))
    return cases


def recipe_field_cases() -> list[tuple[str, str, str]]:
    """(stage, field, value) for every numeric field of every stage config and every value in NUMBERS."""
    from atommem_rl.training.recipes import config_class

    out = []
    for stage, recipe in RECIPES.items():
        cls = config_class(recipe)
        for f in dataclasses.fields(cls):
            if f.init and isinstance(f.default, (int, float)) and not isinstance(f.default, bool):
                out += [(stage, f.name, v) for v in NUMBERS]
    return out


# ------------------------------------------------------------------------------------------- the checks
def check(case: Case, tmp: Path) -> None:
    out_dir = tmp / "OUT"
    before = tree(tmp)
    argv = [a.replace("OUT/", str(out_dir) + "/") for a in case.argv]
    res = run_cli(argv, timeout=TIME_BOUND)
    where = f"{case.name}: rc={res.rc} stderr={res.stderr[-600:]!r}"
    assert res.rc is not None, f"{case.name}: still running after {TIME_BOUND} s"
    assert res.exception is None, f"{where}: traceback {type(res.exception).__name__}: {res.exception}"
    assert "Traceback" not in res.stderr, where
    if res.rc == 2:
        line = error_line(res)
        assert "error:" in line and any(n in line for n in case.names), where
    else:
        assert not case.must_fail, f"{where}: should have been refused"
        assert res.rc in (0, 1), where
    assert changed_outside(before, tree(tmp), ("OUT",)) == [], f"{case.name}: wrote or removed outside OUT"
    if out_dir.exists() and res.rc == 2:
        import shutil

        shutil.rmtree(out_dir)  # an error run may have made its folder; the next case starts clean


def all_cases(tmp: Path) -> list[Case]:
    tasks = tmp / "in" / "tasks.jsonl"
    tasks.parent.mkdir(parents=True, exist_ok=True)
    save_tasks(generate_tasks(2, seed=0, docs=2, questions=1, confounders=0), tasks)
    return task_file_cases(tmp) + path_cases(tmp, tasks) + number_cases(tasks) + stage_cases()


def _run(cases: list[Case], tmp: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp)  # a relative path a command writes lands here, where the tree check sees it
    failures = []
    for case in cases:
        try:
            check(case, tmp)
        except AssertionError as exc:
            failures.append(str(exc).splitlines()[0])
        finally:
            import shutil

            shutil.rmtree(tmp / "OUT", ignore_errors=True)
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures[:40])


def _sample(cases: list[Case], per_group: int, seed: int = 0) -> list[Case]:
    groups: dict[str, list[Case]] = {}
    for c in cases:
        groups.setdefault(c.name.split(":")[0], []).append(c)
    rng = random.Random(seed)
    return [c for g in groups.values() for c in rng.sample(g, min(per_group, len(g)))]


def test_cli_fuzz_sample(tmp_path, monkeypatch):
    _run(_sample(all_cases(tmp_path), per_group=12), tmp_path, monkeypatch)


@pytest.mark.slow
def test_cli_fuzz_full(tmp_path, monkeypatch):
    """Every generated case the sample above leaves out (about 800 in all, ~12 minutes on 2 cores)."""
    cases = all_cases(tmp_path)
    sampled = {c.name for c in _sample(cases, per_group=12)}
    _run([c for c in cases if c.name not in sampled], tmp_path, monkeypatch)


@pytest.mark.parametrize("stage", sorted(RECIPES))
def test_every_numeric_recipe_field_is_checked_or_accepted(stage):
    """-1, 0, NaN and huge values for every numeric field of a stage's config: the validation a stage runs
    before any work either refuses the value naming the recipe and the key, or accepts it; NaN and
    infinity are always refused."""
    from atommem_rl.training.recipes import RecipeError, config_class, load_recipe

    cls = config_class(RECIPES[stage])
    for _, key, value in (c for c in recipe_field_cases() if c[0] == stage):
        try:
            load_recipe(cls, RECIPES[stage], [f"--{key}", value])
        except RecipeError as exc:
            assert key in str(exc) or "command line" in str(exc), (key, value, str(exc))
            assert "\n" not in str(exc).strip(), (key, value)
        else:
            assert value != "nan", (key, value)  # NaN is never a setting
