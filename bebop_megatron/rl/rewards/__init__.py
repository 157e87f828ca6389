"""Verifiable rewards: exact-answer math, sandboxed code tests, synthetic tasks."""

from bebop_megatron.rl.rewards.code import code_reward, extract_code  # noqa: F401
from bebop_megatron.rl.rewards.math import extract_answer, math_equal, math_reward  # noqa: F401
from bebop_megatron.rl.rewards.synthetic import (  # noqa: F401
    SyntheticTask, make_tasks, synthetic_partial_reward, synthetic_reward)

__all__ = ["code_reward", "extract_code", "extract_answer", "math_equal", "math_reward", "SyntheticTask", "make_tasks", "synthetic_partial_reward", "synthetic_reward"]
