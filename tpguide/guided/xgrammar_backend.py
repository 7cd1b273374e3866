"""xgrammar backend (the default), after vLLM's ``backend_xgrammar.py``.

One ``xgrammar.GrammarCompiler`` per tokenizer, built with
``vocab_size=padded_vocab_size`` (the bitmask width; ids the tokenizer cannot
emit, padded ids included, are never allowed) and the model's stop ids.
Special tokens (``<|im_start|>``, ...) are never allowed either: xgrammar
would otherwise match them as their literal text (:func:`make_tokenizer_info`).

Guide types:

=================  ==========================================================
``json_schema``    ``compile_json_schema`` (strict mode: no properties or
                   items beyond the schema unless it allows them)
``json``           any JSON object: the schema ``{"type": "object"}``, as vLLM
``regex``          ``compile_regex``
``choice``         an EBNF ``root ::= "a" | "b"`` with escaped literals
``grammar``        GBNF/EBNF (llama.cpp syntax, root rule ``root``); Lark
                   grammars belong to the llguidance backend
``structural_tag`` xgrammar's ``{"type": "structural_tag", "format": ...}``
                   or the legacy ``{"structures": [...], "triggers": [...]}``
=================  ==========================================================

Invalid input raises ``ValueError`` carrying xgrammar's message.
"""

from __future__ import annotations

import inspect
import json
import re
import warnings
from typing import Any

import torch
import xgrammar as xgr

from tpguide.guided.matcher import GrammarMatcher, GuidedBackend
from tpguide.guided.params import (
    DEFAULT_JSON_WHITESPACE,
    check_whitespace_mode,
    xgrammar_json_options,
)

_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's error text without the C++ log prefix."""
    return _LOG_PREFIX.sub("", str(exc).strip()).strip()


def ebnf_string_literal(text: str) -> str:
    """``text`` as a double-quoted GBNF string literal (quotes, backslashes, controls escaped)."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    out = []
    for ch in text:
        if ch in escapes:
            out.append(escapes[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice_as_ebnf(choices: list) -> str:
    """GBNF grammar matching exactly one of ``choices``."""
    return "root ::= " + " | ".join(ebnf_string_literal(c) for c in choices)


def special_token_ids(tokenizer: Any) -> set:
    """Ids of the tokenizer's special tokens (eos, chat markers, added tokens flagged special)."""
    ids = set(getattr(tokenizer, "all_special_ids", []))
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(token_id)
    return ids


#: A token text no grammar text matches (the byte 0xFF is never in UTF-8), per vocabulary type.
_UNMATCHABLE = {xgr.VocabType.BYTE_LEVEL: "\u00ff", xgr.VocabType.BYTE_FALLBACK: "<0xFF>",
                xgr.VocabType.RAW: b"\xff"}


def make_tokenizer_info(tokenizer: Any, padded_vocab_size: int, stop_token_ids: list,
                        forced_ids: frozenset = frozenset()) -> xgr.TokenizerInfo:
    """``xgr.TokenizerInfo`` whose special tokens are never matched as text.

    ``TokenizerInfo.from_huggingface`` keeps e.g. ``<|im_start|>`` as the literal
    text of its id, so a grammar allowing that text would allow the token.
    Here special ids get an empty string, which xgrammar treats as special (as
    it does padded ids); stop tokens stay allowed at the end through
    ``stop_token_ids``.  llguidance excludes special tokens by itself.

    ``forced_ids``: special tokens a structural tag forces by id (a tool
    format's control marker, docs/tool-calls.md).  xgrammar never accepts a
    special token, so these get a text that no grammar string matches (the
    byte 0xFF): a ``token`` node admits them, text never does (free text
    of ``any_text`` aside, where the tag's trigger token dispatches anyway).
    """
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=padded_vocab_size, stop_token_ids=stop_token_ids
    )
    special = special_token_ids(tokenizer)
    if not special:
        return info
    encoded_vocab = [""] * padded_vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < padded_vocab_size and token_id not in special:
            encoded_vocab[token_id] = token
        elif token_id in forced_ids:
            encoded_vocab[token_id] = _UNMATCHABLE[info.vocab_type]
    return xgr.TokenizerInfo(
        encoded_vocab, info.vocab_type, vocab_size=padded_vocab_size,
        stop_token_ids=stop_token_ids, add_prefix_space=info.add_prefix_space,
    )


def make_grammar_compiler(tokenizer_info: xgr.TokenizerInfo, max_threads: int) -> xgr.GrammarCompiler:
    """An ``xgr.GrammarCompiler`` without xgrammar's own cache, building token masks on first use where it can.

    xgrammar 0.2.6+ (``enable_dynamic_compilation``) builds a state's token
    mask when a matcher first reaches it, instead of every state's at compile
    time: the same masks (xgrammar's documented equivalence; checked in
    ``tests/test_xgrammar_dynamic.py``), but a JSONSchemaBench schema compiles
    in a few ms instead of about 0.3 s (docs/architecture.md §5).  Older
    xgrammar compiles eagerly.  Our LRU caches compiled grammars, so
    xgrammar's own cache would duplicate it.
    """
    options = {"max_threads": max_threads, "cache_enabled": False}
    if "enable_dynamic_compilation" in inspect.signature(xgr.GrammarCompiler.__init__).parameters:
        options["enable_dynamic_compilation"] = True
    return xgr.GrammarCompiler(tokenizer_info, **options)


