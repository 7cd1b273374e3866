"""The engine's configuration: :class:`EngineConfig`, its limits and choices, validated once and never mutated.

docs/usage.md lists the flags that build it (``tpguide/cli/engine_flags.py``);
the same config is built on the driver and on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tpguide.guided.params import check_whitespace_mode
from tpguide.worker.step_inputs import StepCapacity

#: The most tokens one step may hold: every Triton kernel of the step is checked free of integer overflow up to
#: it at the largest supported model sizes (``tests/test_kernels_int_ranges.py``).
MAX_NUM_BATCHED_TOKENS = 1 << 16

__all__ = ["EngineConfig", "step_capacity"]


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits and choices (validated, never mutated).

    Attributes
    ----------
    max_num_seqs : int
        Requests running at once (request slots, guided bitmask rows); not tied to the KV memory.
    max_num_batched_tokens : int
        Token budget per step; longer prompts are prefilled in chunks.  At most
        :data:`MAX_NUM_BATCHED_TOKENS` (65,536), the largest step whose kernel
        offsets are checked free of int32 overflow (docs/gpu.md, "Offsets at
        real model sizes"); more raises ValueError.
    max_model_len : int
        Prompt plus generated tokens per request.
    block_size : int
        Tokens per KV block (docs/architecture.md §7 "KV cache").
    kv_cache_memory : int or None
        Bytes of KV pool per rank; None: on CUDA ``kv_cache_memory_fraction``
        of the free memory, on CPU room for ``max_num_seqs`` requests of
        ``max_model_len`` tokens (:mod:`tpguide.engine.kv_pool_size`).
    kv_cache_memory_fraction : float
        CUDA only, without ``kv_cache_memory``: the share of free device memory, in (0, 1].
    enable_prefix_caching : bool
        Reuse cached full blocks of a shared prefix (:mod:`tpguide.engine.kv_cache_manager`).
    guided_backend : {"auto", "xgrammar", "llguidance"}
        ``auto``: per request, xgrammar if it enforces the guide, else llguidance
        (:mod:`tpguide.guided.admission`).
    json_whitespace : {"compact", "bounded", "any"}
        Whitespace between JSON tokens (:mod:`tpguide.guided.params`); a
        request's ``structured_output.json_whitespace`` overrides it.
    grammar_compile_timeout_s : float or None
        A guide whose admission (checks + compile, in a worker thread) takes
        longer fails its request; None = no limit.
    seed : int
        Run seed; a request without ``seed`` uses ``seed * 1_000_003 + index``.
    dtype : torch.dtype
        Weights and activations (logits are fp32).
    tp_invariant : bool
        TP-invariant row-parallel reductions: logits, tokens and logprobs
        bit-identical at tp 1..4 in every dtype (docs/architecture.md §6);
        False: plain all-reduce.
    speculative_method : {"grammar", "ngram", "draft-head", None}
        Draft tokens verified by the target model each decode step
        (:mod:`tpguide.speculative.verify`); output tokens are those of a
        run without drafts.  ``"grammar"`` (the default): a guided request
        drafts the text its grammar forces
        (:mod:`tpguide.speculative.grammar_draft`), nothing else drafts.
        ``"ngram"`` / ``"draft-head"``: every request drafts by prompt lookup
        / with the draft head (which needs the engine built with one,
        :func:`build_engine`), guided requests their forced text first
        unless ``grammar_draft`` is False.  None: no drafts at all.
    grammar_draft : bool
        With ``"ngram"`` or ``"draft-head"``: draft forced text first where
        the grammar forces some (default True); False with ``"grammar"`` is
        refused (use None).
    num_speculative_tokens : int or None
        ``K``, the most drafts per request per step, in 1..16 with a method;
        None = 4 with a method, 0 without (resolved when the config is built).
    draft_num_layers : int or None
        ``draft-head``: target layers the drafter runs; None = a third of the
        layers (rounded up).
    draft_vocab_size : int
        ``draft-head``: target ids the draft LM head predicts (the first ids
        of the vocabulary plus the stop tokens; :func:`~tpguide.speculative.draft_head.select_draft_vocab`).
    draft_lens : bool
        ``draft-head`` with fewer layers than the target: put a tuned-lens
        translator between the drafter's last layer and the final norm,
        fitted once on built-in calibration text and cached
        (:mod:`tpguide.speculative.draft_lens`); False = the raw early exit.
    cuda_graphs : bool
        On CUDA (the default, as vLLM's without ``enforce_eager``): the
        step's inputs go through persistent buffers with no host sync before
        the sampled ids are read, and a step that fits a token-count bucket
        replays a CUDA graph where supported (tp 1, ``tp_invariant``;
        :mod:`tpguide.worker.cuda_graphs`).  The first steps of each bucket
        are checked bit for bit against the plain eager step, which a
        difference or a failed capture falls back to for the run
        (:mod:`tpguide.worker.fast_path_check`; docs/gpu.md).  False
        (``--no-cuda-graphs`` / ``--enforce-eager``): every step eagerly on
        the plan's tensors, the CUDA path measured on an H200 (docs/gpu.md
        "Results").  No effect on CPU.
    reasoning_parser : {"auto", "qwen3", "deepseek_r1", "none"}
        The think block of reasoning models (docs/reasoning.md): ``auto`` is
        on when the tokenizer has ``<think>`` and ``</think>`` as single
        tokens; a named parser on a tokenizer without them fails the start.
    """

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 1024
    max_model_len: int = 2048
    block_size: int = 16
    kv_cache_memory: Optional[int] = None
    kv_cache_memory_fraction: float = 0.9
    enable_prefix_caching: bool = True
    guided_backend: str = "auto"
    json_whitespace: str = "bounded"
    grammar_compile_timeout_s: Optional[float] = 60.0
    seed: int = 0
    dtype: torch.dtype = torch.float32
    tp_invariant: bool = True
    speculative_method: Optional[str] = "grammar"
    grammar_draft: bool = True
    num_speculative_tokens: Optional[int] = None
    draft_num_layers: Optional[int] = None
    draft_vocab_size: int = 8192
    draft_lens: bool = True
    cuda_graphs: bool = True
    reasoning_parser: str = "auto"

    def __post_init__(self) -> None:
        from tpguide.guided.reasoning import REASONING_PARSERS

        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {list(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        _check_speculative(self.speculative_method, self.num_speculative_tokens, self.grammar_draft)
        if self.num_speculative_tokens is None:  # resolved once, before anyone reads it
            object.__setattr__(self, "num_speculative_tokens", 0 if self.speculative_method is None else 4)
        if self.draft_num_layers is not None and self.draft_num_layers < 1:
            raise ValueError(f"draft_num_layers must be >= 1, got {self.draft_num_layers}")
        if self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1, got {self.draft_vocab_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be >= 1 byte or None, got {self.kv_cache_memory}")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens > MAX_NUM_BATCHED_TOKENS:
            raise ValueError(f"max_num_batched_tokens must be <= {MAX_NUM_BATCHED_TOKENS} (the largest step whose "
                             f"kernel offsets are checked, docs/gpu.md), got {self.max_num_batched_tokens}")
        if self.guided_backend not in ("auto", "xgrammar", "llguidance"):
            raise ValueError(f"guided_backend must be 'auto', 'xgrammar' or 'llguidance', got {self.guided_backend!r}")
        check_whitespace_mode(self.json_whitespace)
        if self.grammar_compile_timeout_s is not None and self.grammar_compile_timeout_s <= 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0 or None, got {self.grammar_compile_timeout_s}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


def step_capacity(config: EngineConfig) -> StepCapacity:
    """The most one step holds under ``config`` (the runner's persistent buffers grow past it if ever needed)."""
    blocks = -(-(config.max_model_len + config.num_speculative_tokens) // config.block_size)
    return StepCapacity(max_tokens=config.max_num_batched_tokens, max_seqs=config.max_num_seqs,
                        max_blocks_per_seq=blocks, block_size=config.block_size,
                        max_graph_tokens=config.max_num_seqs * (1 + config.num_speculative_tokens))


def _check_speculative(method: Optional[str], k: Optional[int], grammar_draft: bool) -> None:
    from tpguide.speculative.propose import SPECULATIVE_METHODS

    if method is not None and method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_method must be None or one of {list(SPECULATIVE_METHODS)}, got {method!r}")
    if method is None and k not in (None, 0):
        raise ValueError(f"num_speculative_tokens={k} needs a speculative_method")
    if method is not None and k is not None and not 1 <= k <= 16:
        raise ValueError(f"num_speculative_tokens must be in [1, 16] with speculative_method={method!r}, got {k}")
    if method == "grammar" and not grammar_draft:
        raise ValueError("grammar_draft=False with speculative_method='grammar' drafts nothing: use "
                         "speculative_method=None")
