"""Reasoning parsers: the think-block tokens of a tokenizer, where a request's thinking starts, the reasoning/answer split.

docs/reasoning.md.  A reasoning model writes ``<think> ... </think>`` before
its answer.  tpguide gates the grammar behind that block
(:mod:`tpguide.guided.thinking`) and reports the two parts apart.  The
parsers, named as vLLM's ``--reasoning-parser``:

==============  =====================================================
``auto``        on when the tokenizer has ``<think>`` and ``</think>``
                as single added tokens, else off (the embedded model)
``qwen3``       Qwen3 (hybrid), QwQ: the model writes ``<think>``
``deepseek_r1`` DeepSeek-R1 and its distills, Qwen3 Thinking-2507:
                the output starts inside the thinking, the prompt
                holds the ``<think>``
``none``        off: every output token is answer
==============  =====================================================

Both named parsers take the same tokens and the same rule: a request thinks
from its first output token unless its prompt already closes the think block
(Qwen3's ``enable_thinking: false`` template, a prefilled assistant turn);
``</think>`` ends the thinking; what comes before it is reasoning, what
comes after it is the answer.  A ``<think>`` the model writes first is part
of neither text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

#: Values of ``EngineConfig.reasoning_parser`` and ``--reasoning-parser``.
REASONING_PARSERS = ("auto", "qwen3", "deepseek_r1", "none")

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """The think-block tokens of one tokenizer.

    Attributes
    ----------
    name : {"qwen3", "deepseek_r1"}
    start_token_id, end_token_id : int
        Ids of ``<think>`` and ``</think>``.
    """

    name: str
    start_token_id: int
    end_token_id: int

    def starts_thinking(self, prompt_token_ids: Sequence[int]) -> bool:
        """True unless the prompt's last think tag is ``</think>`` (the block is already closed)."""
        for token in reversed(prompt_token_ids):
            if token == self.end_token_id:
                return False
            if token == self.start_token_id:
                return True
        return True

    def split(self, output_token_ids: Sequence[int]) -> Tuple[List[int], Optional[List[int]]]:
        """``(reasoning ids, answer ids)`` of a thinking request's output.

        Parameters
        ----------
        output_token_ids : sequence of int
            Every generated token, from the first one (the request started thinking).

        Returns
        -------
        reasoning : list of int
            The tokens before the first ``</think>``, a leading ``<think>`` left out.
        answer : list of int or None
            The tokens after it; None while the thinking has not ended.
        """
        ids = list(output_token_ids)
        try:
            end = ids.index(self.end_token_id)
        except ValueError:
            end = None
        reasoning = ids[:end] if end is not None else ids
        if reasoning and reasoning[0] == self.start_token_id:
            reasoning = reasoning[1:]
        return reasoning, (ids[end + 1:] if end is not None else None)


def single_token_id(tokenizer, text: str) -> Optional[int]:
    """The id of ``text`` when the tokenizer has it as one added (or special) token, else None."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    token_id = added.get(text)
    if token_id is None:
        return None
    return token_id if tokenizer.encode(text, add_special_tokens=False) == [token_id] else None


def resolve_reasoning_parser(name: str, tokenizer) -> Optional[ReasoningParser]:
    """The parser ``name`` selects for ``tokenizer`` (None: reasoning off).

    Parameters
    ----------
    name : {"auto", "qwen3", "deepseek_r1", "none"}
    tokenizer : transformers tokenizer

    Raises
    ------
    ValueError
        An unknown name, or a named parser on a tokenizer that lacks
        ``<think>`` or ``</think>`` as a single token (the message names
        the missing tokens).
    """
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {list(REASONING_PARSERS)}, got {name!r}")
    if name == "none":
        return None
    ids = {text: single_token_id(tokenizer, text) for text in (THINK_START, THINK_END)}
    missing = [text for text, token_id in ids.items() if token_id is None]
    if missing:
        if name == "auto":
            return None
        raise ValueError(f"--reasoning-parser {name} needs {THINK_START!r} and {THINK_END!r} as single tokens; "
                         f"the tokenizer lacks {', '.join(repr(t) for t in missing)}")
    return ReasoningParser("qwen3" if name == "auto" else name, ids[THINK_START], ids[THINK_END])
