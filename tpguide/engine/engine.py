"""The engine: its configuration, its API (a step loop over one TP group), and the offline run over it.

docs/architecture.md §1.  :class:`EngineConfig` holds the engine's limits and
choices (validated, never mutated, the same on the driver and every rank).

In the style of vLLM's / nano-vllm's ``LLMEngine``.  On the driver (tp_rank
0), from ONE thread::

    engine.add_request(request)          # any time, also between steps
    engine.abort_request(request_id)     # finishes "abort" at the next step boundary
    outputs = engine.step()              # the RequestOutputs that changed in this step
    engine.has_unfinished_requests()
    engine.keepalive()                   # an idle server: a HEARTBEAT for the waiting ranks
    engine.shutdown()                    # STOP to every rank

and on every other rank :meth:`Engine.run_worker` until STOP.  One step::

    driver   schedule   Driver.schedule_step: drafts proposed, then scheduled (engine/drafting.py)
             [draft-head drafting loop, collective: HeadDrafting] (speculative/draft_loop.py)
             plan       Driver.plan_step        -> PlannedStep   (engine/planner.py)
             fill       Driver.fill_bitmask, in a thread -> Filled (engine/driver.py)
             broadcast  the STEP message
    all      forward    StepRunner.execute_model(plan) -> ForwardOutput  (worker/runner.py)
             sample     StepRunner.sample_tokens(plan, forward, the filled slices) -> StepResult
    driver   finish     Driver.finish_step(planned, result, filled) -> outputs (engine/finisher.py)

The driver waits for the fill between the forward and the sampling; the
other ranks run the same two phases (:meth:`StepRunner.execute`), with the
same collectives in the same order.

An idle :meth:`step` (nothing waiting or running) returns at once without a
collective.  An unexpected exception on the driver *between* steps is sent
to the other ranks as an ABORT message (they raise
:class:`~tpguide.worker.protocol.DriverAborted`) and re-raised; *inside* a
step it is re-raised and the process must exit (:mod:`tpguide.worker.faults`).

Offline batch generation is a loop over the same API: :meth:`Engine.generate`
runs a list of requests to completion; :func:`build_engine` loads this
rank's model shard (and the driver's tokenizer) and builds the engine;
:func:`generate_on_group` runs request lines on a group.  They serve
``launch/generate.py`` (torchrun) and the multi-rank tests
(:func:`tpguide.dist.spawn.run_on_ranks`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.engine.driver import Driver
from tpguide.engine.kv_pool_size import kv_pool_num_blocks, report_kv_pool
from tpguide.engine.request import Request, RequestOutput
from tpguide.engine.request_io import parse_request_lines
from tpguide.guided.matcher import producible_vocab_size
from tpguide.guided.params import check_whitespace_mode
from tpguide.model.config import ModelConfig
from tpguide.speculative.draft_loop import HeadDrafting
from tpguide.worker.protocol import Message
from tpguide.worker.runner import StepRunner
from tpguide.worker.step_inputs import StepCapacity

__all__ = ["Engine", "EngineConfig", "build_engine", "generate_on_group"]


# ---------------------------------------------------------------------- configuration

@dataclass(frozen=True)
class EngineConfig:
    """Engine limits and choices (validated, never mutated).

    Attributes
    ----------
    max_num_seqs : int
        Requests running at once (request slots, guided bitmask rows); not tied to the KV memory.
    max_num_batched_tokens : int
        Token budget per step; longer prompts are prefilled in chunks.
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
        Opt in (not yet run on a GPU, docs/gpu.md): on CUDA, the step's inputs
        go through persistent buffers with no host sync before the sampled ids
        are read, and decode and draft-verify steps replay a CUDA graph where
        supported (tp 1, ``tp_invariant``; :mod:`tpguide.worker.cuda_graphs`).
        False (the default): every step eagerly, the CUDA path measured on an
        H200 (docs/gpu.md "Results").  No effect on CPU.
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
    cuda_graphs: bool = False
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
                        max_blocks_per_seq=blocks, block_size=config.block_size)


def _check_speculative(method: Optional[str], k: Optional[int], grammar_draft: bool) -> None:
    from tpguide.speculative.verify import SPECULATIVE_METHODS

    if method is not None and method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_method must be None or one of {list(SPECULATIVE_METHODS)}, got {method!r}")
    if method is None and k not in (None, 0):
        raise ValueError(f"num_speculative_tokens={k} needs a speculative_method")
    if method is not None and k is not None and not 1 <= k <= 16:
        raise ValueError(f"num_speculative_tokens must be in [1, 16] with speculative_method={method!r}, got {k}")
    if method == "grammar" and not grammar_draft:
        raise ValueError("grammar_draft=False with speculative_method='grammar' drafts nothing: use "
                         "speculative_method=None")


