"""tpguide: a tensor-parallel worker for exact grammar-guided LLM generation.

Every rank holds a slice of every weight, including a vocabulary slice of the
LM head, and applies its own slice of the grammar's token bitmask to its own
logits shard.  See ``docs/architecture.md`` for the architecture and its invariants.
"""

__version__ = "0.1.0"
