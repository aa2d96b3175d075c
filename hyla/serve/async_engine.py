"""Run an Engine on a background thread and stream each request's outputs to asyncio.

The HTTP server's event loop never blocks on the model: requests and aborts go into an
inbox that the engine thread drains before each step, and outputs come back through
``loop.call_soon_threadsafe`` into one asyncio.Queue per request.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator

from hyla.serve.engine import Engine, StepOutput
from hyla.serve.metrics import EngineMetrics
from hyla.serve.sequence import SamplingParams


class QueueFull(RuntimeError):
    """Too many requests waiting: the client should retry later (HTTP 429)."""


class AsyncEngine:
    """Thread-backed asynchronous front of an Engine.

    Example:
        >>> import asyncio
        >>> from hyla.model import HylaLM, preset
        >>> from hyla.data.tokenizer import ByteTokenizer
        >>> eng = AsyncEngine(Engine(HylaLM(preset("debug")), ByteTokenizer()))
        >>> async def run():
        ...     p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        ...     return [o.token_ids async for o in eng.generate([1, 2, 3], p)]
        >>> len(asyncio.run(run())); eng.shutdown()
        3
    """

    def __init__(self, engine: Engine, max_waiting: int = 256):
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = EngineMetrics()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._arrivals: dict[str, float] = {}
        self._inbox_adds = 0         # requests handed to the thread, not yet in the engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._ids = itertools.count()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="hyla-engine", daemon=True)
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: in the inbox or in the scheduler's queue."""
        return self._inbox_adds + self.engine.scheduler.num_waiting

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, prefilled: tuple | None = None
                       ) -> AsyncIterator[StepOutput]:
        """Stream one request's outputs. Raises ValueError (bad request) or QueueFull
        before the first output; closing the iterator early aborts the request.

        ``prefilled=(first_token, SequenceState)``: the prompt was prefilled elsewhere;
        decoding continues from that state (the first token is not streamed again)."""
        if self.error is not None:
            raise RuntimeError(f"the engine thread failed: {self.error!r}")
        self.engine.check_request(prompt_ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        with self._lock:
            waiting = self.num_waiting
            if waiting >= self.max_waiting:
                raise QueueFull(f"{waiting} requests are waiting (limit {self.max_waiting})")
            self._inbox_adds += 1
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), q)
        self._arrivals[rid] = time.perf_counter()
        self._inbox.put(("add", rid, list(prompt_ids), params, prefilled))
        self._wake.set()
        finished = False
        try:
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:                 # client went away, or an error
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    # -- engine thread -----------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                _, rid, prompt, params, prefilled = msg
                with self._lock:
                    self._inbox_adds -= 1
                if rid not in self._streams:        # aborted before it got in
                    continue
                try:
                    if prefilled is None:
                        self.engine.add_request(prompt, params, rid, self._arrivals.get(rid))
                    else:
                        seq = self.engine.add_prefilled(prompt, *prefilled, params, rid,
                                                        self._arrivals.get(rid))
                        if seq.is_finished:         # the shipped first token ended it
                            self._deliver(rid, StepOutput(rid, [], "", True,
                                                          seq.finish_reason, [],
                                                          seq.num_prompt_tokens, 1))
                            self._forget(rid)
                except ValueError as e:
                    self._deliver(rid, e)
                    self._forget(rid)
            else:
                if self.engine.abort(msg[1]):
                    self.metrics.aborted(msg[1])
                self._forget(msg[1])

    def _loop(self) -> None:
        try:
            while not self._stop:
                self._drain()
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                now = time.perf_counter()
                self.metrics.observe(outputs, self._arrivals, now)
                for o in outputs:
                    self._deliver(o.request_id, o if o.error is None else
                                  RuntimeError(f"request {o.request_id} failed: {o.error}"))
                    if o.finished:
                        self._forget(o.request_id)
        except BaseException as e:  # noqa: BLE001 - surfaced to every waiting client
            self.error = e
            for rid in list(self._streams):
                self._deliver(rid, RuntimeError(f"engine failed: {e!r}"))

    def _forget(self, rid: str) -> None:
        self._streams.pop(rid, None)
        self._arrivals.pop(rid, None)
        self.metrics.forget(rid)

    def _deliver(self, rid: str, item) -> None:
        target = self._streams.get(rid)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)
