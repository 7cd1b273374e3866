"""Prompt-lookup (n-gram) drafting on the driver: no draft model, no draft logits.

The last ``n`` tokens of a request (prompt + output), ``n`` from ``max_n``
down to ``min_n``, are looked up earlier in the same history; the tokens that
followed the **most recent** earlier occurrence are the drafts.  The copy is
LZ77-style: a match close to the end may run into the tokens being proposed,
so a repeating pattern of period ``p < k`` still yields ``k`` drafts::

    history   ... a b c a b c          last 3 = "a b c", matched 3 back
    drafts    a b c a                  (k = 4; the 4th re-reads draft 1)

After "prompt lookup decoding" (Saxena 2023) and vLLM's ``NgramProposer``
(which keeps the longest match; here the most recent one of the longest
``n``, which favours the local repetition of structured output).
"""

from __future__ import annotations

from typing import List, Sequence


class NgramProposer:
    """Propose up to ``k`` draft tokens by n-gram lookup in the request's own history.

    Parameters
    ----------
    max_n, min_n : int
        Longest and shortest suffix tried (``1 <= min_n <= max_n``).
    max_history : int
        Only the last ``max_history`` tokens are searched (bounds the cost,
        ``O(max_history * n)`` per request per step in Python).

    Raises
    ------
    ValueError
        Bad sizes (the message names them).
    """

    def __init__(self, max_n: int = 3, min_n: int = 1, max_history: int = 1024) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if max_history < 2:
            raise ValueError(f"max_history must be >= 2, got {max_history}")
        self.max_n, self.min_n, self.max_history = max_n, min_n, max_history

    def propose(self, token_ids: Sequence[int], k: int) -> List[int]:
        """Drafts (possibly fewer than ``k``, possibly none) continuing ``token_ids``."""
        if k <= 0:
            return []
        history = list(token_ids[-self.max_history:])
        length = len(history)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = history[-n:]
            last = suffix[-1]
            # most recent earlier occurrence: the match ends at i + n - 1 <= length - 2
            for i in range(length - n - 1, -1, -1):
                if history[i + n - 1] == last and history[i : i + n] == suffix:
                    drafts: List[int] = []
                    for j in range(k):
                        src = i + n + j  # < length + j: history or an earlier draft
                        drafts.append(history[src] if src < length else drafts[src - length])
                    return drafts
        return []
