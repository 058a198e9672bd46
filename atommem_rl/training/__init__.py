"""Training: recipes (YAML + overrides -> config dataclasses), SFT, GRPO and PPO on TRL.

    atommem_rl.training.recipes          recipe loading and validation (TrlParser underneath)
    atommem_rl.training.demonstrations   step-wise demonstration rows (JSONL interchange, oracle/teacher rollouts)
    atommem_rl.training.sft              supervised fine-tuning on demonstrations (`atommem sft`)
    atommem_rl.training.grpo             step-wise GRPO (`atommem grpo`)
    atommem_rl.training.ppo              step-wise PPO (`atommem ppo`)
"""