# ---------------------------------------------------------------------- the engine API

def _one_openmp_thread() -> None:
    """Initializer of the bitmask-fill thread: its torch ops run on one OpenMP thread.

    A parallel torch op there (a verify step's bitmask rows) would start a
    second OpenMP team, and with more OpenMP threads than cores libgomp stops
    spinning, so the forward's workers sleep between kernels and each kernel
    waits for a wake-up (the vLLM fixtures at 2 threads on 2 cores: 15.0 s ->
    8.8 s).  ``omp_set_num_threads`` sets this thread's value only; torch's
    ``set_num_threads`` would also change what threads started later inherit.
    """
    torch.get_num_threads()  # torch's per-thread lazy init first, so it does not undo the call below
    omp_set_num_threads = getattr(ctypes.CDLL(None), "omp_set_num_threads", None)
    if omp_set_num_threads is not None:  # libgomp / libomp loaded with torch
        omp_set_num_threads(1)


class Engine:
    """Generation over one TP group.  Build it on every rank with the same arguments.

    Parameters
    ----------
    model : LlamaForCausalLM
        This rank's shard (see :func:`tpguide.model.loader.load_model`).
    group : TPGroup
    config : EngineConfig
    tokenizer : transformers tokenizer, optional
        Needed on the driver only.
    stop_token_ids : sequence of int, optional
        Every end token of the model and its chat template (driver only).
    draft_head : DraftHead, optional
        This rank's drafter; required with ``speculative_method="draft-head"``.
    reasoning : ReasoningParser, optional
        The think-block tokens (driver only; docs/reasoning.md); None: off.

    Raises
    ------
    ValueError
        ``draft-head`` speculation without a draft head; no tokenizer on the driver.
    """

    def __init__(self, model, group: TPGroup, config: EngineConfig, tokenizer=None,
                 stop_token_ids: Optional[Sequence[int]] = None, draft_head=None, reasoning=None) -> None:
        if (config.speculative_method == "draft-head") != (draft_head is not None):
            raise ValueError(f"a draft head is needed exactly with speculative_method='draft-head', got "
                             f"speculative_method={config.speculative_method!r} and draft_head={draft_head!r}")
        self.model, self.group, self.config = model, group, config
        self.draft_head = draft_head
        if group.is_driver and tokenizer is None:
            raise ValueError("the driver needs a tokenizer")
        num_blocks, source = kv_pool_num_blocks(model, group, config)
        self.driver: Optional[Driver] = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bitmask", initializer=_one_openmp_thread)
        grammar_tables = None
        if group.is_driver:
            self.driver = Driver(tokenizer, list(stop_token_ids or []), model.vocab_shard.padded_vocab_size, config,
                                 num_blocks, reasoning=reasoning)
            # the grammar backends' tokenizer tables (xgrammar's TokenizerInfo, llguidance's tokenizer: about a
            # second) are built now, beside the KV pool's allocation, not in the first guided request
            grammar_tables = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-tables")
            building = grammar_tables.submit(self.driver.guided_decoder)
        model.allocate_kv_cache(num_blocks, config.block_size, config.max_model_len)  # once, for the engine's life
        if group.is_driver:
            report_kv_pool(num_blocks, model.kv_cache_block_bytes(config.block_size), config.block_size, source,
                           getattr(group, "rank", 0))
        self.runner = StepRunner(model, group, draft_head, capacity=step_capacity(config),
                                 cuda_graphs=config.cuda_graphs,
                                 static_inputs=group.device.type == "cuda" and config.cuda_graphs)
        if group.is_driver and group.device.type == "cuda":
            graphs = self.runner.graphs
            state = (f"on (buckets up to {graphs.buckets[-1]} tokens, each captured on first use)" if graphs
                     else f"off ({self.runner.graphs_off_reason or 'the default; --cuda-graphs opts in'})")
            print(f"[rank {getattr(group, 'rank', 0)}] CUDA graphs: {state}", file=sys.stderr, flush=True)
        if grammar_tables is not None:
            building.result()
            grammar_tables.shutdown()

    # ------------------------------------------------------------------ driver API
    def add_request(self, request: Request) -> None:
        """Queue ``request`` (driver); bad input finishes it with ``"error"`` at the next :meth:`step`."""
        self._require_driver().add_request(request)

    def abort_request(self, request_id: str) -> None:
        """Finish ``request_id`` with ``"abort"`` at the next step boundary; frees its slot, row and matcher."""
        self._require_driver().abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while an added request has not had its final output returned by :meth:`step`."""
        return self._require_driver().has_unfinished_requests()

    def kv_cache_stats(self):
        """Blocks used / free, prefix-cache queries and hits (tokens), preemptions (driver; :class:`KVCacheStats`)."""
        return self._require_driver().kv_cache_stats()

    @property
    def tokenizer(self):
        """The model's tokenizer (driver)."""
        return self._require_driver().tokenizer

    def guided_backend(self):
        """The grammar backend of ``config.guided_backend`` (driver; built at engine start-up)."""
        return self._require_driver().guided_decoder().backend

    def wait_for_admissions(self) -> None:
        """Block until every added guided request is admitted or refused (driver; the compile thread's work)."""
        self._require_driver().wait_for_admissions()

    def speculation_stats(self):
        """Draft and acceptance counters (driver; :class:`~tpguide.speculative.verify.SpecStats`), or None
        without speculative decoding."""
        spec = self._require_driver().spec
        return spec.stats if spec is not None else None

    def speculation_summary(self) -> Optional[str]:
        """One line of speculative-decoding counts (driver), or None without speculative decoding."""
        spec = self._require_driver().spec
        return spec.stats.summary(spec.method, spec.num_speculative_tokens) if spec is not None else None

    def step(self) -> List[RequestOutput]:
        """Run one engine step on every rank; the outputs that changed in it (driver).

        Returns
        -------
        list of RequestOutput
            Requests that got tokens or finished (errors of :meth:`add_request`
            and aborts included).  With nothing waiting or running: the
            pending finished outputs (maybe none) at once, and no collective.
        """
        drv = self._require_driver()
        with self._between_steps():
            outputs = drv.take_finished_outside_steps()
            if not drv.has_work():
                return outputs
            scheduled = drv.schedule_step()  # the drafting phase, then the scheduler
            if not scheduled:
                return outputs
        with self._between_steps(inside=self.draft_head is not None):  # the drafting loop runs collectives
            head_drafts = self._draft_with_head(drv, scheduled) if self.draft_head is not None else None
            planned = drv.plan_step(scheduled, head_drafts)
            filling = self._pool.submit(drv.fill_bitmask, planned) if planned.plan.guided else None
            C.broadcast_object(Message.for_step(planned.plan), self.group)
        # inside the step: an error ends the process
        forward = self.runner.execute_model(planned.plan)  # the fill overlaps the forward
        filled = filling.result() if filling is not None else None
        bitmask = drv.bitmask_slices(filled, self.group.tp_size) if filled is not None else None
        result = self.runner.sample_tokens(planned.plan, forward, bitmask)
        with self._between_steps():
            return outputs + drv.finish_step(planned, result, filled)

    def _draft_with_head(self, drv: Driver, scheduled) -> List[List[int]]:
        """The draft-head drafting loop (a collective): a DRAFT message per iteration, every rank drafts."""
        with HeadDrafting(drv.guided, drv.stop_token_ids, drv.head_draft_requests(scheduled)) as loop:
            while (step := loop.next_step()) is not None:
                C.broadcast_object(Message.for_draft(step.plan), self.group)
                loop.record(self.runner.draft(step.plan, step.token_bitmask).tolist())
        return loop.drafts

    def keepalive(self) -> None:
        """Broadcast a HEARTBEAT message (driver): the waiting ranks leave and re-enter their wait."""
        self._require_driver()
        C.broadcast_object(Message.heartbeat(), self.group)

    def shutdown(self) -> None:
        """Tell every rank to leave its loop (driver), then free the bitmask thread."""
        if self.group.is_driver:
            C.broadcast_object(Message.stop(), self.group)
        self._pool.shutdown(wait=True)

    def generate(self, requests: List[Request], progress: bool = False,
                 on_output: Optional[Callable[[RequestOutput], None]] = None) -> List[RequestOutput]:
        """Run ``requests`` to completion (driver): a loop over :meth:`add_request` and :meth:`step`.

        Parameters
        ----------
        requests : list of Request
            Distinct ``index`` values.
        progress : bool
            Show a tqdm bar of finished requests.
        on_output : callable, optional
            Called with each final output as soon as its request finishes
            (in finishing order), e.g. to stream it to disk.

        Returns
        -------
        list of RequestOutput
            Final outputs in input order.
        """
        from tqdm import tqdm

        indices = [r.index for r in requests]
        if len(set(indices)) != len(indices):
            raise ValueError(f"generate() needs requests with distinct indices, got {indices}")
        final = {}
        with tqdm(total=len(requests), desc="requests", unit="req", disable=not progress) as bar:
            with self._between_steps():
                for req in requests:
                    self.add_request(req)
                # every guide admitted before the first step: the same batches in every run,
                # however long each compile takes (later arrivals join between steps)
                self.wait_for_admissions()
            while self.has_unfinished_requests():
                outputs = self.step()  # reports its own failures to the other ranks
                with self._between_steps():
                    for out in outputs:
                        if out.finished:
                            final[out.index] = out
                            bar.update(1)
                            if on_output is not None:
                                on_output(out)
        return [final[i] for i in indices]

    @contextlib.contextmanager
    def _between_steps(self, inside: bool = False):
        """Driver code between steps: an exception is sent to the waiting ranks as ABORT, then re-raised.

        ``inside``: the code runs collectives after all (no ABORT could be matched): only re-raise.
        """
        try:
            yield
        except Exception as exc:
            if not inside:
                C.broadcast_object(Message.abort(exc), self.group)
            raise

    def _require_driver(self) -> Driver:
        if self.driver is None:
            raise RuntimeError(f"rank {self.group.tp_rank} is not the driver: the engine API runs on "
                               f"tp_rank 0; other ranks call run_worker()")
        return self.driver

    # ------------------------------------------------------------------ other ranks
    def run_worker(self) -> None:
        """Follow the driver's messages until STOP (non-driver ranks)."""
        try:
            self.runner.follow_driver()
        finally:
            self._pool.shutdown(wait=True)


