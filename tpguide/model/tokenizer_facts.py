"""Tokenizer facts of a model: its end tokens (every id that ends a turn) and the ids its tokenizer can produce.

docs/architecture.md §5.  The grammar backends are built from these, and the
engine's step finisher stops a request on :func:`collect_stop_token_ids`.

* :func:`collect_stop_token_ids`: every end token of the model, the stop ids
  a grammar allows at the end.  A guided request may end on any token the
  model uses to finish: the config's and generation config's
  ``eos_token_id`` (int or list), the tokenizer's eos, and the chat
  template's end-of-turn tokens.  Missing one makes a finished grammar a
  dead end for a model that ends turns with it.
* :func:`producible_vocab_size`: ``max(len(tokenizer), largest id + 1)``.
  ``len(tokenizer)`` counts tokens, not ids.  A tokenizer whose ids have a
  gap (a vocabulary of 10 tokens with EOS at id 15) has ``len() == 11``
  while EOS is id 15; masking every id ``>= len()`` as unproducible would
  force EOS to ``-inf``.  xgrammar sizes its tokenizer info the same way
  (``max(len(vocab), max_id + 1)``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Union

__all__ = ["END_OF_TURN_TOKENS", "collect_stop_token_ids", "producible_vocab_size"]


#: End-of-turn / end-of-text tokens of common chat templates, used when in the vocab.
END_OF_TURN_TOKENS = (
    "<|im_end|>",  # ChatML (Qwen, SmolLM2)
    "<|eot_id|>",  # Llama 3
    "<|eom_id|>",  # Llama 3.1 tool calls
    "<|end|>",  # Phi-3
    "<end_of_turn>",  # Gemma
    "</s>",  # Llama 2, Mistral
    "<|endoftext|>",  # GPT-2 family, SmolLM2 base
    "<|end_of_text|>",  # Llama 3 base
)

_CONFIG_FILES = ("config.json", "generation_config.json")


def _as_ids(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return list(value)
    raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}")


def _config_eos_ids(model_dir_or_config: Union[str, os.PathLike, dict, Any, None]) -> list:
    """eos ids from a model directory, a config dict, or a config object (attribute ``eos_token_id``)."""
    if model_dir_or_config is None:
        return []
    if isinstance(model_dir_or_config, (str, os.PathLike)):
        model_dir = os.fspath(model_dir_or_config)
        if not os.path.isdir(model_dir):
            raise ValueError(f"model directory {model_dir!r} does not exist")
        ids = []
        for name in _CONFIG_FILES:
            path = os.path.join(model_dir, name)
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    ids += _as_ids(json.load(f).get("eos_token_id"))
        return ids
    if isinstance(model_dir_or_config, dict):
        return _as_ids(model_dir_or_config.get("eos_token_id"))
    return _as_ids(getattr(model_dir_or_config, "eos_token_id", None))


def collect_stop_token_ids(
    tokenizer: Any,
    model_dir_or_config: Union[str, os.PathLike, dict, Any, Iterable, None] = None,
) -> list:
    """Sorted unique ids of every end token the model and its chat template use.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase
    model_dir_or_config : str, os.PathLike, dict, config object, or a list of those, optional
        A model directory (reads ``config.json`` and ``generation_config.json``),
        a config dict, or a ``PretrainedConfig``/``GenerationConfig``.

    Returns
    -------
    list of int
        Config eos, generation-config eos, tokenizer eos, and each of
        :data:`END_OF_TURN_TOKENS` present in the vocabulary.

    Raises
    ------
    ValueError
        A malformed ``eos_token_id``, a missing directory, or no end token at all.
    """
    sources = model_dir_or_config if isinstance(model_dir_or_config, (list, tuple)) else [model_dir_or_config]
    ids = set()
    for source in sources:
        ids.update(_config_eos_ids(source))
    ids.update(_as_ids(getattr(tokenizer, "eos_token_id", None)))
    vocab = tokenizer.get_vocab()
    ids.update(vocab[name] for name in END_OF_TURN_TOKENS if name in vocab)
    if not ids:
        raise ValueError("found no end token: no eos_token_id in config or tokenizer, no known end-of-turn token")
    return sorted(ids)


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
