"""Every guided output of a ``launch/generate.py`` output file is valid: checked again here, outside the engine.

    python benchmarks/check_valid.py OUT.jsonl [--requests IN.jsonl]   (default requests: the built-in demo)

Per row: an error (``finish_reason`` ``"error"``, which is also how the
engine reports an output that failed its guide) fails; a guided row that
stopped is validated against its guide again
(:func:`tpguide.guided.schema_check.validate_output`); a row cut at
``max_tokens`` ("length") cannot be complete and is counted, not judged.
Prints one line per row and a summary; exits 1 on any invalid or failed row
or a request without an output line.  Used by ``launch/gpu_check.sh`` on the demo.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional

from tpguide.engine.request_io import parse_request_lines, read_requests
from tpguide.guided.schema_check import validate_output


def problems(outputs: Dict[str, dict], requests) -> List[str]:
    """``"id: why"`` for each request whose output is missing, failed or does not satisfy its guide."""
    found = []
    for req in requests:
        out = outputs.get(req.request_id)
        if out is None:
            found.append(f"{req.request_id}: no output line")
        elif out.get("finish_reason") == "error":
            found.append(f"{req.request_id}: error: {out.get('error')}")
        elif req.structured_output is not None and out.get("finish_reason") == "stop":
            why = validate_output(req.structured_output, out.get("text", ""))
            if why is not None:
                found.append(f"{req.request_id}: {why}")
    return found


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output")
    p.add_argument("--requests", help="the requests file of the run (default: the built-in demo)")
    args = p.parse_args(argv)
    if args.requests:
        requests = read_requests(args.requests, 64)
    else:
        from tpguide.engine.demo_requests import DEMO_REQUESTS

        requests = parse_request_lines([json.dumps(r) for r in DEMO_REQUESTS], 64)
    with open(args.output) as f:
        outputs = {o["id"]: o for o in map(json.loads, filter(str.strip, f))}
    for req in requests:
        out = outputs.get(req.request_id, {})
        guide = req.structured_output.guide_type if req.structured_output is not None else "none"
        print(f"  {req.request_id:<24} guide {guide:<12} finish {out.get('finish_reason')!s:<7} "
              f"{len(out.get('token_ids', []))} tokens")
    bad = problems(outputs, requests)
    guided = [r for r in requests if r.structured_output is not None]
    stopped = [r for r in guided if outputs.get(r.request_id, {}).get("finish_reason") == "stop"]
    print(f"valid: {len(guided)} guided rows, {len(stopped)} stopped and re-validated, "
          f"{len(bad)} problem(s)" + "".join(f"\n  {b}" for b in bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
