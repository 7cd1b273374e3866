"""Replay an output file and prove it bit for bit (a thin script over :mod:`tpguide.cli.replay`; docs/receipts.md).

    python launch/replay.py OUT.jsonl [--model DIR|FILE.gguf] [--tp N] [--batch input|reverse|shuffle|one] [--force]

The same without a checkout: ``tpguide replay OUT.jsonl ...``.  Flags: ``--help``.
"""

import sys

import tpguide  # noqa: F401  (before torch: its init sets libgomp's spin count)
from tpguide.cli.replay import main

if __name__ == "__main__":
    sys.exit(main())
