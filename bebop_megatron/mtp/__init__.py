"""MTP objectives and their metrics."""

from bebop_megatron.mtp.losses import (  # noqa: F401
    MTPLossOutput,
    mtp_objective,
    vocab_parallel_alpha,
    vocab_parallel_forward_kl,
    vocab_parallel_softmax,
)

__all__ = ["MTPLossOutput", "mtp_objective", "vocab_parallel_alpha", "vocab_parallel_forward_kl", "vocab_parallel_softmax"]
