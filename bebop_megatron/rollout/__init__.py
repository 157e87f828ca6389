"""Rollouts: speculative sampling, the embedded engine, its SGLang-compatible server, and the bridge."""
