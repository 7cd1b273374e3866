"""Count the files of tpguide/ in which functions run for one guided request (docs/architecture.md §1).

Runs ``launch/generate.py`` in this process (tp 1, the embedded model unless
``--model``) on ONE guided request with a profile hook on every thread
(``sys.setprofile`` for this one, ``threading.setprofile`` for the threads it
starts: the compile worker and the bitmask fill), startup included.  Counted: Python function calls (profile ``call`` events, not
``c_call``), not module bodies (code named ``<module>``), in files under
``tpguide/`` outside ``tpguide/model`` and ``tpguide/kernels``.  Prints the
files in first-call order and their number.

    python launch/count_traced_files.py [--model DIR]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading

REQUEST = {"id": "guided", "messages": [{"role": "user", "content": "Invent a person as JSON."}],
           "structured_output": {"json": {"type": "object", "properties": {"name": {"type": "string"}},
                                          "required": ["name"]}},
           "max_tokens": 16}


def main() -> int:
    import tpguide

    package = os.path.dirname(os.path.abspath(tpguide.__file__))
    skip = tuple(os.path.join(package, d) + os.sep for d in ("model", "kernels"))
    seen: dict = {}

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        path = code.co_filename
        if code.co_name != "<module>" and path.startswith(package + os.sep) and not path.startswith(skip):
            seen.setdefault(os.path.relpath(path, os.path.dirname(package)), None)

    import generate

    with tempfile.TemporaryDirectory() as tmp:
        requests = os.path.join(tmp, "in.jsonl")
        with open(requests, "w") as f:
            f.write(json.dumps(REQUEST) + "\n")
        argv = ["--requests", requests, "--output", os.path.join(tmp, "out.jsonl"), "--quiet", *sys.argv[1:]]
        threading.setprofile(profile)
        sys.setprofile(profile)
        try:
            rc = generate.main(argv)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
        with open(os.path.join(tmp, "out.jsonl")) as f:
            out = json.loads(f.readline())
    for path in seen:
        print(path)
    print(f"{len(seen)} files of tpguide/ (outside model/ and kernels/) ran functions for one guided request "
          f"(finish_reason {out['finish_reason']!r}, {len(out['token_ids'])} tokens); exit {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
