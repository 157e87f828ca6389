"""Reinforcement learning with speculative rollouts: rewards, GRPO, entropy control, MTP strategies."""