# ---------------------------------------------------------------------- offline: build and run

def build_engine(group: TPGroup, model_dir: Optional[str], config: EngineConfig) -> Engine:
    """Load this rank's model shard (and, on the driver, the tokenizer).

    ``model_dir=None`` selects the embedded default model, a path ending in
    ``.gguf`` that GGUF file (each converted once to safetensors by the driver
    while the other ranks wait).

    Raises
    ------
    ValueError
        Missing model directory, unusable tp size, checkpoint/config mismatch.
    """
    from tpguide.guided.reasoning import resolve_reasoning_parser
    from tpguide.model.loader import load_model
    from tpguide.model.model_source import resolve_model_dir

    model_dir = str(resolve_model_dir(model_dir, group))  # HF directory, FILE.gguf (converted once) or default
    # every rank checks the directory and tp size before the first collective,
    # so each one fails with the same clear message
    if not Path(model_dir).is_dir():
        raise ValueError(f"model directory {model_dir!r} does not exist")
    ModelConfig.from_pretrained(model_dir).check_tp_size(group.tp_size)
    tokenizer = stop_ids = error = reasoning = None
    if group.is_driver:
        try:
            from transformers import AutoTokenizer

            from tpguide.guided import collect_stop_token_ids

            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            stop_ids = collect_stop_token_ids(tokenizer, model_dir)
        except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised
            error = f"cannot load the tokenizer from {model_dir!r}: {type(exc).__name__}: {exc}"
        if error is None:
            try:
                reasoning = resolve_reasoning_parser(config.reasoning_parser, tokenizer)
            except ValueError as exc:
                error = str(exc)
    tokenizer_vocab_size, all_stop_ids, error = C.broadcast_object(
        (producible_vocab_size(tokenizer) if tokenizer is not None else None, stop_ids, error), group)
    if error is not None:
        raise ValueError(error if group.is_driver else f"the driver (rank 0) failed to start: {error}")
    model = load_model(model_dir, group, config.dtype, tokenizer_vocab_size=tokenizer_vocab_size,
                       tp_invariant=config.tp_invariant)
    draft_head = None
    if config.speculative_method == "draft-head":
        from tpguide.speculative.draft_head import build_draft_head

        num_hidden = model.config.num_hidden_layers
        num_layers = config.draft_num_layers or -(-num_hidden // 3)
        if num_layers > num_hidden:
            raise ValueError(f"draft_num_layers={num_layers} exceeds the model's {num_hidden} layers")
        draft_head = build_draft_head(model, model_dir, num_layers, config.draft_vocab_size, all_stop_ids,
                                      lens=config.draft_lens, tokenizer=tokenizer)
    return Engine(model, group, config, tokenizer=tokenizer, stop_token_ids=stop_ids, draft_head=draft_head,
                  reasoning=reasoning)


def generate_on_group(group: TPGroup, model_dir: Optional[str], request_dicts: Sequence[Dict[str, Any]],
                      config: EngineConfig, default_max_tokens: int = 64) -> List[Dict[str, Any]]:
    """Run ``request_dicts`` on the group; every rank returns the driver's outputs.

    Returns
    -------
    list of dict
        One output line (:meth:`RequestOutput.to_json`) per request, input order.
    """
    engine = build_engine(group, model_dir, config)
    outputs: Optional[List[RequestOutput]] = None
    if group.is_driver:
        requests = parse_request_lines([json.dumps(r) for r in request_dicts], default_max_tokens)
        outputs = [o.to_json() for o in engine.generate(requests)]
        engine.shutdown()
    else:
        engine.run_worker()
    return C.broadcast_object(outputs, group)
