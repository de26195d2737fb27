"""One thread owns the pipeline; HTTP handlers talk to it through a command queue.

    handler --submit()--> [commands] --> serve loop thread: add/abort between steps, llm.step()
                                         (a decode burst in a step ends once a command waits)
    handler <--asyncio.Queue-- outputs (StepOutput, or a ServeLoopError) <-- call_soon_threadsafe

Requests arrive checked (the handler ran LLM.check_request). Whatever still raises fails one
request, never the loop:
- adding a request: that request's future carries the error;
- a step: the culprit is isolated, the others go on as if nothing happened (`LLM.isolate_failure`,
  pipeline/failure_isolation.py: each running request alone; the one that raises gets the error,
  HTTP 500; a fault that no request reproduces alone fails nobody);
- the loop's own bookkeeping: every request in flight fails and the scheduler is emptied. If
  even that raises, the thread ends: `alive()` turns false, /ready answers 503 and
  `tandem serve` exits 1 so that its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass

from tandem.pipeline.llm import LLM
from tandem.pipeline.outputs import StepOutput
from tandem.pipeline.request_checks import RequestError
from tandem.pipeline.sampling_params import SamplingParams
from tandem.pipeline.sequence import Sequence, Status
from tandem.server import metrics as m

log = logging.getLogger("tandem.server")


class ServeLoopError(RuntimeError):
    """A generation that failed: an engine error (500), or a request the pipeline refused once it ran
    (400, `param` the field at fault: constraints that leave no token, say)."""

    def __init__(self, message: str, status: int = 500, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


@dataclass
class _Request:
    id: str
    prompt: str | list[int]
    params: SamplingParams
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    future: concurrent.futures.Future
    submitted: float
    interval: int | None = 1          # tokens an output holds before it is sent (None: the final one only)
    seq: Sequence | None = None
    held: StepOutput | None = None    # outputs merged since the last send
    sent: bool = False                # whether an output went out (the first with a token goes at once)


class ServeLoop:
    def __init__(self, llm: LLM, max_queued: int, model_name: str = ""):
        self.llm = llm
        self.vllm = m.VllmSeries(model_name)   # the vLLM-named series
        self.max_queued = max_queued
        self.fatal: BaseException | None = None   # why the serve-loop thread ended, if it did
        self._commands: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._live: dict[str, _Request] = {}
        self._last_token: dict[str, float] = {}
        self._prefix_seen = (0, 0)     # prefix cache queries and hits already counted in the metrics
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        # a decode burst (several target steps a step) ends once a command waits: it is taken after one step
        llm.interrupt_bursts_when(self.commands_waiting)

    def commands_waiting(self) -> bool:
        """Whether a request or an abort is queued for the serve-loop thread."""
        return not self._commands.empty()

    # ---- called from the event loop ----------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def load(self) -> int:
        """Requests queued or running (for backpressure)."""
        return len(self._live) + self._commands.qsize()

    async def submit(self, prompt, params: SamplingParams, interval: int | None = 1) -> tuple[str, asyncio.Queue]:
        """Queue a request; its outputs come on the returned queue. `interval`: a streamed request's
        outputs are merged until they hold this many tokens (the first with a token goes at once), as vLLM's
        and SGLang's --stream-interval; None: only the final output is sent (a request that is not
        streamed reads nothing else)."""
        loop = asyncio.get_running_loop()
        # random: unique across processes too (replicas behind one endpoint, server/ray_app.py)
        req = _Request(f"cmpl-{uuid.uuid4().hex}", prompt, params, asyncio.Queue(), loop,
                       concurrent.futures.Future(), time.perf_counter(), interval)
        self._commands.put(("add", req))
        self._wake.set()
        try:
            await asyncio.wrap_future(req.future)  # raises what add_request raised
        except asyncio.CancelledError:  # the client left while the request was queued
            self.abort(req.id)
            raise
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

    def load_stats(self) -> dict[str, int]:
        """Sequences running and waiting, and free KV pages (every page group), for a router that
        picks among replicas (server/ray_routing.py). Read off the serve-loop thread: list lengths,
        accurate to within the step in progress."""
        st = self.llm.stats()
        return {"running": st.running, "waiting": st.waiting + self._commands.qsize(),
                "kv_pages_free": st.kv_pages_free}

    def fail_everything(self, message: str) -> None:
        """After the thread ended: every queued and live request gets the error (the thread no
        longer touches these structures, so the event loop may)."""
        for kind, item in self._pending_commands():
            if kind == "add":
                _settle(item.future, error=ServeLoopError(message))
        for rid in list(self._live):
            self._fail(rid, message)

    # ---- the serve-loop thread -------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._iterate()
                except Exception as e:  # noqa: BLE001 - the loop's own bookkeeping failed: start afresh
                    log.exception("serve loop error; failing the requests in flight")
                    self._reset(e)
        except BaseException as e:  # the reset failed too: nothing is left to trust
            self.fatal = e
            log.critical("the serve-loop thread ended: %s: %s", type(e).__name__, e, exc_info=e)

    def _iterate(self) -> None:
        self._take_commands()
        if not self.llm.has_unfinished_requests():
            self._wake.wait(0.05)
            self._wake.clear()
            return
        try:
            outputs = self.llm.step()
        except Exception as e:  # noqa: BLE001 - find the request that makes steps raise
            self._isolate(e)
        else:
            self._deliver(outputs)
        self._update_gauges()

    def _pending_commands(self):
        """(kind, item) for every command queued now, taking each off the queue."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _take_commands(self) -> None:
        for kind, item in self._pending_commands():
            if kind == "add":
                try:
                    item.seq = self.llm.add_request(item.prompt, item.params, request_id=item.id)
                except Exception as e:  # noqa: BLE001 - a request that cannot be added fails alone
                    _settle(item.future, error=e if isinstance(e, ValueError) else
                            ServeLoopError(f"engine error while adding the request: {type(e).__name__}: {e}"))
                    continue
                self._live[item.id] = item
                if not _settle(item.future, result=item.id):  # the client left before it was added
                    self._drop(item.id)
            elif kind == "abort" and item in self._live:
                self._drop(item)
                m.REQUESTS.labels(status="aborted").inc()
        self._update_gauges()

    def _deliver(self, outputs) -> None:
        """Each output to its request, merged with the ones it held back (`_Request.interval`)."""
        now = time.perf_counter()
        for out in outputs:
            req = self._live.get(out.request_id)
            if req is None:
                continue
            self._observe(req, out, now)
            if out.finished:
                self._live.pop(out.request_id, None)
                self._last_token.pop(out.request_id, None)
            out = req.held = out if req.held is None else _merged(req.held, out)
            if not out.finished and (req.interval is None or len(out.token_ids) < (req.interval if req.sent else 1)):
                continue       # (the first output with a token goes at once: the time to first token)
            req.held, req.sent = None, True
            if not _send(req, out) and not out.finished:  # its event loop is gone: nobody reads it
                self._drop(out.request_id)

    # ---- failures ----------------------------------------------------------------------
    def _isolate(self, error: Exception) -> None:
        log.warning("a step raised %s: %s; running each request alone to find the cause", type(error).__name__, error)
        found = self.llm.isolate_failure()
        self._deliver(found.outputs)
        for rid, e in found.failed.items():
            if isinstance(e, RequestError):    # what it asks cannot be done: the request's fault, a 400
                log.info("request %s refused while running: %s", rid, e)
                self._fail(rid, str(e), 400, e.param)
                continue
            log.error("request %s fails alone (%s: %s); failing it", rid, type(e).__name__, e)
            self._fail(rid, f"engine error: {type(e).__name__}: {e}")
        for rid, req in list(self._live.items()):  # ended inside the failed step, before its output
            if req.seq is not None and req.seq.status == Status.FINISHED:
                self._fail(rid, f"engine error: {type(error).__name__}: {error}")

    def _reset(self, error: Exception) -> None:
        self.llm.abort_all()
        for rid in list(self._live):
            self._fail(rid, f"engine error: {type(error).__name__}: {error}")

    def _fail(self, request_id: str, message: str, status: int = 500, param: str | None = None) -> None:
        req = self._live.pop(request_id, None)
        self._last_token.pop(request_id, None)
        self.vllm.forget(request_id)
        if req is not None:
            _send(req, ServeLoopError(message, status, param))
            m.REQUESTS.labels(status="error").inc()

    def _drop(self, request_id: str) -> None:
        self.llm.abort(request_id)
        self.vllm.forget(request_id)
        self._live.pop(request_id, None)
        self._last_token.pop(request_id, None)

    # ---- metrics -----------------------------------------------------------------------
    def _observe(self, req: _Request, out, now: float) -> None:
        if out.token_ids:
            last = self._last_token.get(req.id)
            ttft = now - req.submitted if last is None else None
            gap = (now - last) / len(out.token_ids) if last is not None else None
            if ttft is not None:
                m.TTFT.observe(ttft)
            else:
                m.ITL.observe(gap)
            self._last_token[req.id] = now
            m.GENERATION_TOKENS.inc(len(out.token_ids))
            self.vllm.tokens(len(out.token_ids), ttft, gap)
        if out.finished:
            seq = out.sequence
            m.PROMPT_TOKENS.inc(len(seq.prompt))
            m.REQUESTS.labels(status=out.finish_reason or "stop").inc()
            if seq.metrics.rounds:
                m.ACCEPT_LENGTH.observe(seq.metrics.accept_length)
            self.vllm.finished(req.id, seq, out.finish_reason or "stop", now - req.submitted)
        elif out.sequence is not None:
            self.vllm.spec(req.id, out.sequence.metrics)

    def _update_gauges(self) -> None:
        st = self.llm.stats()
        waiting = st.waiting + self._commands.qsize()
        m.QUEUE_DEPTH.set(waiting)
        m.RUNNING.set(st.running)
        m.KV_PAGES_IN_USE.set(sum(st.pages_held.values()))
        for table, n in st.pages_held.items():   # block_tables -> "full", block_tables.window8 -> "window8"
            m.KV_PAGES_BY_GROUP.labels(group=table.partition(".")[2] or "full").set(n)
        for i, rate in enumerate(st.acceptance_per_position):
            m.ACCEPTANCE.labels(position=str(i + 1)).set(rate)
        if st.prefix_caching:   # its counters advance by what this step added
            queries, hits = st.prefix_cache_queries - self._prefix_seen[0], st.prefix_cache_hits - self._prefix_seen[1]
            if queries or hits:
                self._prefix_seen = (st.prefix_cache_queries, st.prefix_cache_hits)
                m.PREFIX_QUERIES.inc(queries)
                m.PREFIX_HITS.inc(hits)
                self.vllm.prefix_cache(queries, hits)
            m.PREFIX_ENTRIES.set(st.prefix_cache_entries)
        self.vllm.gauges(st.running, waiting,
                         sum(st.pages_held.values()) / st.kv_pages_total if st.kv_pages_total else 0.0)


def _merged(first: StepOutput, then: StepOutput) -> StepOutput:
    """Two outputs of one request as one: their text and tokens joined, the later one's finish."""
    return dataclasses.replace(then, text=first.text + then.text, token_ids=[*first.token_ids, *then.token_ids],
                               logprobs=None if then.logprobs is None else [*first.logprobs, *then.logprobs])


def _send(req: _Request, item) -> bool:
    """Hand an output to the request's event loop; False if that loop is closed."""
    try:
        req.loop.call_soon_threadsafe(req.out.put_nowait, item)
        return True
    except RuntimeError:
        return False


def _settle(future: concurrent.futures.Future, result=None, error: BaseException | None = None) -> bool:
    """Resolve a submit() future; False if the waiting client already gave up (cancelled it)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
        return True
    except concurrent.futures.InvalidStateError:
        return False
