"""The SPMD generation loop shared by every rank.

Per step (DESIGN.md §1)::

    driver: schedule [-> draft-head drafting loop, engine/draft_loop.py]
            -> StepPlan --broadcast--> every rank
    driver thread: fill the guided bitmask rows (overlaps the forward)
    every rank: forward on its shard -> hidden [T, H] (replicated)
                -> rows selected_token_indices -> LM-head shard [R, V_pad/T]
    driver: dead-end rows fail their request (token_mask 0)
            --broadcast token_mask, scatter bitmask word slices-->
    every rank: apply its own bitmask slice in place, vocab-parallel sampling
                (all-gather of per-rank (value, token id) candidates)
    driver: append tokens, advance matchers, finish requests, free slots

Only the driver talks to the user.  Non-driver ranks run
:meth:`Engine.run_worker` until the driver's :meth:`Engine.shutdown`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from tpguide.dist import TPGroup
from tpguide.dist import collectives as C
from tpguide.dist.fault_inject import step_fault_hook
from tpguide.engine.draft_loop import DraftPlan, draft_with_head, run_draft_iteration
from tpguide.engine.driver import Driver
from tpguide.engine.faults import abort_plan_for, describe_bad_rows, nonfinite_ranks, raise_if_abort
from tpguide.engine.prompt_logprobs import prompt_logprobs_for_plan
from tpguide.engine.request import Request, RequestOutput
from tpguide.engine.sampler import sample
from tpguide.engine.step_plan import StepPlan
from tpguide.guided.whitespace import check_whitespace_mode
from tpguide.kernels import apply_token_bitmask_inplace
from tpguide.model.attention import AttentionMetadata


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits and choices (validated, never mutated).

    Attributes
    ----------
    max_num_seqs : int
        Requests running at once (KV-cache slots, guided bitmask rows).
    max_num_batched_tokens : int
        Token budget per step; longer prompts are prefilled in chunks.
    max_model_len : int
        Prompt plus generated tokens per request (KV-cache length).
    guided_backend : {"auto", "xgrammar", "llguidance"}
        ``auto``: per request, xgrammar if it enforces the guide, else llguidance
        (:mod:`tpguide.guided.auto_backend`).
    json_whitespace : {"compact", "bounded", "any"}
        Whitespace between JSON tokens (:mod:`tpguide.guided.whitespace`); a
        request's ``structured_output.json_whitespace`` overrides it.
    grammar_compile_timeout_s : float or None
        A guide whose admission (checks + compile, in a worker thread) takes
        longer fails its request; None = no limit.
    seed : int
        Run seed; a request without ``seed`` uses ``seed * 1_000_003 + index``.
    dtype : torch.dtype
        Weights and activations (logits are fp32).
    speculative_method : {None, "ngram", "draft-head"}
        Draft tokens verified by the target model each decode step
        (:mod:`tpguide.engine.speculative`); None = off.  ``"draft-head"``
        needs the engine built with a draft head (:func:`tpguide.engine.offline.build_engine`).
    num_speculative_tokens : int
        ``K``, the most drafts per request per step (``>= 1`` with a method, 0 without).
    draft_num_layers : int or None
        ``draft-head``: target layers the drafter runs; None = a third of the
        layers (rounded up).
    draft_vocab_size : int
        ``draft-head``: target ids the draft LM head predicts (the first ids
        of the vocabulary plus the stop tokens; :func:`~tpguide.engine.draft_head.select_draft_vocab`).
    draft_lens : bool
        ``draft-head`` with fewer layers than the target: put a tuned-lens
        translator between the drafter's last layer and the final norm,
        fitted once on built-in calibration text and cached
        (:mod:`tpguide.engine.draft_lens`); False = the raw early exit.
    """

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 1024
    max_model_len: int = 2048
    guided_backend: str = "auto"
    json_whitespace: str = "bounded"
    grammar_compile_timeout_s: Optional[float] = 60.0
    seed: int = 0
    dtype: torch.dtype = torch.float32
    speculative_method: Optional[str] = None
    num_speculative_tokens: int = 0
    draft_num_layers: Optional[int] = None
    draft_vocab_size: int = 8192
    draft_lens: bool = True

    def __post_init__(self) -> None:
        _check_speculative(self.speculative_method, self.num_speculative_tokens)
        if self.draft_num_layers is not None and self.draft_num_layers < 1:
            raise ValueError(f"draft_num_layers must be >= 1, got {self.draft_num_layers}")
        if self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1, got {self.draft_vocab_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.guided_backend not in ("auto", "xgrammar", "llguidance"):
            raise ValueError(f"guided_backend must be 'auto', 'xgrammar' or 'llguidance', got {self.guided_backend!r}")
        check_whitespace_mode(self.json_whitespace)
        if self.grammar_compile_timeout_s is not None and self.grammar_compile_timeout_s <= 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0 or None, got {self.grammar_compile_timeout_s}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


def _check_speculative(method: Optional[str], k: int) -> None:
    from tpguide.engine.speculative import SPECULATIVE_METHODS

    if method is not None and method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_method must be None or one of {list(SPECULATIVE_METHODS)}, got {method!r}")
    if method is None and k != 0:
        raise ValueError(f"num_speculative_tokens={k} needs a speculative_method")
    if method is not None and not 1 <= k <= 16:
        raise ValueError(f"num_speculative_tokens must be in [1, 16] with speculative_method={method!r}, got {k}")


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

    Raises
    ------
    ValueError
        ``draft-head`` speculation without a draft head; no tokenizer on the driver.
    """

    def __init__(self, model, group: TPGroup, config: EngineConfig, tokenizer=None,
                 stop_token_ids: Optional[Sequence[int]] = None, draft_head=None) -> None:
        if (config.speculative_method == "draft-head") != (draft_head is not None):
            raise ValueError(f"a draft head is needed exactly with speculative_method='draft-head', got "
                             f"speculative_method={config.speculative_method!r} and draft_head={draft_head!r}")
        self.model, self.group, self.config = model, group, config
        self.draft_head = draft_head
        self.shard = model.vocab_shard
        model.allocate_kv_cache(config.max_num_seqs, config.max_model_len)
        self.driver: Optional[Driver] = None
        if group.is_driver:
            if tokenizer is None:
                raise ValueError("the driver needs a tokenizer")
            self.driver = Driver(tokenizer, list(stop_token_ids or []), self.shard, config)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bitmask")
        self._on_step = step_fault_hook(group)  # a no-op unless TPGUIDE_FAULT_INJECT names this rank

    # ------------------------------------------------------------------ driver
    def generate(self, requests: List[Request], progress: bool = False,
                 on_output: Optional[Callable[[RequestOutput], None]] = None) -> List[RequestOutput]:
        """Run ``requests`` to completion (driver only); outputs in input order.

        Requests that fail validation or decoding finish with
        ``finish_reason="error"``; the others are unaffected.  ``on_output``
        is called with each request's output as soon as it finishes (in
        finishing order), e.g. to stream it to disk.

        An unexpected exception between steps is broadcast to the other
        ranks as an abort (they raise :class:`~tpguide.engine.faults.DriverAborted`)
        and re-raised; inside a step it is re-raised and the process must
        exit (see :mod:`tpguide.engine.faults`).
        """
        assert self.driver is not None, "generate() runs on the driver; other ranks run run_worker()"
        drv = self.driver
        in_step, reported = False, set()
        try:
            drv.start(requests, progress=progress)
            self._report_finished(drv.requests, on_output, reported)
            while drv.has_work():
                scheduled = drv.schedule()
                if not scheduled:
                    break
                in_step = True
                if self.draft_head is not None:
                    draft_with_head(drv, self.draft_head, self.group, scheduled)
                plan, guided_rows = drv.build_plan(scheduled)
                future = self._pool.submit(drv.fill_bitmask, guided_rows) if plan.guided else None
                C.broadcast_object(plan, self.group)
                out = self._execute(plan, future)
                in_step = False
                drv.process_outputs(scheduled, out)
                self._report_finished([s.request for s in scheduled] + drv.admission_failures, on_output, reported)
                drv.admission_failures.clear()
        except Exception as exc:
            if not in_step:
                C.broadcast_object(abort_plan_for(exc), self.group)
            raise
        self._report_finished(drv.requests, on_output, reported)  # refused at admission after the last step
        return drv.finish()

    def _report_finished(self, requests: Sequence[Request], on_output, reported: set) -> None:
        """Call ``on_output`` once for each newly finished request (``reported``: indices done)."""
        if on_output is None:
            return
        for req in requests:
            if req.is_finished and req.index not in reported:
                reported.add(req.index)
                on_output(self.driver.output_of(req))

    def shutdown(self) -> None:
        """Tell every rank to leave its loop (driver), then free the thread pool."""
        if self.group.is_driver:
            C.broadcast_object(StepPlan.stop_plan(), self.group)
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ others
    def run_worker(self) -> None:
        """Follow the driver's plans until it sends the stop plan (non-driver ranks)."""
        assert not self.group.is_driver
        while True:
            plan = C.broadcast_object(None, self.group)
            if isinstance(plan, DraftPlan):
                run_draft_iteration(self.draft_head, plan, self.group)
                continue
            if plan.stop:
                raise_if_abort(plan, self.group)
                break
            self._execute(plan, None)
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ all ranks
    def _execute(self, plan: StepPlan, bitmask_future):
        """Forward, LM-head shard, own bitmask slice, vocab-parallel sampling."""
        self._on_step()
        dev = self.group.device
        meta = AttentionMetadata.from_lists(plan.seq_slots, plan.query_lens, plan.context_lens, device=dev)
        hidden = self.model(plan.input_ids.to(dev), plan.positions.to(dev), meta)  # [T, H]
        if plan.selected_prompt_indices is not None:
            prompt = prompt_logprobs_for_plan(self.model, hidden, plan, self.group)
            if self.driver is not None:
                self.driver.record_prompt_logprobs(plan, prompt)
        rows = plan.selected_token_indices.to(device=dev, dtype=torch.int64)
        logits = self.model.compute_logits(hidden[rows])  # [R, V_pad / tp] fp32
        if plan.guided:
            self._apply_bitmask(logits, bitmask_future)
        out = sample(logits, plan.sampling.to(dev), self.shard, self.group)
        if bool(out.bad_rows.any()):  # identical on every rank: a collective every rank makes
            notes = describe_bad_rows(nonfinite_ranks(logits, self.group))
            if self.driver is not None:
                self.driver.bad_row_notes = notes
        return out

    def _apply_bitmask(self, logits: torch.Tensor, bitmask_future) -> None:
        num_rows = logits.shape[0]
        words = self.shard.bitmask_size // self.group.tp_size
        token_mask = torch.zeros(num_rows, dtype=torch.int32)
        chunks = None
        if self.group.is_driver:
            token_bitmask, token_mask = self.driver.finish_bitmask(bitmask_future.result())
            chunks = self.driver.split_for_ranks(token_bitmask, self.group.tp_size)
        token_mask = C.broadcast_tensor(token_mask.to(self.group.device), self.group)
        local = torch.empty((num_rows, words), dtype=torch.int32, device=self.group.device)
        C.scatter_tensor(local, None if chunks is None else [c.to(self.group.device) for c in chunks],
                         self.group)
        apply_token_bitmask_inplace(logits, local, token_mask=token_mask,
                                    vocab_start_index=self.shard.vocab_start_index)
