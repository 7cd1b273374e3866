"""Driver-side bookkeeping: prompts, scheduling, grammar matchers, outputs.

Lives on tp_rank 0 only.  Everything here is per request and fails per
request: a bad prompt, a grammar that does not compile, a dead end or a
matcher error finishes that request with ``finish_reason="error"`` and a
message, and the rest of the batch goes on.
"""

from __future__ import annotations

import collections
import functools
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from tqdm import tqdm

from tpguide.engine.request import Request, RequestOutput
from tpguide.engine.scheduler import ScheduledRequest, Scheduler
from tpguide.engine.speculative import make_speculator
from tpguide.engine.step_plan import StepPlan, build_step_plan
from tpguide.guided import GuidedDecoder, make_backend, split_bitmask
from tpguide.guided.admission import admit
from tpguide.guided.compile_service import CompileService
from tpguide.guided.output_check import validate_output
from tpguide.model.vocab_shard import VocabShard


class Driver:
    """Owns the requests of one :meth:`Engine.generate` call.

    Parameters
    ----------
    tokenizer : transformers tokenizer
    stop_token_ids : list of int
        Ids that end a request with ``finish_reason="stop"``.
    shard : VocabShard
        The driver's vocab shard (for ``padded_vocab_size``).
    config : EngineConfig
    """

    def __init__(self, tokenizer, stop_token_ids: List[int], shard: VocabShard, config) -> None:
        self.tokenizer = tokenizer
        self.stop_token_ids = set(stop_token_ids)
        self.config = config
        self.padded_vocab_size = shard.padded_vocab_size
        self._backend = None  # built on the first guided request (takes a few seconds)
        self.guided: Optional[GuidedDecoder] = None
        self.requests: List[Request] = []
        self.spec = make_speculator(config)  # None unless speculative decoding is on
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens,
                                   propose_drafts=self.spec.propose if self.spec else None)
        self._row_owner: List[int] = []  # sample row -> index in self._scheduled
        self.step = 0
        self._bar: Optional[tqdm] = None
        self._scheduled: List[ScheduledRequest] = []
        #: ``{row: why}`` of this step's non-finite sample rows (set by the engine, see faults.py)
        self.bad_row_notes: Dict[int, str] = {}
        self._compiles = CompileService(config.grammar_compile_timeout_s)  # guided admission, off the loop
        self._arrivals: collections.deque = collections.deque()  # prepared, not yet in the scheduler (FIFO)
        self._compiled: Dict[int, tuple] = {}  # request index -> (result, error) of its admission
        self.admission_failures: List[Request] = []  # failed in admission since the engine last looked

    # ------------------------------------------------------------ admission
    def _guided_decoder(self) -> GuidedDecoder:
        if self.guided is None:
            self._backend = make_backend(self.config.guided_backend, self.tokenizer,
                                         self.padded_vocab_size, sorted(self.stop_token_ids),
                                         json_whitespace=self.config.json_whitespace)
            if self.spec is None:
                self.guided = GuidedDecoder(self._backend, self.padded_vocab_size,
                                            self.config.max_num_seqs)
            else:  # 1 + K rows per request
                from tpguide.guided.spec_decoder import SpeculativeGuidedDecoder

                self.guided = SpeculativeGuidedDecoder(
                    self._backend, self.padded_vocab_size,
                    self.config.max_num_seqs * (1 + self.config.num_speculative_tokens))
        return self.guided

    def tokenize(self, req: Request) -> List[int]:
        """Prompt token ids: chat template for ``messages``, plain encoding for ``prompt``."""
        if req.messages is not None:
            text = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True,
                                                      tokenize=False)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(req.prompt)["input_ids"])

    def _prepare(self, req: Request) -> None:
        """Tokenize, check lengths, compile the grammar; raises ValueError on bad input."""
        if req.prompt is not None and not req.prompt.strip():
            raise ValueError(f"the prompt is empty or whitespace only: {req.prompt!r}")
        ids = self.tokenize(req)
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        req.prompt_token_ids = ids  # reported in the output even if a later check fails
        limit = self.config.max_model_len
        total = len(ids) + req.sampling_params.max_tokens
        if total > limit:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({req.sampling_params.max_tokens}) = "
                f"{total} exceeds max_model_len={limit}"
            )
        req.prompt_token_ids = ids
        if req.sampling_params.seed is not None:
            req.seed = req.sampling_params.seed
        else:
            req.seed = (self.config.seed * 1_000_003 + req.index) % (2**63 - 1)

    def start(self, requests: List[Request], progress: bool = False) -> None:
        self.requests = list(requests)
        self.step = 0
        self._bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)
        for req in self.requests:
            if not req.is_finished:
                try:
                    self._prepare(req)
                    if req.structured_output is not None:  # checks + compile in a worker thread
                        self._compiles.submit(req.index, functools.partial(
                            admit, self._guided_decoder().backend, req.structured_output))
                    self._arrivals.append(req)  # joins the scheduler in schedule(), in arrival order
                except ValueError as exc:
                    req.fail(str(exc))
            if req.is_finished:
                self._bar.update(1)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._arrivals)

    def _admit_arrivals(self) -> None:
        """Arrivals join the scheduler in order, each once its guide is admitted; refused ones fail."""
        self._compiled.update((index, (result, error)) for index, result, error in self._compiles.collect())
        while self._arrivals and (self._arrivals[0].structured_output is None
                                  or self._arrivals[0].index in self._compiled):
            req = self._arrivals.popleft()
            result, error = self._compiled.pop(req.index, (None, None))
            if error is None:
                req.guided_backend = result[0] if result is not None else None
                self.scheduler.add(req)
                continue
            req.fail(str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}")
            self.admission_failures.append(req)
            if self._bar is not None:
                self._bar.update(1)

    # ------------------------------------------------------------ one step
    def schedule(self) -> List[ScheduledRequest]:
        self._admit_arrivals()
        while self._arrivals and not self.scheduler.running:  # nothing runs (a start): wait, admit in order
            self._compiles.wait()
            self._admit_arrivals()
        scheduled = self.scheduler.schedule()
        for s in scheduled:
            req = s.request
            if s.start_position == 0 and req.structured_output is not None:
                try:
                    self._guided_decoder().add_request(s.slot, req.structured_output)
                except ValueError as exc:
                    req.fail(str(exc))
        return scheduled

    def build_plan(self, scheduled: List[ScheduledRequest]) -> Tuple[StepPlan, List[Optional[int]]]:
        """The step plan plus, per sample row, the guided slot whose bitmask row it needs."""
        guided_rows = [
            s.slot if (s.samples and s.request.structured_output is not None
                       and not s.request.is_finished) else None
            for s in scheduled
        ]
        plan = build_step_plan(scheduled, guided=any(r is not None for r in guided_rows))
        self._scheduled = scheduled
        self._row_owner = [i for i, s in enumerate(scheduled) for _ in range(1 + s.num_draft_tokens)]
        if self.spec is not None:  # (slot, drafts) per request: 1 + k rows each
            guided_rows = [(slot, s.token_ids[1:1 + s.num_draft_tokens]) for slot, s in zip(guided_rows, scheduled)]
        return plan, guided_rows

    def fill_bitmask(self, guided_rows: Sequence[Optional[int]]):
        """Runs in a worker thread while the forward runs."""
        if self.spec is not None:
            return self.guided.fill_bitmask_with_drafts(guided_rows)
        return self.guided.fill_bitmask(list(guided_rows))

    def finish_bitmask(self, filled) -> Tuple[torch.Tensor, torch.Tensor]:
        """Fail dead-end rows' requests and drop them from ``token_mask``."""
        token_bitmask, token_mask, dead_rows = filled
        for row in dead_rows:
            req = self._scheduled[self._row_owner[row]].request
            req.fail(f"grammar dead end at step {self.step + 1}: no token is allowed after "
                     f"{len(req.output_token_ids)} generated tokens")
            token_mask[row] = 0
        return token_bitmask, token_mask

    def split_for_ranks(self, token_bitmask: torch.Tensor, tp_size: int) -> List[torch.Tensor]:
        return split_bitmask(token_bitmask, tp_size)

    def process_outputs(self, scheduled: List[ScheduledRequest], out) -> None:
        """Advance every scheduled request by this step's sampled token."""
        self.step += 1
        notes, self.bad_row_notes = self.bad_row_notes, {}
        token_ids = out.token_ids.tolist()
        bad = out.bad_rows.tolist() if getattr(out, "bad_rows", None) is not None else [False] * len(token_ids)
        now = time.perf_counter()
        row = 0
        for s in scheduled:
            req, first_row = s.request, row
            row += 1 + s.num_draft_tokens
            req.num_computed_tokens += len(s.token_ids)
            if not req.is_finished and s.samples and self.spec is not None and not s.is_prefill:
                self.spec.verify(self, req, s.token_ids[1:1 + s.num_draft_tokens], token_ids, bad, first_row, out)
                req.first_token_time = req.first_token_time or now
            elif not req.is_finished and s.samples:
                if bad[first_row]:
                    note = notes.get(first_row, "all -inf or NaN")
                    req.fail(f"non-finite logits at step {self.step}: {note}")
                    print(f"[rank 0] step {self.step}: request {req.request_id!r} failed: {req.error}",
                          file=sys.stderr, flush=True)
                else:
                    self._append(req, token_ids[first_row], out, first_row)
                    req.first_token_time = req.first_token_time or now
            if req.is_finished:
                self._release(req)

    def _append(self, req: Request, token: int, out, row: int, advance_matcher: bool = True) -> None:
        """Append one output token and check the stop conditions.

        ``advance_matcher=False``: a verified draft the matcher already
        accepted while filling (it can only terminate on a stop token, which
        the stop-token check below catches).
        """
        req.output_token_ids.append(token)
        if req.sampling_params.logprobs:
            n = req.sampling_params.logprobs
            req.output_logprobs.append({
                "token_id": token,
                "logprob": float(out.logprobs[row]),
                "top": [[int(i), float(v)] for i, v in
                        zip(out.top_logprob_ids[row, :n].tolist(), out.top_logprobs[row, :n].tolist())],
            })
        if req.structured_output is not None and advance_matcher:
            try:
                if not self.guided.accept_token(req.slot, token):
                    req.fail(f"grammar matcher rejected token {token} at step {self.step}")
                    return
            except ValueError as exc:
                req.fail(str(exc))
                return
            if self.guided.is_terminated(req.slot):
                req.finish("stop")
                return
        if token in self.stop_token_ids and not req.sampling_params.ignore_eos:
            req.finish("stop")
        elif len(req.output_token_ids) >= req.sampling_params.max_tokens:
            req.finish("length")
        elif req.num_tokens >= self.config.max_model_len:
            req.finish("length")

    def record_prompt_logprobs(self, plan: StepPlan, prompt) -> None:
        """Append this step's prompt logprobs (a :class:`PromptLogprobs`) to their requests."""
        offsets = plan.prompt_row_offsets
        logprobs, top_ids, top_lps = prompt.logprobs.tolist(), prompt.top_ids.tolist(), prompt.top_logprobs.tolist()
        targets = plan.prompt_target_ids.tolist()
        for i, s in enumerate(self._scheduled):
            n = s.request.sampling_params.prompt_logprobs or 0
            for row in range(offsets[i], offsets[i + 1]):
                s.request.prompt_logprobs.append({
                    "token_id": targets[row],
                    "logprob": logprobs[row],
                    "top": [[i_, lp] for i_, lp in zip(top_ids[row][:n], top_lps[row][:n])],
                })

    def _release(self, req: Request) -> None:
        if req.slot is not None and self.scheduler.running.get(req.slot) is req:
            if self.guided is not None and req.structured_output is not None:
                self.guided.remove_request(req.slot)
            self.scheduler.release(req)
            if self._bar is not None:
                self._bar.update(1)

    # ------------------------------------------------------------ results
    def finish(self) -> List[RequestOutput]:
        """Outputs of every request, in input order."""
        if self._bar is not None:
            self._bar.close()
        return [self.output_of(req) for req in self.requests]

    def output_of(self, req: Request) -> RequestOutput:
        """The output line of one request (final once ``req.is_finished``)."""
        ids = req.output_token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
        if req.finish_reason == "stop" and req.structured_output is not None:
            invalid = validate_output(req.structured_output, text)  # the last line of defence
            if invalid is not None:
                req.finish_reason, req.error = "error", invalid
        elapsed = (req.finish_time or time.perf_counter()) - req.arrival_time
        return RequestOutput(
            id=req.request_id, text=text, token_ids=list(ids),
            finish_reason=req.finish_reason or "error", error=req.error,
            num_prompt_tokens=len(req.prompt_token_ids),
            logprobs=req.output_logprobs if req.sampling_params.logprobs else None,
            elapsed_s=elapsed, guided_backend=req.guided_backend,
            prompt_logprobs=([None] + req.prompt_logprobs
                             if req.sampling_params.prompt_logprobs is not None and req.prompt_token_ids
                             and req.finish_reason != "error"
                             else None),
        )
