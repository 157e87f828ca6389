"""Checkpoint conversion between Hugging Face and megatron-core layouts."""
