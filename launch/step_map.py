"""A map of one steady-state decode ``Engine.step()``: what a reader must follow (docs/architecture.md §1).

Builds a tp-1 engine in this process (the embedded model unless ``--model``),
adds one JSON-schema-guided request (greedy; grammar drafts on, the default),
steps it past its prefill and ``--warmup`` decode steps, then traces ONE
``Engine.step()`` on every thread (``sys.settrace`` here and
``threading.settrace`` for the threads started after the engine is built:
the bitmask fill's, started at the first guided step; the compile worker,
started with the engine, does intake, not step work, and is not traced).  Counted, for code under ``tpguide/``
(module bodies and comprehensions excluded):

* the files and functions entered, in first-call order;
* the code lines of those functions: non-blank, non-comment source lines,
  the docstring and nested functions' bodies excluded (a nested function counts
  on its own when it is entered);
* the cross-file calls (caller -> callee, both in ``tpguide/``, the caller the
  callee's own Python caller frame);
* the calls against the layers: a caller in a lower layer than its callee, in
  the order of :data:`LAYERS` (``tests/test_dependency_direction.py``);
* the calls through a callable handed in: the callee is a lambda or a nested
  function called from outside the function that made it, or it is called
  through a parameter or a ``self`` attribute of another name
  (``self._hook(...)`` running a method of another name).  Dunder
  methods are never counted.

    python launch/step_map.py [--model DIR] [--warmup N] [--json]
"""

from __future__ import annotations

import argparse
import ast
import json
import linecache
import os
import sys
import threading
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

#: The layered folders of tpguide, from low to high (as tests/test_dependency_direction.py).
LAYERS = ("kernels", "model", "sampling", "guided", "speculative", "worker", "engine")

COMPREHENSIONS = ("<listcomp>", "<setcomp>", "<dictcomp>", "<genexpr>")

REQUEST = {"id": "guided", "prompt": "Answer in JSON:",
           "structured_output": {"json": {"type": "object",
                                          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                                          "required": ["name", "age"]}},
           "max_tokens": 32, "temperature": 0.0}


@dataclass
class StepMap:
    """What one traced step entered; paths relative to the repository, functions as ``path:qualname``."""

    files: List[str] = field(default_factory=list)
    functions: Dict[str, int] = field(default_factory=dict)  # function -> its code lines
    cross_file_calls: Dict[str, int] = field(default_factory=dict)  # "caller -> callee" -> calls
    against_layers: Dict[str, int] = field(default_factory=dict)
    handed_in: Dict[str, int] = field(default_factory=dict)

    @property
    def code_lines(self) -> int:
        return sum(self.functions.values())


def layer_of(path: str) -> Optional[int]:
    """Index in :data:`LAYERS` of a ``tpguide/<folder>/...`` path, None outside the layered folders."""
    parts = path.split("/")
    return LAYERS.index(parts[1]) if len(parts) > 2 and parts[1] in LAYERS else None


def _function_nodes(path: str) -> Dict[int, ast.AST]:
    """A file's function and lambda nodes by first line (a code object's ``co_firstlineno``)."""
    tree = ast.parse("".join(linecache.getlines(path)))
    nodes: Dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            decorators = getattr(node, "decorator_list", [])
            nodes.setdefault(decorators[0].lineno if decorators else node.lineno, node)  # = co_firstlineno
    return nodes


