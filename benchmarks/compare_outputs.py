"""Compare generate.py output files request by request: token ids and logprobs identical or not.

The identity checks of docs/exactness.md's table (alone against in its
file, tp 1 against tp 2, speculation against plain, server against
``generate.py``) come down to: the same request id, the same ``token_ids``,
and the same ``logprobs`` (when the requests asked for them, ``"logprobs": 0``
or more).  Each file after the first is compared with the first.

Usage::

    python benchmarks/compare_outputs.py REFERENCE.jsonl OTHER.jsonl [OTHER.jsonl ...]

Prints, per other file, ``identical token ids a/n, identical logprobs b/m`` and
the first differing ids; exits 1 if any request differs or is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Tuple


def read_outputs(path: str) -> Dict[str, dict]:
    """``{request id: output line}`` of a generate.py output file (JSON lines).

    Raises ``ValueError`` naming the file and line for a line that is not JSON or has no ``id``.
    """
    out: Dict[str, dict] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                out[str(record["id"])] = record
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{number}: not an output line with an 'id' ({e})") from e
    return out


def compare(reference: Dict[str, dict], other: Dict[str, dict]) -> Tuple[int, int, int, List[str]]:
    """``(same token ids, same logprobs, requests with logprobs, differing or missing ids)``."""
    same_ids = same_lp = with_lp = 0
    differing: List[str] = []
    for rid, ref in reference.items():
        got = other.get(rid)
        if got is None:
            differing.append(f"{rid} (missing)")
            continue
        ids_equal = got.get("token_ids") == ref.get("token_ids")
        same_ids += ids_equal
        lp_equal = True
        if ref.get("logprobs") is not None or got.get("logprobs") is not None:
            with_lp += 1
            lp_equal = got.get("logprobs") == ref.get("logprobs")
            same_lp += lp_equal
        if not (ids_equal and lp_equal):
            differing.append(rid if ids_equal else f"{rid} (token ids)")
    return same_ids, same_lp, with_lp, differing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference")
    parser.add_argument("others", nargs="+")
    args = parser.parse_args(argv)
    reference = read_outputs(args.reference)
    failed = False
    for path in args.others:
        same_ids, same_lp, with_lp, differing = compare(reference, read_outputs(path))
        n = len(reference)
        print(f"{path}: identical token ids {same_ids}/{n}, identical logprobs {same_lp}/{with_lp}"
              + (f"; differ: {', '.join(differing[:8])}" + (" ..." if len(differing) > 8 else "") if differing else ""))
        failed |= bool(differing)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
