"""Stop strings (OpenAI semantics): finish as soon as the output text contains one, cut before it.

The check runs on the driver after every appended token, so the offline
path and the server give the same tokens and text.  It decodes only a
window of the last tokens (long enough to hold the longest stop string),
and the full text only when the window contains a stop string, to find
where the earliest one starts.  The generated tokens are all kept (as vLLM
does); only the text is cut.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

#: Extra tokens decoded beyond the longest stop string (a token has at least one character, except
#: special tokens, which are skipped in the text).
WINDOW_MARGIN = 8


def find_stop_string(detokenize: Callable[[Sequence[int]], str], token_ids: Sequence[int],
                     stop: Sequence[str]) -> Optional[int]:
    """Character offset in ``detokenize(token_ids)`` where the earliest stop string starts, or None.

    Parameters
    ----------
    detokenize : callable
        Token ids -> text (special tokens skipped), as the output text is made.
    token_ids : sequence of int
        The output tokens so far; the last one was just appended.
    stop : sequence of str
        Non-empty stop strings.
    """
    if not stop or not token_ids:
        return None
    window = max(len(s) for s in stop) + WINDOW_MARGIN
    tail = detokenize(token_ids[-window:])
    if not any(s in tail for s in stop):
        return None
    text = detokenize(token_ids)
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(found) if found else None
