"""Launched by tests/test_resume.py under ``accelerate launch`` (2 gloo ranks): each rank found a different
checkpoint to resume from (as ranks resolving ``resume_from_checkpoint: true`` on their own could, while a
checkpoint is being written on a shared filesystem); ``agree_on_resume`` must give every rank the main
process's choice. argv: OUT CHOICE_RANK0 CHOICE_RANK1 ("none" for None). Each rank appends a JSON line to OUT.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate import PartialState  # noqa: E402

from atommem_rl.training.checkpoints import agree_on_resume  # noqa: E402


def main(out: str, *choices: str) -> None:
    state = PartialState(cpu=True)
    mine = choices[state.process_index]
    try:
        result = {"chosen": agree_on_resume(None if mine == "none" else mine)}
    except Exception as exc:  # noqa: BLE001
        result = {"error": f"{type(exc).__name__}: {exc}"}
    with open(out, "a") as f:
        f.write(json.dumps({"rank": state.process_index, **result}) + "\n")
    # a rank leaving while the other still holds the gloo group aborts it at exit ("terminate called
    # without an active exception"): meet, then close the group on every rank
    state.wait_for_everyone()
    state.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
