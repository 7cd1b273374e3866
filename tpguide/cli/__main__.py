"""``python -m tpguide.cli COMMAND ...``: the ``tpguide`` command without its console script (:mod:`tpguide.cli`)."""

import sys

from tpguide.cli import main

sys.exit(main())
