"""The engine API: a step loop over one TP group (docs/architecture.md §1).

In the style of vLLM's / nano-vllm's ``LLMEngine``.  On the driver (tp_rank
0), from ONE thread::

    engine.add_request(request)          # any time, also between steps
    engine.abort_request(request_id)     # finishes "abort" at the next step boundary
    outputs = engine.step()              # the RequestOutputs that changed in this step
    engine.has_unfinished_requests()
    engine.keepalive()                   # an idle server: a HEARTBEAT for the waiting ranks
    engine.shutdown()                    # STOP to every rank

and on every other rank :meth:`Engine.run_worker` until STOP.  One step::

    driver   plan       Driver.plan_step        -> PlannedStep   (engine/planner.py)
             [draft-head drafting loop, collective]               (speculative/draft_loop.py)
             fill the guided rows in a thread                     (engine/driver.py)
    all      execute    StepRunner.execute(plan) -> StepResult    (worker/runner.py)
    driver   finish     Driver.finish_step(planned, result)      (engine/step_finisher.py)

An idle :meth:`step` (nothing waiting or running) returns at once without a
collective.  An unexpected exception on the driver *between* steps is sent
to the other ranks as an ABORT message (they raise
:class:`~tpguide.worker.runner.DriverAborted`) and re-raised; *inside* a
step it is re-raised and the process must exit (:mod:`tpguide.worker.faults`).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence

from tpguide.dist import TPGroup
from tpguide.dist import collectives as C
from tpguide.engine.config import EngineConfig
from tpguide.engine.driver import Driver
from tpguide.engine.request import Request, RequestOutput
from tpguide.worker.runner import Message, StepRunner

__all__ = ["Engine", "EngineConfig"]


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
        model.allocate_kv_cache(config.max_num_seqs, config.max_model_len)
        self.runner = StepRunner(model, group, draft_head)
        self.driver: Optional[Driver] = None
        if group.is_driver:
            if tokenizer is None:
                raise ValueError("the driver needs a tokenizer")
            self.driver = Driver(tokenizer, list(stop_token_ids or []), model.vocab_shard.padded_vocab_size, config)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bitmask")

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
        in_step = False
        try:
            outputs = drv.take_finished_outside_steps()
            if not drv.has_work():
                return outputs
            draft = self._draft if self.draft_head is not None else None
            in_step = draft is not None  # the drafting loop runs collectives
            planned = drv.plan_step(draft)
            if planned is None:
                return outputs
            filling = self._pool.submit(drv.fill_bitmask, planned) if planned.plan.guided else None
            C.broadcast_object(Message.for_step(planned.plan), self.group)
            in_step = True
            result = self.runner.execute(
                planned.plan, (lambda: drv.bitmask_slices(filling.result(), self.group.tp_size)) if filling else None)
            in_step = False
            return outputs + drv.finish_step(planned, result)
        except Exception as exc:
            if not in_step:
                C.broadcast_object(Message.abort(exc), self.group)
            raise

    def _draft(self, guided, scheduled) -> None:
        from tpguide.speculative.draft_loop import draft_with_head

        draft_with_head(guided, self.driver.stop_token_ids, self.draft_head, self.group, scheduled)

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
                self._require_driver().wait_for_admissions()
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
    def _between_steps(self):
        """Driver code between steps: an exception is sent to the waiting ranks as ABORT, then re-raised."""
        try:
            yield
        except Exception as exc:
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
