"""`EngineDriver`: the one background thread that owns an engine.

It applies queued submit / abort commands between `engine.step()` calls and hands each request's outputs to
that request's asyncio queue (`(tag, RequestOutput)`, or `(tag, exception)` when the request failed), so
the event loop never blocks on the model.

A failing request fails alone: the engine itself isolates a request whose logits are not finite or whose
forward raises (it re-runs the suspects of a failed batch one per step) and reports it as an output with
finish_reason "error", which fails only that request here; a `SamplingError` raised by `engine.step()`
fails only the requests of its rows. Any other exception from the engine (a bug outside the forward) fails
every request in flight, since nothing tells whose it was; the thread keeps serving either way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from .metrics import ServerMetrics
from .request import SamplingParams

log = logging.getLogger("k3.serve.driver")


class RequestFailed(RuntimeError):
    """The engine could not finish this request (the others in flight were not affected)."""


@dataclass
class _Track:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    tag: int
    params: SamplingParams
    arrival: float
    first: float | None = None
    last: float | None = None


class EngineDriver:
    """Runs `engine.step()` in one background thread; every engine call happens on that thread."""

    def __init__(self, engine, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics
        self.stats: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._cmds: deque = deque()
        self._wake = threading.Event()
        self._tracks: dict[str, _Track] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- control (any thread)
    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="k3-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def pending(self) -> int:
        """Engine requests submitted and not yet finished, failed or aborted."""
        with self._lock:
            return len(self._tracks)

    def submit(self, rid: str, prompt: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop,
               queue: asyncio.Queue, tag: int = 0, group: str | None = None) -> concurrent.futures.Future:
        """Queue a request (in fairness `group`); the future resolves once the engine accepted it (or holds
        its ValueError)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._tracks[rid] = _Track(loop, queue, tag, params, time.monotonic())
            self._cmds.append(("submit", rid, prompt, params, group, fut))
        self._wake.set()
        return fut

    def abort(self, rid: str) -> None:
        """Stop a request; no more outputs are delivered for it."""
        with self._lock:
            if self._tracks.pop(rid, None) is None:
                return
            self._cmds.append(("abort", rid))
        self._wake.set()

    # -- engine thread
    def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            self._commands()
            try:
                busy = self.engine.has_unfinished()
            except Exception:  # noqa: BLE001 - a broken engine must not kill the thread
                log.exception("engine.has_unfinished failed")
                busy = False
            if not busy:
                self._wake.wait(0.5)
                continue
            try:
                outs = self.engine.step()
            except Exception as e:  # noqa: BLE001
                self._step_failed(e)
                continue
            self._dispatch(outs)
            self._refresh_stats()
        self._fail_all(RuntimeError("the server is shutting down"))

    def _commands(self) -> None:
        while True:
            with self._lock:
                if not self._cmds:
                    break
                cmd = self._cmds.popleft()
            if cmd[0] == "submit":
                _, rid, prompt, params, group, fut = cmd
                try:
                    self.engine.submit(prompt, params, request_id=rid, group=group)
                except Exception as e:  # noqa: BLE001 - reported to the request
                    with self._lock:
                        self._tracks.pop(rid, None)
                    fut.set_exception(e)
                else:
                    fut.set_result(rid)
            else:
                with contextlib.suppress(Exception):
                    self.engine.abort(cmd[1])
        self._refresh_stats()

    def _refresh_stats(self) -> None:
        try:
            self.stats = dict(self.engine.stats())
        except Exception:  # noqa: BLE001
            log.exception("engine.stats failed")

    def _step_failed(self, e: Exception) -> None:
        bad = getattr(e, "params", None)   # SamplingError: the SamplingParams objects of the failed rows
        if isinstance(bad, list) and bad:
            ids = {id(p) for p in bad}
            with self._lock:
                rids = [rid for rid, tr in self._tracks.items() if id(tr.params) in ids]
            if rids:
                log.warning("failing %d request(s) alone: %s", len(rids), e)
                for rid in rids:
                    self._fail_one(rid, RequestFailed(str(e)))
                self._refresh_stats()
                return
        log.exception("engine.step failed; failing the requests in flight", exc_info=e)
        self._fail_all(e)

    def _dispatch(self, outs) -> None:
        now = time.monotonic()
        m = self.metrics
        for out in outs:
            with self._lock:
                tr = self._tracks.get(out.request_id)
                if tr is not None and out.finished:
                    del self._tracks[out.request_id]
            if tr is None:
                continue
            if out.finished and out.finish_reason == "error":
                if m is not None:
                    m.request_finished("error")
                self._put(tr, RequestFailed(f"the engine could not finish request {out.request_id!r}"
                                             + (f": {out.stop_reason}" if out.stop_reason else "")))
                continue
            k = len(out.new_token_ids)
            if m is not None and k:
                m.generation_tokens.inc(k)
                if tr.first is None:   # tokens after the first in that same output have no measurable gap
                    m.ttft.observe(now - tr.arrival)
                    m.prompt_tokens.inc(len(out.prompt_token_ids))
                    tr.first = now
                else:
                    for _ in range(k):
                        m.itl.observe((now - tr.last) / k)
                tr.last = now
            if m is not None and out.finished:
                m.e2e.observe(now - tr.arrival)
                m.request_finished(out.finish_reason or "unknown")
            self._put(tr, out)

    def _put(self, tr: _Track, item) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            tr.loop.call_soon_threadsafe(tr.queue.put_nowait, (tr.tag, item))

    def _fail_one(self, rid: str, exc: BaseException) -> None:
        with self._lock:
            tr = self._tracks.pop(rid, None)
        with contextlib.suppress(Exception):
            self.engine.abort(rid)
        if tr is not None:
            if self.metrics is not None:
                self.metrics.request_finished("error")
            self._put(tr, exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            tracks, self._tracks = self._tracks, {}
            cmds, self._cmds = list(self._cmds), deque()
        for cmd in cmds:
            if cmd[0] == "submit":
                cmd[-1].set_exception(exc)
        for rid, tr in tracks.items():
            with contextlib.suppress(Exception):
                self.engine.abort(rid)
            self._put(tr, exc)
        self._refresh_stats()
