"""``atommem sft --config RECIPE [--key value ...]``: supervised fine-tuning on step-wise demonstrations
(atommem_rl.training.sft)."""

from .stage import stage_command

register = stage_command("sft", "supervised fine-tuning on step-wise demonstrations", "atommem_rl.training.sft",
                         "SFTRecipeConfig")
