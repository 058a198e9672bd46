"""Merge a LoRA adapter (an SFT/GRPO output folder or one of its checkpoint-N) into a full HF checkpoint.

The output holds the merged weights, the tokenizer and its chat template: `vllm serve OUT` and
`atommem eval --model OUT` load it like any other model folder.

Launch: .venv/bin/python scripts/merge_lora.py ADAPTER_DIR OUT_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atommem_rl.models import CheckpointError, merge_lora  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("adapter", help="folder with adapter_config.json")
    p.add_argument("out", help="output folder for the merged model")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="dtype to load and save in (default: the adapter's base model dtype)")
    args = p.parse_args(argv)
    try:
        print(merge_lora(args.adapter, args.out, dtype=args.dtype))
    except CheckpointError as exc:
        print(f"merge_lora: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
