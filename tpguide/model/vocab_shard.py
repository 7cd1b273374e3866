"""Pure index arithmetic of the vocabulary-parallel LM head and its bitmask.

No ``torch.distributed`` here: these functions are the contract every rank
and the driver agree on (docs/architecture.md §2).  Layout for ``org_vocab_size=49157``,
``tp_size=2`` (``padded_vocab_size`` rounded up to ``64 * tp_size = 128``)::

    global token ids  0 ............................ 49157 ...... 49280
                      |  real ids (org_vocab_size)  | padding (-inf)|
    rank 0            [0, 24640)      bitmask words [0, 770)
    rank 1            [24640, 49280)  bitmask words [770, 1540)

Each rank's slice starts on a multiple of 32 tokens, so the rank's slice of
the int32 ``token_bitmask`` (bit ``i`` of word ``w`` = token ``32*w + i``)
lines up with its logits shard word for word.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpguide.kernels.bitmask_layout import BITS_PER_WORD

#: Padding unit per rank, in tokens: a multiple of 32 (one bitmask word).
VOCAB_PADDING_PER_RANK = 64


def pad_vocab_size(org_vocab_size: int, tp_size: int, pad_to: int = VOCAB_PADDING_PER_RANK) -> int:
    """``org_vocab_size`` rounded up to a multiple of ``pad_to * tp_size`` (tokens).

    Raises
    ------
    ValueError
        If a size is not positive or ``pad_to`` is not a multiple of 32.
    """
    if org_vocab_size < 1 or tp_size < 1:
        raise ValueError(f"org_vocab_size and tp_size must be >= 1, got {org_vocab_size}, {tp_size}")
    if pad_to % BITS_PER_WORD:
        raise ValueError(f"pad_to must be a multiple of {BITS_PER_WORD}, got {pad_to}")
    unit = pad_to * tp_size
    return -(-org_vocab_size // unit) * unit


def vocab_range(padded_vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """Half-open ``[vocab_start_index, vocab_end_index)`` of rank ``tp_rank`` (tokens).

    Raises
    ------
    ValueError
        If ``padded_vocab_size`` does not divide by ``tp_size`` or the rank is out of range.
    """
    if padded_vocab_size % tp_size:
        raise ValueError(f"padded_vocab_size={padded_vocab_size} is not divisible by tp_size={tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    per_partition = padded_vocab_size // tp_size
    return tp_rank * per_partition, (tp_rank + 1) * per_partition


def get_bitmask_size(vocab_size: int) -> int:
    """``ceil(vocab_size / 32)``: int32 words per bitmask row."""
    return -(-vocab_size // BITS_PER_WORD)


@dataclass(frozen=True)
class VocabShard:
    """One rank's slice of the padded vocabulary and of the token bitmask.

    Built with :meth:`create`; checks the invariants of docs/architecture.md §2 on
    construction, each with an error naming the values.

    Attributes
    ----------
    org_vocab_size, padded_vocab_size : int
        Checkpoint rows / rows after padding (tokens).
    tp_rank, tp_size : int
    vocab_start_index, vocab_end_index : int
        This rank's half-open token range of the padded vocab.
    bitmask_size : int
        Words per full bitmask row, ``ceil(padded_vocab_size / 32)``.
    word_start, word_end : int
        This rank's half-open word range of a full bitmask row.
    """

    org_vocab_size: int
    padded_vocab_size: int
    tp_rank: int
    tp_size: int
    vocab_start_index: int
    vocab_end_index: int
    bitmask_size: int
    word_start: int
    word_end: int

    def __post_init__(self) -> None:
        if self.bitmask_size % self.tp_size != 0:
            raise ValueError(
                f"bitmask_size={self.bitmask_size} is not divisible by tp_size={self.tp_size}"
            )
        if self.vocab_start_index % BITS_PER_WORD != 0:
            raise ValueError(
                f"vocab_start_index={self.vocab_start_index} is not a multiple of {BITS_PER_WORD}: "
                "a bitmask word slice would not line up with the logits shard"
            )
        if self.org_vocab_size > self.padded_vocab_size:
            raise ValueError(
                f"org_vocab_size={self.org_vocab_size} > padded_vocab_size={self.padded_vocab_size}"
            )
        assert self.word_start * BITS_PER_WORD == self.vocab_start_index

    @classmethod
    def create(cls, org_vocab_size: int, tp_rank: int, tp_size: int) -> "VocabShard":
        """Shard of rank ``tp_rank`` for a checkpoint vocabulary of ``org_vocab_size`` rows."""
        padded = pad_vocab_size(org_vocab_size, tp_size)
        start, end = vocab_range(padded, tp_rank, tp_size)
        words = get_bitmask_size(padded)
        return cls(
            org_vocab_size=org_vocab_size,
            padded_vocab_size=padded,
            tp_rank=tp_rank,
            tp_size=tp_size,
            vocab_start_index=start,
            vocab_end_index=end,
            bitmask_size=words,
            word_start=start // BITS_PER_WORD,
            word_end=-(-end // BITS_PER_WORD),
        )

    @property
    def num_embeddings_per_partition(self) -> int:
        """Tokens on this rank (padded ones included)."""
        return self.vocab_end_index - self.vocab_start_index

def bitmask_shard(bitmask_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """Half-open word range ``[start, end)`` of rank ``tp_rank`` in a bitmask row.

    Raises
    ------
    ValueError
        ``bitmask_size % tp_size != 0`` (the guard of the design card).
    """
    if bitmask_size % tp_size != 0:
        raise ValueError(f"bitmask_size={bitmask_size} is not divisible by tp_size={tp_size}")
    per = bitmask_size // tp_size
    return tp_rank * per, (tp_rank + 1) * per
