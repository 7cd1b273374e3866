"""Quoted class names (```StepRunner```, ```StepRunner.execute_model```) of the docs checked against the package.

Read with ``ast``.  A quoted CamelCase name must be defined somewhere in
``tpguide/`` (a class, function or assignment; an import is not a definition) or be one of
:data:`EXTERNAL_NAMES` (another project's, or a builtin); in ``Class.attr``
the attribute must be bound in a ``tpguide`` class of that name or one of its
bases there (a method, a field, an enum member, ``self.attr = ...``).  A
name right after ``<project>'s`` is that project's and is not checked.
Used by ``tests/doc_names.py``.
"""

from __future__ import annotations

import ast
import builtins
import functools
import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import doc_file_symbols

#: ```Name``` or ```Name.attr``` (a call's ``()`` allowed): a CamelCase name with a lower-case letter.
CLASS_NAME = re.compile(r"(?<!'s )(?<!'s `)`+([A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)(?:\.([A-Za-z_]\w*))?(?:\(\))?`+")

#: Other projects' names the docs quote without a possessive (vLLM, transformers, torch, xgrammar,
#: llguidance, safetensors, Starlette, the OpenAI client, Linux).  Add a name here when a doc quotes a
#: new one; a tpguide name never belongs here.
EXTERNAL_NAMES = frozenset({
    "AutoConfig", "AutoModelForCausalLM", "AutoTokenizer", "LlamaConfig", "OrderedDict", "BaseHTTPMiddleware", "DeepseekV3", "Gemma2RMSNorm", "Gemma2TextScaledWordEmbedding",
    "Gemma3ForConditionalGeneration", "Gemma3RMSNorm", "GenerationConfig", "GptOss", "JsonCompileOptions",
    "LLMEngine", "LLMatcher", "LlamaRMSNorm", "LlamaRotaryEmbedding", "MemAvailable", "MistralForCausalLM", "MixtralTopKRouter", "NaN",
    "OpenAIResponsesModel", "PretrainedConfig", "PySafeSlice", "Qwen2ForCausalLM", "Qwen2Moe",
    "Qwen3MoeTopKRouter", "SignalException", "SiluAndMul", "TextStreamer", "TokenizerInfo",
    "Dv",  # a dimension's name (the draft vocabulary), not a class
})


def references(line: str) -> Iterator[str]:
    """Each quoted ``Name`` or ``Name.attr`` of one line of prose."""
    for m in CLASS_NAME.finditer(line):
        yield m.group(1) + (f".{m.group(2)}" if m.group(2) else "")


def _bound_names(body: list) -> Set[str]:
    """Every name a class body binds: defs, fields, assignments, and ``self.x = ...`` in its methods."""
    names: Set[str] = set()
    for node in body:
        for n in ast.walk(node):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    for t in ast.walk(target):
                        if isinstance(t, ast.Name):
                            names.add(t.id)
                        elif isinstance(t, ast.Attribute):
                            names.add(t.attr)
    return names


@functools.lru_cache(maxsize=None)
def index(root: Path) -> Tuple[Set[str], Dict[str, List[Tuple[Set[str], List[str]]]]]:
    """(every name defined in ``root/tpguide`` and the builtins, class name -> [(its bound names, its bases)])."""
    names: Set[str] = set(dir(builtins))
    classes: Dict[str, List[Tuple[Set[str], List[str]]]] = {}
    for path in sorted((root / "tpguide").rglob("*.py")):
        for node in ast.walk(doc_file_symbols.tree(path)):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                classes.setdefault(node.name, []).append((_bound_names(node.body), bases))
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    names.update(t.id for t in ast.walk(target) if isinstance(t, ast.Name))
    return names, classes


def _has_attr(cls: str, attr: str, classes: dict, seen: Set[str]) -> bool:
    if cls in seen or cls not in classes:
        return False
    seen.add(cls)
    return any(attr in bound or any(_has_attr(b, attr, classes, seen) for b in bases) for bound, bases in classes[cls])


def class_name_exists(ref: str, root: Path) -> bool:
    """Whether ``Name`` is bound in the package (or external), and ``Name.attr``'s attribute in that class."""
    cls, _, attr = ref.partition(".")
    if cls in EXTERNAL_NAMES:
        return True
    names, classes = index(root)
    if cls not in names:
        return False
    if not attr or cls not in classes:  # a function or constant: its attributes are not checked
        return True
    return _has_attr(cls, attr, classes, set())
