"""``atommem grpo --config RECIPE [--key value ...]``: step-wise GRPO (atommem_rl.training.grpo)."""

from .stage import stage_command

register = stage_command("grpo", "GRPO on step-wise memory episodes", "atommem_rl.training.grpo", "GRPORecipeConfig")
