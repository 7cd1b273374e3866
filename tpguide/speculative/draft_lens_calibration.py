"""Calibration residuals for the draft lens: built-in text -> token sequences -> SPMD forward.

The calibration text ships with the package (``data/draft_lens_calibration.txt``,
written for tpguide): English prose, JSON objects of many schemas (compact and
pretty-printed, as guided JSON comes out), lists, code, short Q&A, and chat
documents rendered with the tokenizer's chat template as user/assistant turns,
since the engine serves chat prompts.  Each document is one sequence starting
at position 0, like a request.

:func:`collect_residuals` runs those sequences through the target on every
rank (the layers all-reduce, so it is a collective) and returns the residual
stream after layer ``L`` and after the last layer, replicated on every rank.
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Dict, List, Sequence, Tuple, Union

import torch

from tpguide.model.attention import AttentionMetadata

SEPARATOR = "~~~"
"""A line holding only this separates two documents; the text before the first one is a header."""

MAX_SEQ_LEN = 512
"""Tokens kept per document (longer ones are cut)."""

MAX_BATCH_TOKENS = 1024
"""Tokens per calibration forward (documents are batched up to this)."""

_TURN = re.compile(r"^(user|assistant): ?", re.MULTILINE)

Document = Union[str, List[Dict[str, str]]]


def calibration_text() -> str:
    """The built-in calibration text (package data)."""
    return resources.files("tpguide.speculative").joinpath("data/draft_lens_calibration.txt").read_text("utf-8")


def parse_documents(text: str) -> List[Document]:
    """Split ``text`` into documents: plain strings, or chats as lists of ``{"role", "content"}`` messages.

    A document whose first line starts with ``user:`` is a chat; every line
    starting with ``user:`` or ``assistant:`` opens a turn.
    """
    blocks = re.split(rf"^{re.escape(SEPARATOR)}$\n?", text, flags=re.MULTILINE)[1:]
    docs: List[Document] = []
    for block in (b.strip("\n") for b in blocks):
        if not block:
            continue
        if not block.startswith("user:"):
            docs.append(block)
            continue
        parts = _TURN.split(block)[1:]  # [role, content, role, content, ...]
        docs.append([{"role": role, "content": content.strip()} for role, content in zip(parts[::2], parts[1::2])])
    return docs


def calibration_token_ids(tokenizer, text: str) -> List[List[int]]:
    """Token ids of each document of ``text`` (chats through ``tokenizer``'s chat template), cut to :data:`MAX_SEQ_LEN`.

    Raises
    ------
    ValueError
        ``text`` has no document.
    """
    seqs = []
    for doc in parse_documents(text):
        if isinstance(doc, list):
            rendered = tokenizer.apply_chat_template(doc, tokenize=False)
            ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(doc)["input_ids"]
        seqs.append(list(ids)[:MAX_SEQ_LEN])
    if not seqs:
        raise ValueError(f"the calibration text has no document (documents follow a line {SEPARATOR!r})")
    return seqs


def _batches(seqs: Sequence[Sequence[int]]) -> List[List[Sequence[int]]]:
    batches: List[List[Sequence[int]]] = [[]]
    for seq in seqs:
        if batches[-1] and sum(map(len, batches[-1])) + len(seq) > MAX_BATCH_TOKENS:
            batches.append([])
        batches[-1].append(seq)
    return batches


@torch.no_grad()
def collect_residuals(target, num_layers: int, seqs: Sequence[Sequence[int]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Residual stream after layer ``num_layers`` and after the last layer, on every rank (a collective).

    Every rank must call it with the same ``seqs``.  It **replaces the
    target's KV cache** by a temporary one (the :class:`~tpguide.engine.engine.Engine`
    allocates its own when it is built).

    Parameters
    ----------
    target : LlamaForCausalLM
        This rank's shard.
    num_layers : int
        ``L``, ``1 <= L <= num_hidden_layers``.
    seqs : sequence of sequence of int
        Token ids, one sequence per document, each at positions ``0 ..``.

    Returns
    -------
    h_layer, h_final : torch.Tensor
        fp32 ``[N, H]`` on CPU (``N`` = total tokens, ``H`` = hidden size),
        before the final norm; replicated (the layers end in all-reduces).
    """
    m, dev = target.model, target.group.device
    batches = _batches(seqs)
    target.allocate_kv_cache(max(map(len, batches)), max(map(len, seqs)))
    h_layer, h_final = [], []
    for batch in batches:
        meta = AttentionMetadata.from_lists(list(range(len(batch))), [len(s) for s in batch], [0] * len(batch),
                                            device=dev)
        ids = torch.tensor([t for s in batch for t in s], dtype=torch.int64, device=dev)
        x = m.embed_tokens(ids)  # [T, H]
        for i, layer in enumerate(m.layers):
            x = layer(meta.token_positions, x, meta)
            if i + 1 == num_layers:
                h_layer.append(x.float().cpu())
        h_final.append(x.float().cpu())
    return torch.cat(h_layer), torch.cat(h_final)
