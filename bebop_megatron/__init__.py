"""bebop_megatron: MTP speculative rollouts for RL post-training of Qwen-style LLMs on Megatron-Core."""

__version__ = "0.1.0"
