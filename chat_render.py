"""Renders a chat template the way transformers does (jinja2's immutable sandbox, trim_blocks,
lstrip_blocks, `raise_exception`, a `tojson` that keeps non-ASCII text), within limits.

A chat template is code that came with the checkpoint and runs on what requests send, so a
render is bounded, and past a bound it fails with RenderLimit (a ValueError that says which):

    time   RENDER_SECONDS of wall clock. Renders run on a worker thread; past the limit the caller
           is answered and the worker stopped by an exception raised into it (CPython's
           PyThreadState_SetAsyncExc, raised at the template code's next bytecode, so loops stop).
           A worker that does not stop (inside one long C call) is left to finish alone and later
           renders go to a new one.
    size   the rendered text stops at MAX_CHARS; `*`, `**` and `%` on strings and numbers, calls
           and filters refuse a result or a width beyond it before computing it (a single C call
           could otherwise allocate gigabytes before any check); `range` is the sandbox's
           (at most 100,000 items).

tandem inspect / build-engines render the template on plain conversations under the same limits
(checkpoint/validation.py), so a template that hangs or explodes is refused before serving.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import json
import queue
import re
import string
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_SECONDS = 2.0
MAX_CHARS = 16 << 20       # 16 Mi characters: far past any context window, 64 MiB at most in memory
_POWER_BITS = 1 << 20      # `a ** b` on integers: results of at most a million bits
_NUMBERS = re.compile(r"\d+")
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d*)(?:\.(\d*))?")   # printf-style: width, precision


class RenderLimit(ValueError):
    pass


class _Stop(BaseException):
    """Raised into a worker whose render ran past its time (never seen by callers)."""


def _raise(message: str):
    raise TemplateError(message)


def _check_number(n, what: str) -> None:
    if isinstance(n, int) and not isinstance(n, bool) and abs(n) > MAX_CHARS:
        raise RenderLimit(f"the chat template asked for {what} of {n:,}, beyond the render limit of "
                          f"{MAX_CHARS:,} characters")


def _check_spec(spec: str, what: str) -> None:
    for digits in _NUMBERS.findall(spec or ""):
        if len(digits) > 9 or int(digits) > MAX_CHARS:
            _check_number(int(digits[:30]), what)


def _guarded(f):
    """A filter whose arguments (not the value filtered) are checked as widths."""
    skip = 2 if getattr(f, "jinja_pass_arg", None) else 1   # (context or environment, then the value)

    @functools.wraps(f)   # (keeps jinja_pass_arg, which says what jinja passes first)
    def call(*args, **kwargs):
        for a in (*args[skip:], *kwargs.values()):
            _check_number(a, "a width")
        return f(*args, **kwargs)
    return call


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "%"})

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(n, int):
                    _check_number(len(seq) * n, "a repetition")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                if left.bit_length() * right > _POWER_BITS:
                    raise RenderLimit(f"the chat template computes {left} ** {right}, a number beyond the render "
                                      f"limit of {_POWER_BITS:,} bits")
        elif operator == "%" and isinstance(left, str):
            for width, precision in _PERCENT_SPEC.findall(left):
                _check_spec(f"{width} {precision}", "a formatted width")
            for a in right if isinstance(right, tuple) else (right,):
                _check_number(a, "a formatted width")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        for a in (*args, *kwargs.values()):
            _check_number(a, "an argument")
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        text = value.__self__

        def checked(*args, **kwargs):
            for _, _, spec, _ in string.Formatter().parse(text):
                _check_spec(spec, "a formatted width")
            return wrapped(*args, **kwargs)
        return checked


class _Worker:
    """One daemon thread running renders in order (they hold the GIL anyway); `stop` ends the one
    running if it is `job`, then retires the thread once what is queued has run."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.running: Future | None = None
        self.thread = threading.Thread(target=self._run, name="chat-template", daemon=True)
        self.thread.start()

    def submit(self, fn) -> Future:
        job: Future = Future()
        self.jobs.put((job, fn))
        return job

    def stop(self, job: Future) -> None:
        with self.lock:
            if self.running is job:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread.ident), ctypes.py_object(_Stop))
        self.jobs.put(None)   # then exit: later renders go to a new worker

    def _run(self) -> None:
        while True:
            try:
                item = self.jobs.get()
                if item is None:
                    return
                job, fn = item
                if not job.set_running_or_notify_cancel():
                    continue
                with self.lock:
                    self.running = job
                try:
                    outcome = (fn(), None)
                except Exception as e:
                    outcome = (None, e)
                with self.lock:
                    self.running = None
                _settle(job, *outcome)
            except _Stop:   # (raised into the render, or just after it: its caller has been answered)
                with self.lock:
                    self.running = None


_worker: _Worker | None = None    # one per process, shared by every template; replaced after a time-out
_worker_lock = threading.Lock()


def _settle(job: Future, result, error) -> None:
    if job.done():
        return
    if error is not None:
        job.set_exception(error)
    else:
        job.set_result(result)


class BoundedTemplate:
    """A compiled chat template; render() and render_async() raise RenderLimit past a bound and
    jinja2's TemplateError for what the template itself refuses."""

    def __init__(self, source: str, seconds: float | None = None):
        env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.filters.update({name: _guarded(f) for name, f in env.filters.items()})
        self.template = env.from_string(source)   # TemplateSyntaxError for a template that does not parse
        self.seconds = RENDER_SECONDS if seconds is None else seconds

    def render(self, context: dict) -> str:
        job, worker = self._submit(context)
        try:
            return job.result(self.seconds)
        except FutureTimeout:
            raise self._timed_out(job, worker) from None

    async def render_async(self, context: dict) -> str:
        job, worker = self._submit(context)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(job), self.seconds)
        except TimeoutError:
            raise self._timed_out(job, worker) from None

    def _submit(self, context: dict) -> tuple[Future, _Worker]:
        global _worker
        with _worker_lock:
            if _worker is None:
                _worker = _Worker()
            worker = _worker
        return worker.submit(lambda: self._generate(context)), worker

    def _timed_out(self, job: Future, worker: _Worker) -> RenderLimit:
        global _worker
        with _worker_lock:
            if _worker is worker:
                _worker = None
        worker.stop(job)
        return RenderLimit(f"the chat template took longer than {self.seconds:g} s to render these messages (the "
                           "render limit); send fewer or shorter messages, or fix the template")

    def _generate(self, context: dict) -> str:
        parts, size = [], 0
        for part in self.template.generate(context):
            size += len(part)
            if size > MAX_CHARS:
                raise RenderLimit(f"the chat template's text for these messages passed the render limit of "
                                  f"{MAX_CHARS:,} characters; send fewer or shorter messages, or fix the template")
            parts.append(part)
        return "".join(parts)
