"""Checkpoint checks that run before any work starts, and the choice of the checkpoint to resume from.

A training stage reads two kinds of folders: a *model* folder (``model_name_or_path``, PPO's
``value_model``: a Hugging Face model or LoRA adapter) and a *trainer* checkpoint
(``<output_dir>/checkpoint-N``, what ``resume_from_checkpoint`` names). Loading a damaged one fails
late (after demonstrations were generated or a model was built) and with an error that rarely names
the file, so every file is checked first, cheaply, without reading the tensors:

* ``*.json`` (config, trainer_state, adapter_config, safetensors index): must parse; trainer_state
  must carry ``global_step``;
* ``*.safetensors``: the 8-byte header length and the JSON header must parse, and the file must be
  exactly as long as the header says (a truncated copy or a file cut by a kill is shorter);
* ``*.pt`` / ``*.pth`` / ``*.bin`` (optimizer, scheduler, RNG state, training args, PPO's critic
  optimizer): ``torch.save`` writes a zip archive whose directory sits at the end of the file, so a
  truncated file has no readable directory.

Resume. ``resume_from_checkpoint: true`` picks the newest checkpoint-N that passes these checks; a
newer one that does not (a run killed while it was being written) is skipped with a warning that names
it. A checkpoint named explicitly must pass, or the stage stops with a :class:`CheckpointError`
naming the file.
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
import zipfile
from pathlib import Path

from ..models import CheckpointError, check_checkpoint

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "adapter_model.bin")


def _check_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"corrupt checkpoint file {path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"corrupt checkpoint file {path}: expected a JSON object")
    return data


def _check_safetensors(path: Path) -> None:
    """Header parses and the file is exactly as long as the header's largest data offset says."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"header of {n} bytes in a {size}-byte file")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
        raise CheckpointError(f"corrupt checkpoint file {path}: unreadable safetensors header ({exc})") from None
    if 8 + n + end != size:
        raise CheckpointError(f"corrupt checkpoint file {path}: {size} bytes, the header says {8 + n + end} "
                              "(truncated or partly written)")


def _check_torch_zip(path: Path) -> None:
    try:
        with zipfile.ZipFile(path) as z:
            z.namelist()
    except (zipfile.BadZipFile, OSError) as exc:
        raise CheckpointError(f"corrupt checkpoint file {path}: not a complete torch.save archive ({exc})") from None


def check_files(folder: Path) -> None:
    """Check every file of ``folder`` (not subfolders) whose kind is known (see the module docstring)."""
    for f in sorted(folder.iterdir()):
        if not f.is_file():
            continue
        if f.suffix == ".json":
            _check_json(f)
        elif f.suffix == ".safetensors":
            _check_safetensors(f)
        elif f.suffix in (".pt", ".pth", ".bin"):
            _check_torch_zip(f)


def _sharded_engine_state(p: Path) -> bool:
    """DeepSpeed (``global_stepN/``, ``latest``) or FSDP (``pytorch_model_fsdp_*``) saved the weights
    in their own sharded layout, which Trainer loads through the engine."""
    return (p / "latest").is_file() or any(d.is_dir() and (d.name.startswith("global_step") or "fsdp" in d.name)
                                           for d in p.iterdir())


def check_model(path: str | os.PathLike) -> Path:
    """A model or LoRA adapter folder that will load: config, weights present and intact."""
    p = check_checkpoint(path)
    check_files(p)
    if not any((p / w).exists() for w in WEIGHT_FILES) and not _sharded_engine_state(p):
        raise CheckpointError(f"model checkpoint {p} has no weights (none of {', '.join(WEIGHT_FILES)})")
    index = p / "model.safetensors.index.json"
    if index.exists():
        for shard in sorted(set(_check_json(index).get("weight_map", {}).values())):
            if not (p / shard).exists():
                raise CheckpointError(f"model checkpoint {p}: shard {shard} listed in {index.name} is missing")
    return p


