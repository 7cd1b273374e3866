"""``python -m tpguide.generate`` and ``torchrun --nproc-per-node N -m tpguide.generate``: the offline job
(:mod:`tpguide.cli.generate`, the flags of ``launch/generate.py``) from an installed package."""

if __name__ == "__main__":
    from tpguide.cli.generate import exit_now, run

    exit_now(run())
