"""Replay an output file: run its requests again and prove the outputs bit for bit (docs/receipts.md).

    tpguide replay OUT.jsonl [--model DIR|FILE.gguf] [--tp N]     (or python launch/replay.py ...)
        [--batch input|reverse|shuffle|one] [--max-num-seqs N] [--max-num-batched-tokens N]
        [--force] [--report REPORT.json] [--quiet]

Each line of ``OUT.jsonl`` (written by ``launch/generate.py``) carries its
request and its receipt.  The requests run again on ``--tp`` gloo ranks
(spawned here; tp 1 runs in this process), in the batch composition of
``--batch`` (the file's order, reversed, shuffled, or one request at a time),
each with the seed its receipt recorded.  Per request it prints
``identical``, or the first differing position: the index, both token ids,
both logprobs and their float64 bits.

It refuses to run, naming both values, when the model's content fingerprint
or the exactness class differs from the receipts' (bits are promised only
within one model and one class, docs/exactness.md); ``--force`` runs anyway
and reports.  Exit status: 0 every request identical, 1 some differ, 2
refused or bad input.
"""

from __future__ import annotations

import argparse
import json
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output", help="an output file of launch/generate.py (JSON lines with request and receipt)")
    p.add_argument("--model", help="the model to replay on (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks for the replay (default 1)")
    p.add_argument("--batch", choices=["input", "reverse", "shuffle", "one"], default="input",
                   help="batch composition: the file's order, reversed, shuffled (seeded), or one at a time")
    p.add_argument("--max-num-seqs", type=int, default=16, help="requests running at once (default 16)")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="tokens per step (default 1024)")
    p.add_argument("--force", action="store_true",
                   help="replay even when the model fingerprint or the exactness class differs")
    p.add_argument("--report", help="also write the whole report as JSON here")
    p.add_argument("--quiet", action="store_true", help="print only the summary line")
    return p.parse_args(argv)


def read_lines(path: str) -> list:
    """The decoded non-blank lines of ``path``; ValueError naming the first line that is not JSON."""
    lines = []
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number} is not JSON: {exc}") from exc
    return lines


def describe(result: dict) -> str:
    """One line for one request of the report."""
    d = result["difference"]
    if d is None:
        return f"{result['id']}: identical"
    if d["index"] < 0:
        return (f"{result['id']}: same tokens, finish_reason {d['recorded_finish_reason']!r} recorded, "
                f"{d['replayed_finish_reason']!r} replayed")
    line = (f"{result['id']}: differs at position {d['index']}: recorded token {d['recorded_token']} "
            f"(logprob {d['recorded_logprob']}, bits {d['recorded_bits']}), replayed token {d['replayed_token']} "
            f"(logprob {d['replayed_logprob']}, bits {d['replayed_bits']})")
    if "recorded_top" in d:  # the sampled token agrees; a top-logprobs alternative does not
        line += f"; its top alternatives [id, bits] differ: recorded {d['recorded_top']}, replayed {d['replayed_top']}"
    return line


def main(argv=None) -> int:
    args = parse_args(argv)
    from tpguide.engine.replay import replay_lines
    from tpguide.model.model_source import resolve_model_dir

    try:
        lines = read_lines(args.output)
        model_dir = str(resolve_model_dir(args.model))
        report = replay_lines(lines, model_dir, args.tp, args.batch, args.force, max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    if report["refused"]:
        print("refused: " + "; ".join(report["refused"]) + " (--force replays anyway)", file=sys.stderr)
        return 2
    for mismatch in report["mismatches"]:
        print(f"warning (--force): {mismatch}", file=sys.stderr)
    results = report["results"]
    if not args.quiet:
        for result in results:
            print(describe(result))
            if result["receipt_differences"]:
                print(f"  receipt fields that differ: {', '.join(result['receipt_differences'])}")
        for rid, why in report["skipped"]:
            print(f"{rid}: skipped: {why}")
    same = sum(r["identical"] for r in results)
    print(f"{same} of {len(results)} requests identical at tp {args.tp}, batch {args.batch}"
          + (f"; {len(report['skipped'])} lines skipped" if report["skipped"] else ""))
    return 0 if same == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
