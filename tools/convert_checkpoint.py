#!/usr/bin/env python
"""Hugging Face <-> megatron dist checkpoints (same as ``bebop convert``).

    python tools/convert_checkpoint.py hf-to-megatron --input /models/qwen3 --output ckpt --tp 2
    python tools/convert_checkpoint.py megatron-to-hf --input outputs/run/mtp --output hf_export
"""

import sys

from bebop_megatron.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
