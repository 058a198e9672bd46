"""Merge a LoRA adapter (an SFT/GRPO output folder or one of its checkpoint-N) into a full HF checkpoint.

The output holds the merged weights, the tokenizer and its chat template, and the environment the
adapter was trained in (atommem_env.json, atommem_rl/training/checkpoint_env.py): `vllm serve OUT` and
`atommem eval --model OUT` load it like any other model folder, and eval runs it in that environment.

Launch: .venv/bin/python scripts/merge_lora.py ADAPTER_DIR OUT_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atommem_rl.models import CheckpointError, merge_lora  # noqa: E402
from atommem_rl.training.checkpoint_env import copy_env  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("adapter", help="folder with adapter_config.json")
    p.add_argument("out", help="output folder for the merged model")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="dtype to load and save in (default: the adapter's base model dtype)")
    args = p.parse_args(argv)
    try:
        out = merge_lora(args.adapter, args.out, dtype=args.dtype)
        copy_env(args.adapter, out)  # the merged policy runs in the environment the adapter learned
        print(out)
    except CheckpointError as exc:
        print(f"merge_lora: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
