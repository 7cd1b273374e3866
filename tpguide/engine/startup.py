"""Start-up of one replica: everything :class:`~tpguide.engine.engine.Engine` needs before its first step.

docs/architecture.md §1.  Two builders, run on every rank of a TP group:

* :func:`build_engine` (what ``launch/generate.py``, ``launch/serve.py`` and
  the multi-rank tests call): this rank's model shard and draft head, on the
  driver also the tokenizer, stop ids, reasoning parser and receipts' facts,
  then :func:`start_engine`;
* :func:`start_engine`, on a loaded shard: the KV pool's size (a collective)
  and allocation, the driver with its grammar backends' tables (built in a
  thread beside the allocation), the fixed-order kernels' packed weights, the
  step runner and its CUDA-graph report.  The engine receives them built and
  holds the step loop only.
"""

from __future__ import annotations

import ctypes
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

import torch

from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.engine.config import EngineConfig, step_capacity
from tpguide.engine.driver import Driver
from tpguide.engine.engine import Engine
from tpguide.engine.kv_pool_size import kv_pool_num_blocks, report_kv_pool
from tpguide.guided.schema_check import import_jsonschema
from tpguide.model.c_heap import tune_c_heap
from tpguide.model.config import ModelConfig
from tpguide.model.invariant_reduce import prepack_weights
from tpguide.model.tokenizer_facts import producible_vocab_size
from tpguide.worker.runner import StepRunner

__all__ = ["build_engine", "start_engine"]


def build_engine(group: TPGroup, model_dir: Optional[str], config: EngineConfig) -> Engine:
    """Build this rank's :class:`Engine`: its model shard (and draft head), on the driver also the tokenizer,
    stop ids and reasoning parser.

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

    tune_c_heap()  # glibc's malloc thresholds fixed before the weights load (tpguide/model/c_heap.py)
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

            from tpguide.model.tokenizer_facts import collect_stop_token_ids

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
    engine = start_engine(model, group, config, tokenizer=tokenizer, stop_token_ids=stop_ids, draft_head=draft_head,
                          reasoning=reasoning)
    if engine.driver is not None:  # the receipts' model fingerprint and engine facts, once (docs/receipts.md)
        from tpguide.engine.model_fingerprint import model_fingerprint
        from tpguide.engine.receipt import ReceiptContext, engine_section

        engine.driver.receipts = ReceiptContext(
            model=model_fingerprint(model_dir, getattr(tokenizer, "chat_template", None)),
            engine=engine_section(config, group.tp_size, group.device, getattr(group, "dp_size", 1)))
    return engine


def start_engine(model, group: TPGroup, config: EngineConfig, tokenizer=None,
                 stop_token_ids: Optional[Sequence[int]] = None, draft_head=None, reasoning=None) -> Engine:
    """Start an :class:`Engine` on this rank's loaded shard.  Call it on every rank with the same arguments.

    In order: the KV pool's size (the ranks agree on it: a collective), on
    the driver the :class:`Driver` and, in a thread, its grammar backends'
    tables; the KV pool (allocated once, for the engine's life); the
    fixed-order kernels' packed weights; the KV pool's start-up line; the
    :class:`StepRunner` and, on CUDA, the CUDA-graph line; then the wait for
    the grammar tables.  All of it is start-up work, not the first request's.

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
        ``draft-head`` speculation without a draft head (or a draft head
        without it); no tokenizer on the driver; a KV budget under one block.
    """
    if (config.speculative_method == "draft-head") != (draft_head is not None):
        raise ValueError(f"a draft head is needed exactly with speculative_method='draft-head', got "
                         f"speculative_method={config.speculative_method!r} and draft_head={draft_head!r}")
    if group.is_driver and tokenizer is None:
        raise ValueError("the driver needs a tokenizer")
    num_blocks, source = kv_pool_num_blocks(model, group, config)
    driver: Optional[Driver] = None
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bitmask", initializer=_one_openmp_thread)
    grammar_tables = None
    if group.is_driver:
        driver = Driver(tokenizer, list(stop_token_ids or []), model.vocab_shard.padded_vocab_size, config,
                        num_blocks, reasoning=reasoning)
        # the grammar backends' tokenizer tables (xgrammar's TokenizerInfo, llguidance's tokenizer: about a
        # second) are built now, beside the KV pool's allocation, not in the first guided request
        grammar_tables = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-tables")
        building = grammar_tables.submit(_prepare_guided, driver)
    model.allocate_kv_cache(num_blocks, config.block_size, config.max_model_len)  # once, for the engine's life
    prepack_weights(model)  # the fixed-order kernels' packed weights: start-up work, not the first request's
    if group.is_driver:
        report_kv_pool(num_blocks, model.kv_cache_block_bytes(config.block_size), config.block_size, source,
                       getattr(group, "rank", 0))
    runner = StepRunner(model, group, draft_head, capacity=step_capacity(config), cuda_graphs=config.cuda_graphs,
                        static_inputs=group.device.type == "cuda" and config.cuda_graphs)
    if group.is_driver and group.device.type == "cuda":
        _report_cuda_graphs(runner, getattr(group, "rank", 0))
    if grammar_tables is not None:
        building.result()
        grammar_tables.shutdown()
    return Engine(model, group, config, driver=driver, runner=runner, pool=pool, draft_head=draft_head)


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


def _prepare_guided(driver: Driver) -> None:
    """Start-up work of the guided path, off the first request: the backend's tables, the grammar
    drafter's tables and the schema validator."""
    decoder = driver.guided_decoder()
    if driver.spec is not None and driver.spec.grammar_drafter is not None:
        driver.spec.grammar_drafter.warm_up(decoder.backend)
    import_jsonschema()


def _report_cuda_graphs(runner: StepRunner, rank: int) -> None:
    """The driver's start-up line on CUDA: graphs on (their buckets and the eager check) or off, and why."""
    graphs = runner.graphs
    state = (f"on (buckets up to {graphs.buckets[-1]} tokens, each captured on first use, its first "
             f"{runner.fast_path_check.steps} steps checked against the eager step)" if graphs
             else f"off ({runner.graphs_off_reason or '--no-cuda-graphs'})")
    print(f"[rank {rank}] CUDA graphs: {state}", file=sys.stderr, flush=True)
