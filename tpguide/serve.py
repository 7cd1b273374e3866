"""``python -m tpguide.serve`` and ``torchrun --nproc-per-node N -m tpguide.serve``: the OpenAI-compatible
server (:mod:`tpguide.cli.serve`, the flags of ``launch/serve.py``) from an installed package."""

if __name__ == "__main__":
    import sys

    from tpguide.cli.serve import run

    sys.exit(run())