def code_lines(path: str, node: ast.AST) -> int:
    """Non-blank, non-comment lines of ``node`` without its docstring and nested function bodies."""
    lines = set(range(node.lineno, node.end_lineno + 1))
    body = getattr(node, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
            isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        lines -= set(range(body[0].lineno, body[0].end_lineno + 1))
    for inner in ast.walk(node):
        if inner is not node and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            lines -= set(range(inner.lineno + 1, inner.end_lineno + 1))  # its def line stays: it runs here
    source = linecache.getlines(path)
    return sum(1 for n in lines if source[n - 1].strip() and not source[n - 1].strip().startswith("#"))


def call_site(frame) -> Optional[ast.expr]:
    """The callable's expression at ``frame``'s current instruction (``f`` of ``f(...)``, ``x.m`` of ``x.m(...)``)."""
    positions = list(frame.f_code.co_positions())
    index = frame.f_lasti // 2
    if not 0 <= index < len(positions) or None in positions[index]:
        return None
    line, end_line, col, end_col = positions[index]
    lines = linecache.getlines(frame.f_code.co_filename)[line - 1:end_line]
    if not lines:
        return None
    text = lines[0][col:] if len(lines) == 1 else lines[0][col:] + "".join(lines[1:-1])
    text = lines[0][col:end_col] if len(lines) == 1 else text + lines[-1][:end_col]
    try:
        expr = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    return expr.func if isinstance(expr, ast.Call) else expr


class Tracer:
    """A trace function for every thread; records only while :attr:`armed`."""

    def __init__(self, root: str) -> None:
        self.package = os.path.join(root, "tpguide") + os.sep
        self.root = root
        self.armed = False
        self.lock = threading.Lock()
        self.map = StepMap()
        self._nodes: Dict[str, Dict[int, ast.AST]] = {}

    def _rel(self, code) -> Optional[str]:
        path = code.co_filename
        if not path.startswith(self.package) or code.co_name.startswith("<") and code.co_name != "<lambda>":
            return None  # outside tpguide, a module body or a comprehension
        return os.path.relpath(path, self.root).replace(os.sep, "/")

    def _name(self, code) -> str:
        return f"{self._rel(code)}:{code.co_qualname}"

    def __call__(self, frame, event, arg):
        if not self.armed or event != "call":
            return None
        code = frame.f_code
        rel = self._rel(code)
        if rel is None:
            return None
        with self.lock:
            self._record(frame, code, rel)
        return None

    def _record(self, frame, code, rel: str) -> None:
        m = self.map
        if rel not in m.files:
            m.files.append(rel)
        name = self._name(code)
        if name not in m.functions:
            nodes = self._nodes.setdefault(code.co_filename, _function_nodes(code.co_filename))
            node = nodes.get(code.co_firstlineno)
            m.functions[name] = code_lines(code.co_filename, node) if node is not None else 0
        site = caller = frame.f_back  # the frame of the call; the function it belongs to
        while caller is not None and caller.f_code.co_name in COMPREHENSIONS:
            caller = caller.f_back
        if caller is None or self._rel(caller.f_code) is None:
            return
        caller_rel, caller_name = self._rel(caller.f_code), self._name(caller.f_code)
        edge = f"{caller_name} -> {name}"
        if caller_rel != rel:
            m.cross_file_calls[edge] = m.cross_file_calls.get(edge, 0) + 1
        low, high = layer_of(caller_rel), layer_of(rel)
        if low is not None and high is not None and low < high:
            m.against_layers[edge] = m.against_layers.get(edge, 0) + 1
        if self._handed_in(site, caller, code):
            m.handed_in[edge] = m.handed_in.get(edge, 0) + 1

    @staticmethod
    def _handed_in(site, caller, code) -> bool:
        """A lambda or closure called outside its maker, or a parameter / ``self`` attribute of another name."""
        if code.co_name.startswith("__"):
            return False
        maker = code.co_qualname.rpartition(".<locals>.")[0]
        if maker:
            return maker != caller.f_code.co_qualname
        func = call_site(site)
        params = caller.f_code.co_varnames[:caller.f_code.co_argcount + caller.f_code.co_kwonlyargcount]
        if isinstance(func, ast.Name):  # a parameter called under its own name
            return func.id != code.co_name and func.id in params
        return (isinstance(func, ast.Attribute) and func.attr != code.co_name  # self._propose(...)
                and isinstance(func.value, ast.Name) and func.value.id == "self")


def build(model: Optional[str]):
    """A tp-1 engine with the default config, and its group."""
    from tpguide.dist import init_tp_group
    from tpguide.engine import EngineConfig, build_engine

    group = init_tp_group()
    return build_engine(group, model, EngineConfig()), group


def step_map(model: Optional[str] = None, warmup: int = 2) -> Tuple[StepMap, dict]:
    """Trace one decode step after the prefill and ``warmup`` decode steps; (the map, what the step was).

    Raises
    ------
    RuntimeError
        The request finished before the traced step (raise ``max_tokens`` or lower ``warmup``).
    """
    from tpguide.engine.request_io import request_from_dict

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tracer = Tracer(root)
    engine, group = build(model)
    threading.settrace(tracer)  # threads started from here on: the bitmask fill's
    sys.settrace(tracer)
    try:
        try:
            engine.add_request(request_from_dict(REQUEST, 0, REQUEST["max_tokens"]))
            engine.wait_for_admissions()
            tokens = 0
            for _ in range(1 + warmup):  # the prefill, then decode steps
                tokens += sum(len(o.new_token_ids) for o in engine.step())
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"the request finished after {tokens} tokens, before the traced step")
            tracer.armed = True
            outputs = engine.step()
            tracer.armed = False
            info = {"tokens_before": tokens, "new_tokens": sum(len(o.new_token_ids) for o in outputs)}
        finally:
            engine.shutdown()
    finally:
        sys.settrace(None)
        threading.settrace(None)
    return tracer.map, info


def report(m: StepMap, info: dict) -> str:
    """The map as text: files, then the three kinds of calls a reader must follow."""
    out = [f"one decode Engine.step() (after {info['tokens_before']} tokens; it made {info['new_tokens']}):",
           f"{len(m.files)} files, {len(m.functions)} functions, {m.code_lines} code lines entered",
           "", "files in first-call order (functions, code lines):"]
    for i, f in enumerate(m.files, 1):
        fns = {k: v for k, v in m.functions.items() if k.startswith(f + ":")}
        out.append(f"{i:3d}. {f}  ({len(fns)}, {sum(fns.values())})")
    for title, calls in (("cross-file calls", m.cross_file_calls),
                         ("calls against the layers (" + " < ".join(LAYERS) + ")", m.against_layers),
                         ("calls through a callable handed in", m.handed_in)):
        out += ["", f"{title}: {len(calls)} distinct, {sum(calls.values())} calls"]
        out += [f"  {edge}  x{n}" for edge, n in calls.items()]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--warmup", type=int, default=2, help="decode steps before the traced one (default 2)")
    p.add_argument("--json", action="store_true", help="print the map as JSON")
    args = p.parse_args(argv)
    m, info = step_map(args.model, args.warmup)
    if args.json:
        print(json.dumps({**asdict(m), "code_lines": m.code_lines, **info}, indent=1))
    else:
        print(report(m, info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
