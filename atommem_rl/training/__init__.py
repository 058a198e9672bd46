"""Training: recipes (YAML + overrides -> config dataclasses), SFT, GRPO and PPO on TRL.

    atommem_rl.training.recipes   recipe loading and validation (TrlParser underneath)
    atommem_rl.training.sft       supervised fine-tuning on step-wise demonstrations (`atommem sft`)
"""