def _token_ids(node: Any) -> list:
    """The token ids a structural tag names (``token`` nodes, ``trigger_tokens``)."""
    if isinstance(node, list):
        return [i for item in node for i in _token_ids(item)]
    if not isinstance(node, dict):
        return []
    ids = [node["token"]] if node.get("type") == "token" and isinstance(node.get("token"), int) else []
    ids += [i for i in node.get("trigger_tokens", []) if isinstance(i, int)]
    return ids + [i for key, value in node.items() if key != "trigger_tokens" for i in _token_ids(value)]


class XGrammarMatcher(GrammarMatcher):
    """:class:`GrammarMatcher` over ``xgrammar.GrammarMatcher``."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_bitmask_row: torch.Tensor) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._stop_bitmask_row = stop_bitmask_row
        self.num_accepted_tokens = 0

    def accept_token(self, token_id: int) -> bool:
        ok = self._matcher.accept_token(int(token_id))
        if ok:
            self.num_accepted_tokens += 1
        return ok

    def rollback(self, num_tokens: int) -> None:
        self._check_rollback(num_tokens)
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_accepted_tokens -= num_tokens

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._matcher.is_terminated():
            # xgrammar raises here; allow only the stop tokens instead.
            bitmask[row].copy_(self._stop_bitmask_row)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def find_jump_forward_string(self) -> str:
        if self._matcher.is_terminated():
            return ""
        return self._matcher.find_jump_forward_string()


class XGrammarBackend(GuidedBackend):
    """xgrammar compiler for one tokenizer.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase
    padded_vocab_size : int
        Bitmask width in tokens.
    stop_token_ids : list of int
    json_whitespace : {"compact", "bounded", "any"}
        Default whitespace between JSON tokens (:mod:`tpguide.guided.params`);
        a request's ``json_whitespace`` overrides it.
    max_threads : int
        Compiler threads.
    cache_size : int
        Compiled guides kept in the LRU cache.
    """

    name = "xgrammar"
    supported_guide_types = frozenset(
        {"json_schema", "json", "regex", "choice", "grammar", "structural_tag"}
    )

    def __init__(
        self,
        tokenizer: Any,
        padded_vocab_size: int,
        stop_token_ids: list,
        *,
        json_whitespace: str = DEFAULT_JSON_WHITESPACE,
        max_threads: int = 8,
        cache_size: int = 128,
    ) -> None:
        super().__init__(padded_vocab_size, stop_token_ids, cache_size)
        self.json_whitespace = check_whitespace_mode(json_whitespace)
        self.tokenizer_info = make_tokenizer_info(tokenizer, padded_vocab_size, self.stop_token_ids)
        self.compiler = make_grammar_compiler(self.tokenizer_info, max_threads)
        self._tokenizer, self._max_threads = tokenizer, max_threads
        self._special_ids = frozenset(special_token_ids(tokenizer))
        self._forcing_compilers: dict = {}  # forced special ids -> compiler (make_tokenizer_info)

    def _compiler_forcing(self, guide_text: str) -> xgr.GrammarCompiler:
        """The compiler for a structural tag: one that admits the special tokens it forces by id, if any."""
        forced = frozenset(i for i in _token_ids(json.loads(guide_text)) if i in self._special_ids)
        if not forced:
            return self.compiler
        if forced not in self._forcing_compilers:
            info = make_tokenizer_info(self._tokenizer, self.padded_vocab_size, self.stop_token_ids, forced)
            self._forcing_compilers[forced] = make_grammar_compiler(info, self._max_threads)
        return self._forcing_compilers[forced]

    def _compile(self, guide_type: str, guide_text: str, json_whitespace: str = "") -> xgr.CompiledGrammar:
        try:
            if guide_type in ("json_schema", "json"):
                return self.compiler.compile_json_schema(
                    guide_text, **xgrammar_json_options(json_whitespace or self.json_whitespace)
                )
            if guide_type == "regex":
                return self.compiler.compile_regex(guide_text)
            if guide_type == "choice":
                return self.compiler.compile_grammar(choice_as_ebnf(json.loads(guide_text)))
            if guide_type == "grammar":
                return self.compiler.compile_grammar(guide_text)
            return self._compile_structural_tag(guide_text)
        except Exception as exc:  # xgrammar raises RuntimeError; pydantic ValueError
            raise ValueError(
                f"xgrammar cannot compile this {guide_type}: {xgrammar_message(exc)}"
            ) from exc

    def _compile_structural_tag(self, guide_text: str) -> xgr.CompiledGrammar:
        tag = json.loads(guide_text)
        if "structures" in tag:  # legacy form, as vLLM still accepts it
            items = [
                xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                for s in tag["structures"]
            ]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                return self.compiler.compile_structural_tag(items, tag["triggers"])
        return self._compiler_forcing(guide_text).compile_structural_tag(guide_text)

    def matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(compiled, self.stop_bitmask_row)
