"""How many token ids a tokenizer can produce: ``max(len(tokenizer), largest id + 1)``.

``len(tokenizer)`` counts tokens, not ids.  A tokenizer whose ids have a gap
(a vocabulary of 10 tokens with EOS at id 15) has ``len() == 11`` while EOS is
id 15; masking every id ``>= len()`` as unproducible would force EOS to
``-inf``.  xgrammar sizes its tokenizer info the same way
(``max(len(vocab), max_id + 1)``).
"""

from __future__ import annotations

from typing import Any


def producible_vocab_size(tokenizer: Any) -> int:
    """``max(len(tokenizer), largest id in tokenizer.get_vocab() + 1)`` (added tokens included).

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase

    Returns
    -------
    int
        Ids ``>= this`` cannot be produced by the tokenizer (the model masks them to ``-inf``).
    """
    vocab = tokenizer.get_vocab()
    largest = max(vocab.values()) if vocab else -1
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    if added:
        largest = max(largest, max(added))
    return max(len(tokenizer), largest + 1)