def check_model_or_default(path: str | os.PathLike | None) -> Path | None:
    """:func:`check_model` for a model named on the command line; for none (``path`` None: the default,
    ``models.BASE_MODEL_DIR``) the same check once that folder holds a ``config.json``, since it is then
    loaded as it is (a truncated weights file there failed late, after other work). A default folder
    without one is no error: the first use converts it from the packaged GGUF. Returns the folder
    checked, or None."""
    from .. import models

    if path is not None:
        return check_model(path)
    default = models.BASE_MODEL_DIR
    if not (default / "config.json").exists():
        return None
    try:
        return check_model(default)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc} (the default base model, used without --model; convert it again: "
                              f".venv/bin/python scripts/prepare_base_model.py --force --out {default})") from None


def check_trainer_checkpoint(path: str | os.PathLike, parts: tuple[str, ...] = ()) -> Path:
    """A ``checkpoint-N`` folder Trainer can resume from: the model plus an intact trainer state, and
    the sub-folders ``parts`` (PPO: ``critic``) present and intact."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"checkpoint to resume from not found: {p}")
    check_model(p)
    state = p / "trainer_state.json"
    if not state.exists():
        raise CheckpointError(f"not a trainer checkpoint (no trainer_state.json): {p}")
    if not isinstance(_check_json(state).get("global_step"), int):
        raise CheckpointError(f"corrupt checkpoint file {state}: no integer global_step")
    for sub in parts:
        if not (p / sub).is_dir():
            raise CheckpointError(f"checkpoint {p} has no {sub}/ folder (written before trainer_state.json "
                                  "by this stage; a checkpoint from another stage?)")
        check_model(p / sub)
    return p


def checkpoints_in(output_dir: str | os.PathLike) -> list[Path]:
    """``checkpoint-N`` folders of a run, newest (largest N) first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), d) for d in out.iterdir() if d.is_dir() and (m := CHECKPOINT_RE.match(d.name))]
    return [d for _, d in sorted(found, reverse=True)]


def resolve_resume(value, output_dir: str | os.PathLike, parts: tuple[str, ...] = ()) -> str | None:
    """What ``resume_from_checkpoint`` means, checked: None (start fresh) or a checkpoint path.

    ``true``/``auto``/``last``: the newest intact checkpoint-N in ``output_dir`` (None when there is
    none: a rerun of the same command then simply starts); a path: that checkpoint, which must be intact.
    """
    if value is None or str(value).lower() in ("", "false", "no", "none"):
        return None
    if str(value).lower() in ("true", "auto", "last", "yes"):
        for ckpt in checkpoints_in(output_dir):
            try:
                return str(check_trainer_checkpoint(ckpt, parts))
            except CheckpointError as exc:
                print(f"atommem: warning: skipping incomplete checkpoint {ckpt}: {exc}", file=sys.stderr)
        return None
    return str(check_trainer_checkpoint(value, parts))


def agree_on_resume(resume: str | None, parts: tuple[str, ...] = ()) -> str | None:
    """The checkpoint every process resumes from: the main process's choice, broadcast once the process
    group exists. ``resolve_resume`` runs on each rank before there is a group; on a shared filesystem with a
    checkpoint being written (or one another job is deleting), ranks could pick different ones and train
    different models from then on. A rank that cannot see the chosen checkpoint intact stops with the path."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    state = PartialState()
    if state.num_processes < 2:
        return resume
    choice = [resume]
    broadcast_object_list(choice, from_process=0)
    chosen = choice[0]
    if chosen != resume:
        print(f"atommem: rank {state.process_index} resumes from the main process's choice {chosen} "
              f"(it had found {resume})", file=sys.stderr)
        if chosen is not None:
            try:
                check_trainer_checkpoint(chosen, parts)
            except CheckpointError as exc:
                raise CheckpointError(f"rank {state.process_index} cannot read the checkpoint the main process "
                                      f"resumes from ({exc}); every node must see the same output_dir") from None
    return chosen

