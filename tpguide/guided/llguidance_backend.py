"""llguidance backend, after vLLM's ``backend_guidance.py``.

Same :class:`~tpguide.guided.matcher.GrammarMatcher` semantics as the xgrammar
backend; the differences:

* ``grammar`` is **Lark** (llguidance's syntax, with ``%json`` and regex
  terminals, start rule ``start``).  A GBNF grammar (``root ::= ...``) is
  converted by llguidance's own ``gbnf_to_lark``, so plain GBNF works too, but
  Lark is the native form; xgrammar takes GBNF only.
* ``json_schema`` follows llguidance's JSON-schema compiler: properties the
  schema does not list are *allowed* unless ``additionalProperties: false``
  (xgrammar's strict mode forbids them); property order is the schema's.
* ``regex`` is Rust-``regex`` syntax (no look-around, no back-references),
  xgrammar's is ECMAScript-like; both match the whole output.
* ``structural_tag`` only in the legacy form ``{"structures": [{"begin",
  "schema", "end"}], "triggers": [...]}``; xgrammar's
  ``{"type": "structural_tag", "format": ...}`` raises ValueError saying the
  xgrammar backend supports it.
* Invalid guides are detected by ``LLMatcher.validate_grammar`` at compile
  time (llguidance does not raise; it puts matchers in an error state).
* An ``LLMatcher`` that consumes a forbidden token enters a permanent error
  state, so ``accept_token`` checks with ``validate_tokens`` first and keeps
  the state on rejection, as xgrammar does.
* A stop token consumed after the grammar has stopped is not recorded by
  llguidance; the adapter keeps its own history so ``rollback`` counts it.
* A SentencePiece-style tokenizer (metaspace ``\u2581`` for a space, byte
  fallback) encodes the *text* ``\u2581`` as its metaspace token, which
  stands for a space.  llguidance tokenizes the literal strings a grammar
  forces with the tokenizer itself, so for a grammar with a literal ``\u2581``
  its mask allows e.g. ``\u2581dog`` (bytes ``" dog"``), which its own matcher
  then rejects: the request would error.  xgrammar gets it right (it allows
  the byte-fallback token ``<0xE2>``).  So on such a tokenizer a guide that
  spells U+2581 (literally, or as an escape) is refused with
  a message naming xgrammar (``auto`` picks xgrammar for it).
* The compiled form is the validated grammar string; each matcher re-parses
  it (about a millisecond for small grammars), where xgrammar shares a
  compiled automaton with precomputed token masks.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import torch

from tpguide.guided.matcher import GrammarMatcher, GuidedBackend
from tpguide.guided.params import DEFAULT_JSON_WHITESPACE, check_whitespace_mode, llguidance_json_options
from tpguide.model.tokenizer_facts import producible_vocab_size


def _llguidance_message(text: str) -> str:
    """llguidance's error text without its state dump."""
    return text.split("\n<state>")[0].strip()


METASPACE = "\u2581"
_METASPACE_SPELLINGS = (METASPACE, "\\u2581", "\\x{2581}")


def rewrites_metaspace(ll_tokenizer: llguidance.LLTokenizer) -> bool:
    """True if tokenizing the text U+2581 does not give back its UTF-8 bytes (SentencePiece metaspace)."""
    ids = ll_tokenizer.tokenize_str(METASPACE)
    return ll_tokenizer.decode_bytes(ids) != METASPACE.encode("utf-8")


def mentions_metaspace(guide_text: str) -> bool:
    """True if ``guide_text`` spells U+2581 literally or as a backslash-u or backslash-x escape."""
    lowered = guide_text.lower()
    return any(s in lowered for s in _METASPACE_SPELLINGS)


def complete_utf8_prefix(data: bytes) -> str:
    """The longest prefix of ``data`` that is whole UTF-8 characters, decoded (``""`` if it starts mid-character).

    llguidance's forced bytes may end inside a multi-byte character (the
    grammar forces only its first bytes) or start inside one (after a token
    that split it); xgrammar's jump-forward string stops before such a
    character, and so does this.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return data[: exc.start].decode("utf-8")


def choice_as_lark(choices: list) -> str:
    """Lark grammar matching exactly one of ``choices`` (JSON-escaped string literals)."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class LLGuidanceMatcher(GrammarMatcher):
    """:class:`GrammarMatcher` over ``llguidance.LLMatcher``."""

    def __init__(
        self, ll_tokenizer: llguidance.LLTokenizer, grammar: str, stop_token_ids: list,
        stop_bitmask_row: torch.Tensor,
    ) -> None:
        self._matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        self._vocab_size = ll_tokenizer.vocab_size
        self._stop_token_ids = frozenset(stop_token_ids)
        self._stop_bitmask_row = stop_bitmask_row
        self._recorded: list[bool] = []  # per accepted token: did llguidance record it?
        self._terminated = False
        self._raise_if_error()

    @property
    def num_accepted_tokens(self) -> int:  # type: ignore[override]
        return len(self._recorded)

    def _raise_if_error(self) -> None:
        if self._matcher.is_error():
            raise RuntimeError(f"llguidance matcher error: {_llguidance_message(self._matcher.get_error())}")

    def accept_token(self, token_id: int) -> bool:
        token_id = int(token_id)
        if self._terminated or not 0 <= token_id < self._vocab_size or self._matcher.is_error():
            return False
        is_stop = token_id in self._stop_token_ids
        if is_stop and self._matcher.is_stopped():
            # The grammar has ended; llguidance accepts EOS here without recording it.
            self._recorded.append(False)
        elif self._matcher.validate_tokens([token_id]) == 1 and self._matcher.consume_token(token_id):
            self._recorded.append(True)
        else:
            return False
        self._terminated = is_stop
        return True

    def rollback(self, num_tokens: int) -> None:
        self._check_rollback(num_tokens)
        if not num_tokens:
            return
        recorded = sum(self._recorded[-num_tokens:])
        del self._recorded[-num_tokens:]
        if recorded:
            self._matcher.rollback(recorded)
        self._terminated = False
        self._raise_if_error()

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._terminated:
            bitmask[row].copy_(self._stop_bitmask_row)
            return
        self._raise_if_error()
        words = bitmask[row]  # int32 [bitmask_size]: the matcher writes the row in place through its pointer
        if bitmask.dtype != torch.int32 or not words.is_cpu or not words.is_contiguous():
            raise ValueError(f"the bitmask row must be a contiguous int32 CPU row, got {bitmask.dtype} on "
                             f"{bitmask.device} with strides {tuple(bitmask.stride())}")
        # llguidance.torch.fill_next_token_bitmask does exactly this, but importing that module
        # torch.compile-s a function at import time (seconds of dynamo/inductor start-up)
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())
        self._raise_if_error()

    def is_terminated(self) -> bool:
        return self._terminated

    def find_jump_forward_string(self) -> str:
        if self._terminated or self._matcher.is_error() or self._matcher.is_stopped():
            return ""
        return complete_utf8_prefix(self._matcher.compute_ff_bytes())


