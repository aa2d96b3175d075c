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
from collections.abc import AsyncIterator, Callable

from hyla.serve.engine import Engine, StepOutput
from hyla.serve.metrics import EngineMetrics
from hyla.serve.sequence import SamplingParams


class QueueFull(RuntimeError):
    """Too many requests waiting: the client should retry later (HTTP 429)."""


class RequestFailed(RuntimeError):
    """One request's output could not be produced; the engine and the other requests go on
    (HTTP 503 before its first token, an error event after)."""


class EngineFailed(RuntimeError):
    """The engine's batched step failed: every request it held is answered with this, and
    the engine was restarted (or, past ``max_restarts``, is dead: ``AsyncEngine.error``)."""


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

    def __init__(self, engine: Engine, max_waiting: int = 256, *, max_restarts: int = 3,
                 restart_window_s: float = 60.0, on_dead: Callable[[BaseException], None]
                 | None = None):
        self.engine = engine
        self.max_waiting = max_waiting
        # A failed step (the batched forward pass) fails the requests it held and restarts
        # the engine; more than max_restarts failures within restart_window_s and it is
        # dead: /health answers 503 and on_dead (the server's exit) is called.
        self.max_restarts, self.restart_window_s, self.on_dead = (max_restarts,
                                                                   restart_window_s, on_dead)
        self.restarts = 0
        self.last_failure: str | None = None
        self._failures: list[float] = []
        self.metrics = EngineMetrics()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._arrivals: dict[str, float] = {}
        self._groups: dict[str, str] = {}      # request id -> its batch request's id
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

    @property
    def num_queued(self) -> int:
        """Requests that will have to wait for a state slot: those not yet running beyond
        the free slots. A burst that the free slots absorb queues nothing (the 429 limit
        counts these, not requests merely still in the inbox)."""
        s = self.engine.scheduler
        free = max(0, self.engine.config.max_num_seqs - s.num_running)
        return max(0, self.num_waiting - free)

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, prefilled: tuple | None = None,
                       group: str | None = None) -> AsyncIterator[StepOutput]:
        """Stream one request's outputs. Raises ValueError (bad request) or QueueFull
        before the first output; closing the iterator early aborts the request.

        ``prefilled=(first_token, SequenceState)``: the prompt was prefilled elsewhere;
        decoding continues from that state (the first token is not streamed again).
        ``group``: shared by the prompts of one batch request (fair scheduling:
        :meth:`Engine.add_request`)."""
        if not self.alive:
            raise EngineFailed(f"the engine is dead: {self.error!r}")
        self.engine.check_request(prompt_ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        with self._lock:
            waiting = self.num_queued
            if waiting >= self.max_waiting:
                raise QueueFull(f"{waiting} requests are waiting (limit {self.max_waiting})")
            self._inbox_adds += 1
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), q)
        self._arrivals[rid] = time.perf_counter()
        if group is not None:
            self._groups[rid] = group
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
                        group = self._groups.pop(rid, None)
                        self.engine.add_request(prompt, params, rid, self._arrivals.get(rid),
                                                **({"group": group} if group else {}))
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
        while not self._stop:
            try:
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
                                  RequestFailed(f"request {o.request_id} failed: {o.error}"))
                    if o.finished:
                        self._forget(o.request_id)
            except Exception as e:  # noqa: BLE001 - the step failed: restart or die
                if not self._restart(e):
                    return
            except BaseException as e:  # noqa: BLE001 - surfaced to every waiting client
                self._die(e)
                return

    def _restart(self, err: Exception) -> bool:
        """After a failed step: fail every request the engine held and build a fresh engine
        (same model, tokenizer and config: new state buffers, scheduler and caches). False
        (and dead) past ``max_restarts`` failures in ``restart_window_s``, or if the new
        engine cannot be built."""
        now = time.monotonic()
        self._failures = [t for t in self._failures if now - t < self.restart_window_s] + [now]
        self.last_failure = f"{type(err).__name__}: {err}"
        if len(self._failures) > self.max_restarts:
            self._die(err)
            return False
        old = self.engine
        try:
            self.engine = type(old)(old.model, old.tokenizer, old.config,
                                    draft_model=old.draft_model)
        except Exception as e:  # noqa: BLE001
            self._die(e)
            return False
        self.restarts += 1
        for rid in list(self._streams):
            self._deliver(rid, EngineFailed(f"the engine step failed ({self.last_failure}); "
                                            "the engine was restarted: retry the request"))
            self._forget(rid)
        return True

    def _die(self, err: BaseException) -> None:
        self.error = err
        if self.on_dead is not None:
            try:
                self.on_dead(err)
            except Exception:  # noqa: BLE001, S110 - nothing more to tell anyone
                pass
        for rid in list(self._streams):
            self._deliver(rid, EngineFailed(f"engine failed: {err!r}"))

    def _forget(self, rid: str) -> None:
        self._streams.pop(rid, None)
        self._arrivals.pop(rid, None)
        self._groups.pop(rid, None)
        self.metrics.forget(rid)

    def _deliver(self, rid: str, item) -> None:
        target = self._streams.get(rid)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)
