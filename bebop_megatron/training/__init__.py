"""Training loops on megatron-core."""
