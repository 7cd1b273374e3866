"""tpguide's main job: guided generation on N tensor-parallel ranks (a thin script over :mod:`tpguide.cli.generate`).

    torchrun --nproc-per-node N launch/generate.py [--model DIR|FILE.gguf]
        [--requests IN.jsonl] [--output OUT.jsonl] [--max-new-tokens N]
    python launch/generate.py       # tp 1, the built-in demo on the embedded model

The same job without a checkout: ``tpguide generate`` and ``torchrun
--nproc-per-node N -m tpguide.generate``.  Flags: ``--help`` and docs/usage.md.
"""

import tpguide  # noqa: F401  (before torch: its init sets libgomp's spin count)
from tpguide.cli.generate import exit_now, main, run  # noqa: F401  (main, run: for scripts that load this file)

if __name__ == "__main__":
    exit_now(run())
