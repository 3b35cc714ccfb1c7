"""Continuous batching, without a transport: concurrent requests share one decoding batch.

One worker thread owns every batch. A request is queued (`submit`), prefilled at the next round
boundary, then joins the running batch of its kind (same models and decoding options, so one
round serves every row); it leaves at the round boundary after it finishes, stops or is
cancelled, and its state (KV rows, drafter context, flow) goes with it. The other rows never
notice: every row's arithmetic is its own (`DecodeBatch`). Requests that cannot share a batch
(another mode, block size, sampling setting) run in batches of their own, one round of each in
turn. A seeded request decodes alone, so its draws are the ones it makes alone.

The request's own thread reads its `Job`'s events (the tokens of each round, then the end) and
does the per-request work there (detokenising, stop words), so the worker only decodes.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from ..decoding.loop import DecodeBatch, GenerationResult, result
from ..decoding.options import DecodeOptions
from .requests import Busy


@dataclass
class Job:
    """One request's row: what it asks, and the events the worker sends it."""

    prompt: list[int]
    options: DecodeOptions
    models: tuple[Any, Any]  # (target, drafter or None)
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # list[int] per round, then a Done
    cancel: threading.Event = field(default_factory=threading.Event)  # set by the request: leave at the next boundary
    submitted: float = field(default_factory=time.perf_counter)
    prefill_s: float = 0.0  # its own prefill (shared with the newcomers prefilled beside it)
    peak_rows: int = 0  # most rows its batch had in one of its rounds (1: it decoded alone)

    @property
    def key(self) -> tuple:
        """Jobs with one key share a batch: same models, and options equal but for the per-row ones."""
        o = self.options
        shared = replace(o, max_new_tokens=1, stop_token_ids=None)
        seed = id(self) if o.sampling.seed is not None else None  # a seeded request decodes alone
        return id(self.models[0]), id(self.models[1]), shared, seed


@dataclass
class Done:
    """The last event of a job: its result (one row), or the error that ended it."""

    result: GenerationResult | None
    error: BaseException | None = None


class Scheduler:
    """Rows of concurrent requests decoded together. `max_batch`: rows decoding at once (all
    batches); `max_queue`: requests waiting for a row before `submit` answers busy."""

    def __init__(self, max_batch: int = 8, max_queue: int = 64, log: Callable[[str], None] = print):
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch}, {max_queue}")
        self.max_batch, self.max_queue, self.log = max_batch, max_queue, log
        self._waiting: list[Job] = []
        self._batches: dict[tuple, tuple[DecodeBatch, list[Job]]] = {}
        self._cv = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="dflow-scheduler", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ what requests call

    def submit(self, target, drafter, prompt: list[int], options: DecodeOptions) -> Job:
        """Queue a request; its events arrive on the returned job. Raises Busy when full or closed."""
        options.check_against(target, drafter, [prompt])  # refuse a bad request now, not in the batch
        job = Job(list(prompt), options, (target, drafter))
        with self._cv:
            if self._closed:
                raise Busy("the server is shutting down; send the request to another server")
            if len(self._waiting) >= self.max_queue + max(0, self.max_batch - self.rows):
                raise Busy(f"the server is busy: {len(self._waiting)} requests are waiting for a row "
                           f"(max_batch {self.max_batch}, max_queue {self.max_queue}); retry later or raise "
                           f"the model's max_queue parameter")
            self._waiting.append(job)
            self._cv.notify()
        return job

    @property
    def rows(self) -> int:
        """Rows decoding now, all batches."""
        return sum(len(jobs) for _, jobs in self._batches.values())

    def state(self) -> dict:
        """What the scheduler holds (tests: nothing after a run)."""
        with self._cv:
            return {"waiting": len(self._waiting), "rows": self.rows, "batches": len(self._batches)}

    def close(self, timeout: float = 10.0) -> None:
        """Stop: waiting and running requests end with Busy (shutdown), their state is freed."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._worker.join(timeout)

    # ------------------------------------------------------------------ the worker

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not self._closed and not self._waiting and not self._batches:
                        self._cv.wait()
                    if self._closed:
                        break
                    free = self.max_batch - self.rows
                    admit, self._waiting = self._waiting[:free], self._waiting[free:]
                self._admit(admit)
                for key in list(self._batches):
                    self._round(key)
        self._shutdown()

    def _admit(self, jobs: list[Job]) -> None:
        """Prefill newcomers (one prefill per kind), send their first token, join their batch."""
        groups: dict[tuple, list[Job]] = {}
        for job in jobs:
            if job.cancel.is_set():
                job.events.put(Done(None, Busy("cancelled before it started")))
            else:
                groups.setdefault(job.key, []).append(job)
        for key, group in groups.items():
            t0 = time.perf_counter()
            target, drafter = group[0].models
            try:
                new = DecodeBatch(target, drafter, [j.prompt for j in group], group[0].options,
                                  rows=[j.options for j in group])
            except Exception as e:  # noqa: BLE001  the newcomers fail, the running rows go on
                for j in group:
                    j.events.put(Done(None, e))
                continue
            dt = time.perf_counter() - t0
            for j, row in zip(group, new.log.rows):
                j.prefill_s = dt
                j.events.put(list(row.tokens))
            with self._cv:
                if key in self._batches:
                    batch, running = self._batches[key]
                    batch.join(new)
                    running.extend(group)
                else:
                    self._batches[key] = (new, list(group))
            self._retire(key)

    def _round(self, key: tuple) -> None:
        batch, jobs = self._batches[key]
        for j in jobs:
            j.peak_rows = max(j.peak_rows, len(jobs))
        try:
            committed = batch.round()
        except Exception as e:  # noqa: BLE001  a failed round ends its batch's requests, not the server
            self.log(f"scheduler: a round failed ({type(e).__name__}: {e}); its {len(jobs)} requests end")
            with self._cv:
                del self._batches[key]
            for j in jobs:
                j.events.put(Done(None, e))
            return
        for j, new in zip(jobs, committed):
            if new:
                j.events.put(new)
        self._retire(key)

    def _retire(self, key: tuple) -> None:
        """Rows that finished or were cancelled leave; a batch with none left is dropped."""
        batch, jobs = self._batches[key]
        gone = [i for i, (r, j) in enumerate(zip(batch.log.rows, jobs)) if r.done or j.cancel.is_set()]
        if not gone:
            return
        results = [(jobs[i], self._result(batch, i, jobs[i])) for i in gone]
        stay = [i for i in range(len(jobs)) if i not in gone]
        with self._cv:
            if stay:
                batch.keep(stay)
                self._batches[key] = (batch, [jobs[i] for i in stay])
            else:
                del self._batches[key]
        for job, res in results:  # after the rows are freed: a request that ends sees them gone
            job.events.put(Done(res))

    @staticmethod
    def _result(batch: DecodeBatch, row: int, job: Job) -> GenerationResult:
        res = result(batch, time.perf_counter() - job.submitted, rows=[row])
        res.rounds = len(res.acceptance_lengths[0])
        res.prefill_s, res.draft_s, res.verify_s = job.prefill_s, 0.0, 0.0  # rounds are shared: see total_s
        return res

    def _shutdown(self) -> None:
        with self._cv:
            jobs = self._waiting + [j for _, js in self._batches.values() for j in js]
            self._waiting, self._batches = [], {}
        for j in jobs:
            j.events.put(Done(None, Busy("the server is shutting down; send the request to another server")))
