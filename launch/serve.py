"""An OpenAI-compatible server on a tensor-parallel group (a thin script over :mod:`tpguide.cli.serve`).

    torchrun --nproc-per-node N launch/serve.py [--model DIR] [--host 127.0.0.1]
        [--port 8000] [--served-model-name NAME] [--api-key KEY] [engine flags]
    python launch/serve.py          # tp 1, the embedded model, loopback only

The same server without a checkout: ``tpguide serve`` and ``torchrun
--nproc-per-node N -m tpguide.serve``.  Flags: ``--help`` and docs/serving.md.
"""

import sys

import tpguide  # noqa: F401  (before torch: its init sets libgomp's spin count)
from tpguide.cli.serve import main, run  # noqa: F401  (main: for scripts that load this file)

if __name__ == "__main__":
    sys.exit(run())
