"""``atommem ppo --config RECIPE [--key value ...]``: step-wise PPO with a critic (atommem_rl.training.ppo)."""

from .stage import stage_command

register = stage_command("ppo", "PPO (critic + GAE) on step-wise memory episodes", "atommem_rl.training.ppo",
                         "PPORecipeConfig")
