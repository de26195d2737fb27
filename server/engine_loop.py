"""One thread owns the pipeline; HTTP handlers talk to it through a command queue.

    handler --submit()--> [commands] --> engine thread: add/abort between steps, llm.step()
    handler <--asyncio.Queue-- outputs (StepOutput, or an error) <-- call_soon_threadsafe

A request that fails validation fails alone (its future carries the error). If a step raises,
the requests in flight get the error (HTTP 500) and are aborted, freeing their pages; the loop
keeps serving new requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
import time
from dataclasses import dataclass

from tandem.pipeline.llm import LLM
from tandem.pipeline.sampling_params import SamplingParams
from tandem.server import metrics as m


class EngineError(RuntimeError):
    pass


@dataclass
class _Request:
    id: str
    prompt: str | list[int]
    params: SamplingParams
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    future: concurrent.futures.Future
    submitted: float


class EngineLoop:
    def __init__(self, llm: LLM, max_queued: int):
        self.llm = llm
        self.max_queued = max_queued
        self._commands: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._live: dict[str, _Request] = {}
        self._last_token: dict[str, float] = {}
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)

    # ---- called from the event loop ----------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def load(self) -> int:
        """Requests queued or running (for backpressure)."""
        return len(self._live) + self._commands.qsize()

    async def submit(self, prompt, params: SamplingParams) -> tuple[str, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        req = _Request(f"cmpl-{next(self._ids)}-{int(time.time() * 1000)}", prompt, params, asyncio.Queue(), loop,
                       concurrent.futures.Future(), time.perf_counter())
        self._commands.put(("add", req))
        self._wake.set()
        await asyncio.wrap_future(req.future)  # raises ValueError for a bad request
        return req.id, req.out

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def idle(self) -> bool:
        return not self._live and self._commands.empty()

    # ---- the engine thread -------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._take_commands()
            if not self.llm.scheduler.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.llm.step()
            except Exception as e:  # noqa: BLE001 - any engine failure fails the requests in flight
                self._fail_all(e)
                continue
            now = time.perf_counter()
            for out in outputs:
                req = self._live.get(out.request_id)
                if req is None:
                    continue
                self._observe(req, out, now)
                req.loop.call_soon_threadsafe(req.out.put_nowait, out)
                if out.finished:
                    self._live.pop(out.request_id, None)
                    self._last_token.pop(out.request_id, None)
            self._update_gauges()

    def _take_commands(self) -> None:
        while True:
            try:
                kind, item = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                try:
                    self.llm.add_request(item.prompt, item.params, request_id=item.id)
                except ValueError as e:
                    item.future.set_exception(e)
                    continue
                self._live[item.id] = item
                item.future.set_result(item.id)
            elif kind == "abort" and item in self._live:
                self.llm.abort(item)
                self._live.pop(item, None)
                self._last_token.pop(item, None)
                m.REQUESTS.labels(status="aborted").inc()
        self._update_gauges()

    def _fail_all(self, error: Exception) -> None:
        for rid, req in list(self._live.items()):
            self.llm.abort(rid)
            req.loop.call_soon_threadsafe(req.out.put_nowait, EngineError(f"engine error: {error}"))
            m.REQUESTS.labels(status="error").inc()
        self._live.clear()
        self._last_token.clear()

    def _observe(self, req: _Request, out, now: float) -> None:
        if out.token_ids:
            last = self._last_token.get(req.id)
            if last is None:
                m.TTFT.observe(now - req.submitted)
            else:
                m.ITL.observe((now - last) / len(out.token_ids))
            self._last_token[req.id] = now
            m.GENERATION_TOKENS.inc(len(out.token_ids))
        if out.finished:
            seq = out.sequence
            m.PROMPT_TOKENS.inc(len(seq.prompt))
            m.REQUESTS.labels(status=out.finish_reason or "stop").inc()
            if seq.metrics.rounds:
                m.ACCEPT_LENGTH.observe(seq.metrics.accept_length)

    def _update_gauges(self) -> None:
        sched = self.llm.scheduler
        m.QUEUE_DEPTH.set(len(sched.waiting) + self._commands.qsize())
        m.RUNNING.set(len(sched.running))
        m.KV_PAGES_IN_USE.set(self.llm.pages.size - 1 - self.llm.pages.num_free)
        for i, rate in enumerate(self.llm.engine.stats.acceptance_per_position()):
            m.ACCEPTANCE.labels(position=str(i + 1)).set(rate)