class LLGuidanceBackend(GuidedBackend):
    """llguidance tokenizer and grammar validation for one tokenizer.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerFast
    padded_vocab_size : int
        Bitmask width in tokens; must be at least the tokenizer's size.
    stop_token_ids : list of int
    json_whitespace : {"compact", "bounded", "any"}
        Default whitespace between JSON tokens (:mod:`tpguide.guided.params`);
        a request's ``json_whitespace`` overrides it.
    cache_size : int

    Raises
    ------
    ValueError
        ``padded_vocab_size`` smaller than the tokenizer (use xgrammar there).
    """

    name = "llguidance"
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
        cache_size: int = 128,
    ) -> None:
        super().__init__(padded_vocab_size, stop_token_ids, cache_size)
        if padded_vocab_size < producible_vocab_size(tokenizer):
            raise ValueError(
                f"llguidance backend needs padded_vocab_size >= the tokenizer's ids, got "
                f"{padded_vocab_size} < {producible_vocab_size(tokenizer)}; the xgrammar backend supports this"
            )
        self.json_whitespace = check_whitespace_mode(json_whitespace)
        try:
            self.ll_tokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=padded_vocab_size, eos_token=self.stop_token_ids
            )
        except Exception as exc:  # llguidance raises ValueError/RuntimeError on tokenizers it cannot read
            raise ValueError(
                f"llguidance cannot use this tokenizer ({type(exc).__name__}: {exc}; {len(tokenizer)} tokens, "
                f"ids up to {producible_vocab_size(tokenizer) - 1}); the xgrammar backend supports it"
            ) from exc
        #: The tokenizer turns the text U+2581 into its metaspace (see the module docstring).
        self.rewrites_metaspace = rewrites_metaspace(self.ll_tokenizer)

    def _serialize(self, guide_type: str, guide_text: str, json_whitespace: str) -> str:
        if guide_type in ("json_schema", "json"):
            return llguidance.LLMatcher.grammar_from_json_schema(
                guide_text, defaults=llguidance_json_options(json_whitespace or self.json_whitespace))
        if guide_type == "regex":
            return llguidance.LLMatcher.grammar_from_regex(guide_text)
        if guide_type == "choice":
            return llguidance.LLMatcher.grammar_from_lark(choice_as_lark(json.loads(guide_text)))
        if guide_type == "grammar":
            return llguidance.grammar_from("grammar", guide_text)
        tag = json.loads(guide_text)
        if "structures" not in tag:
            raise ValueError(
                "llguidance supports only the legacy structural_tag form "
                '{"structures": [...], "triggers": [...]}; the xgrammar backend supports '
                f"{{\"type\": \"structural_tag\", \"format\": ...}} (got keys {sorted(tag)})"
            )
        triggers = tag["triggers"]
        tags = []
        for s in tag["structures"]:
            trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
            if trigger is None:
                raise ValueError(f"structural_tag begin {s['begin']!r} starts with none of the triggers {triggers}")
            tags.append(llguidance.StructTag(
                trigger=trigger, begin=s["begin"], grammar=s["schema"],
                end=s["end"],
            ))
        if not tags:
            raise ValueError("structural_tag has no structures")
        return llguidance.StructTag.to_grammar(tags)

    def _compile(self, guide_type: str, guide_text: str, json_whitespace: str = "") -> str:
        if self.rewrites_metaspace and mentions_metaspace(guide_text):
            raise ValueError(
                f"llguidance cannot compile this {guide_type}: it contains U+2581 ('\u2581'), which this "
                "SentencePiece-style tokenizer encodes as its metaspace (a space), so llguidance's mask would "
                "allow tokens its matcher rejects; use the xgrammar backend (--guided-backend auto picks it)")
        try:
            grammar = self._serialize(guide_type, guide_text, json_whitespace)
        except ValueError as exc:
            raise ValueError(f"llguidance cannot compile this {guide_type}: {exc}") from exc
        except (KeyError, TypeError, AssertionError) as exc:
            raise ValueError(f"llguidance cannot compile this {guide_type}: malformed ({exc!r})") from exc
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise ValueError(
                f"llguidance cannot compile this {guide_type}: {_llguidance_message(messages[0])}"
            )
        return grammar

    def matcher(self, compiled: str) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.ll_tokenizer, compiled, self.stop_token_ids, self.stop_bitmask_row)
