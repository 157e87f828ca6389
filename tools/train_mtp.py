#!/usr/bin/env python
"""Train MTP heads with a chosen objective (same as ``bebop train-mtp``)."""

import sys

from bebop_megatron.cli import main

if __name__ == "__main__":
    sys.exit(main(["train-mtp", *sys.argv[1:]]))
