"""The engine API: a step loop over one TP group (driver), and the wait for the driver's messages (other ranks).

docs/architecture.md §1.  Its configuration is :class:`~tpguide.engine.config.EngineConfig`.

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
             plan       Driver.plan_step        -> ScheduledStep   (engine/planner.py)
             fill       Driver.fill_bitmask, in a thread -> BitmaskFill (engine/driver.py)
             broadcast  the STEP message
    all      forward    StepRunner.execute_model(plan) -> ForwardOutput  (worker/runner.py)
             sample     StepRunner.sample_tokens(plan, forward, the fill's slices) -> StepResult
    driver   finish     Driver.finish_step(scheduled_step, result, fill) -> outputs (engine/finisher.py)

The driver waits for the fill between the forward and the sampling; the
other ranks run the same two phases (:meth:`StepRunner.execute`), with the
same collectives in the same order.

An idle :meth:`step` (nothing waiting or running) returns at once without a
collective.  An unexpected exception on the driver *between* steps is sent
to the other ranks as an ABORT message (they raise
:class:`~tpguide.worker.protocol.DriverAborted`) and re-raised; *inside* a
step it is re-raised and the process must exit (:mod:`tpguide.worker.faults`).

Offline batch generation is a loop over the same API: :meth:`Engine.generate`
runs a list of requests to completion.  Start-up is not here:
:func:`~tpguide.engine.startup.build_engine` loads this rank's model shard
(and the driver's tokenizer) and :func:`~tpguide.engine.startup.start_engine`
builds the driver, the step runner and the KV pool the engine receives;
:func:`~tpguide.engine.offline.generate_on_group` runs request lines on a group.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional

from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.engine.config import EngineConfig
from tpguide.engine.driver import Driver
from tpguide.engine.request import Request, RequestOutput
from tpguide.speculative.draft_loop import HeadDrafting
from tpguide.worker.protocol import Message
from tpguide.worker.runner import StepRunner

__all__ = ["Engine"]


class Engine:
    """Generation over one TP group: the step loop, on pieces built at start-up.

    Built on every rank by :func:`~tpguide.engine.startup.start_engine`
    (or :func:`~tpguide.engine.startup.build_engine` from a model directory),
    which does the start-up work (KV pool, grammar tables, packed weights,
    CUDA-graph report) and hands the engine its pieces.

    Parameters
    ----------
    model : LlamaForCausalLM
        This rank's shard, its KV pool allocated.
    group : TPGroup
    config : EngineConfig
    driver : Driver or None
        The driver's requests, matchers and step phases (tp_rank 0); None on the other ranks.
    runner : StepRunner
        This rank's step execution.
    pool : ThreadPoolExecutor
        One thread: the bitmask fill, while the forward runs.
    draft_head : DraftHead, optional
        This rank's drafter (``speculative_method="draft-head"``).
    """

    def __init__(self, model, group: TPGroup, config: EngineConfig, *, driver: Optional[Driver],
                 runner: StepRunner, pool: ThreadPoolExecutor, draft_head=None) -> None:
        self.model, self.group, self.config = model, group, config
        self.driver, self.runner, self._pool = driver, runner, pool
        self.draft_head = draft_head

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

    @property
    def num_steps(self) -> int:
        """Engine steps run so far (driver; idle steps without a collective are not counted)."""
        return self._require_driver().num_steps

    def reset_speculation_stats(self) -> None:
        """Start the speculative-decoding counters from zero (driver; e.g. to count one benchmark run)."""
        spec = self._require_driver().spec
        if spec is not None:
            spec.stats = type(spec.stats)()

    def speculation_stats(self):
        """Draft and acceptance counters (driver; :class:`~tpguide.speculative.verify.SpecStats`), or None
        without speculative decoding."""
        spec = self._require_driver().spec
        return spec.stats if spec is not None else None

    def speculation_summary(self) -> Optional[str]:
        """One line of speculative-decoding counts (driver), or None without speculative decoding."""
        spec = self._require_driver().spec
        return spec.stats.summary(spec.method, spec.num_speculative_tokens) if spec is not None else None

    def step(self, finished_only: bool = False) -> List[RequestOutput]:
        """Run one engine step on every rank; the outputs that changed in it (driver).

        Parameters
        ----------
        finished_only : bool
            Report only the requests that finished (:meth:`generate`): a
            running request's output is not built (nor its text advanced),
            its new tokens are only marked reported, so each final output is
            the one a ``False`` run returns.  docs/gpu.md "The host side of a step".

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
        head_drafts = None
        if self.draft_head is not None:
            with self._between_steps(runs_collectives=True):  # the drafting loop's DRAFT messages
                head_drafts = self._draft_with_head(drv, scheduled)
        with self._between_steps():  # after the loop every rank waits for the STEP message again
            scheduled_step = drv.plan_step(scheduled, head_drafts)
            fill_job = self._pool.submit(drv.fill_bitmask, scheduled_step) if scheduled_step.plan.guided else None
            C.broadcast_object(Message.for_step(scheduled_step.plan), self.group)
        # inside the step: an error ends the process
        forward = self.runner.execute_model(scheduled_step.plan)  # the fill job overlaps the forward
        fill = fill_job.result() if fill_job is not None else None  # BitmaskFill
        result = self.runner.sample_tokens(scheduled_step.plan, forward,
                                           drv.bitmask_slices(fill, self.group.tp_size) if fill is not None else None)
        with self._between_steps():
            return outputs + drv.finish_step(scheduled_step, result, fill, finished_only)

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
                outputs = self.step(finished_only=True)  # reports its own failures to the other ranks
                with self._between_steps():
                    for out in outputs:
                        if out.finished:
                            final[out.index] = out
                            bar.update(1)
                            if on_output is not None:
                                on_output(out)
        return [final[i] for i in indices]

    @contextlib.contextmanager
    def _between_steps(self, runs_collectives: bool = False):
        """Driver code between steps: an exception is sent to the waiting ranks as ABORT, then re-raised.

        ``runs_collectives``: the block itself runs collectives (the draft-head
        drafting loop), so the other ranks are not waiting for a message and
        an ABORT could not be matched: the exception is only re-raised (and
        ends the process, as one inside a step).
        """
        try:
            yield
        except Exception as exc:
            if not runs_collectives:
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
