"""The ``tpguide`` command: ``tpguide generate|serve|replay ...`` (docs/usage.md, docs/serving.md, docs/receipts.md).

The flags are those of ``launch/generate.py`` and ``launch/serve.py``,
which are thin scripts over :mod:`tpguide.cli.generate` and
:mod:`tpguide.cli.serve`.  Without ``torchrun`` a command runs at tp 1; on
several ranks, start the module under torchrun::

    torchrun --nproc-per-node 4 -m tpguide.generate [flags]
    torchrun --nproc-per-node 2 -m tpguide.serve [flags]
"""

from __future__ import annotations

import sys
from typing import List, Optional

COMMANDS = ("generate", "serve", "replay")
USAGE = ("usage: tpguide {generate,serve,replay} [flags]   (tpguide COMMAND --help)\n"
         "  generate   guided generation on JSON-lines requests, or the built-in demo\n"
         "  serve      the OpenAI-compatible server\n"
         "  replay     rerun an output file's requests and prove them bit for bit (docs/receipts.md)")


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``tpguide COMMAND [flags]``; 2 with the usage on stderr for a missing or unknown command."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        print(USAGE if not argv or argv[0] in ("-h", "--help") else f"unknown command {argv[0]!r}\n{USAGE}",
              file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "generate":
        from tpguide.cli.generate import exit_now, run

        sys.argv[0] = "tpguide generate"
        exit_now(run(argv[1:]))  # leaves without interpreter teardown (see exit_now)
    if argv[0] == "replay":
        from tpguide.cli.replay import main as replay

        sys.argv[0] = "tpguide replay"
        return replay(argv[1:])
    from tpguide.cli.serve import run as run_serve

    sys.argv[0] = "tpguide serve"
    return run_serve(argv[1:])
