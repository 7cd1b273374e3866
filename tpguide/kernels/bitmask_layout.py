"""The packed bitmask's layout: 32 tokens per int32 word, token ``32 * w + i`` is bit ``i`` of word ``w``."""

#: tokens per int32 bitmask word (docs/architecture.md §2)
BITS_PER_WORD = 32
