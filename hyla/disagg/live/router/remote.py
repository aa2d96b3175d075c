"""The router's remote path (a part of :class:`~hyla.disagg.live.router.LiveRouter`): the
policy's cost model on the measured link, shipping a request's prefill to a prefill worker
while a decode worker waits for its state, each transfer's deadlines, and what every
remote request tells the path's estimate (:mod:`hyla.disagg.live.router.links`).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import httpx

from hyla.disagg.live.router.links import Shipment
from hyla.disagg.policy import LOCAL
from hyla.model.sampler import TokenLogprob
from hyla.serve.engine import StepOutput

if TYPE_CHECKING:
    from hyla.disagg.live.router.workers import Worker


class _Fallback(Exception):
    """The remote path failed before any output: re-run locally. ``kind`` is the stable
    reason counted in ``fallback_reasons``; the message says the details."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


class WorkerFailed(Exception):
    """A decode worker failed (connection lost, engine error) while streaming."""

    def __init__(self, msg: str, sent: int):
        super().__init__(msg)
        self.sent = sent


def _lp(x: dict | None) -> TokenLogprob | None:
    return None if x is None else TokenLogprob(x["token"], x["logprob"],
                                               [tuple(t) for t in x["top"]])


def _out(d: dict, rid: str) -> StepOutput:
    lps = [_lp(x) for x in d.get("logprobs") or []]
    plps = d.get("prompt_logprobs")
    return StepOutput(rid, d["token_ids"], d["text"], d["finished"], d["finish_reason"], lps,
                      d["num_prompt_tokens"], d["num_output_tokens"],
                      prompt_logprobs=None if plps is None else [_lp(x) for x in plps])


class RemotePath:
    """The remote-path methods of LiveRouter (its ``links``, ``policy``, ``decode``,
    ``http``, ``cfg`` and request helpers)."""

    def _check_link(self, p: Worker, d: Worker, tokens: int, decision,
                    held: int = 0) -> Shipment | None:
        """The policy's cost model on the measured p -> d path: a Shipment if the state
        goes (without the rows of the ``held`` tokens d's cache holds), None (counted as a
        fallback) if it stays local."""
        link = self.links.link(p.url, d.url)
        nbytes = self.links.state_bytes(tokens - held)
        probe = False
        if not isinstance(decision, str):           # forced paths skip the cost model
            loc = [w for w in self.decode if w.healthy]
            local_q = min((w.info.get("queue_s", 0.0) for w in loc), default=0.0)
            dd = self.policy.check_link(
                decision, link, state_bytes=nbytes,
                local_prefill_s=local_q + tokens / self.local_tps,
                backlog_bytes=self.links.backlog.get((p.url, d.url), 0),
                now=self.links.now())
            if dd.target == LOCAL:
                self._fallback("link down" if dd.reason == "link_down"
                               else "link slower than local prefill",
                               f"{p.url} -> {d.url}: {link.gbps:.4g} Gbps, rtt "
                               f"{link.rtt_s:.3f} s")
                return None
            probe = dd.reason == "probe"
        # (the state's size is learnt from the tokens whose rows are shipped)
        return self.links.open(p.url, d.url, tokens - held, probe)

    def _waits(self, p: Worker, ship: Shipment, tokens: int) -> tuple[float, float]:
        """(the sender's deadline for the acknowledgement, the decode worker's wait for
        the state): from the path's estimate, the state's size and the prefill queue of a
        ``tokens``-token prompt, never over ``transfer_timeout_s``."""
        link = ship.link
        deadline = link.deadline_s(ship.nbytes, self.links.backlog.get(ship.key, 0))
        prefill_s = p.info.get("queue_s", 0.0) + p.inflight * tokens / self.remote_tps
        wait = min(self.cfg.transfer_timeout_s, deadline + 2 * prefill_s + 0.25)
        return min(deadline, wait), wait

    async def _remote(self, p: Worker, d: Worker, ids, params, rid, ship: Shipment,
                      held: int = 0):
        p.inflight += 1
        d.inflight += 1
        resp = prefill = first = None
        deadline, wait = self._waits(p, ship, len(ids))
        t0 = time.monotonic()
        try:
            body = self._body(ids, params, rid, True) | {"transfer_timeout_s": wait}
            resp = await self._open(d, body)
            lines = self._lines(d, resp, rid)
            prefill = asyncio.ensure_future(self.http.post(
                f"{p.url}/internal/prefill", timeout=wait + 30,
                json={"request_id": rid, "prompt_ids": ids, "params": params.as_dict(),
                      "dest": d.info["transfer_address"], "deadline_s": deadline,
                      "prefix_tokens": held}))
            prefill.add_done_callback(lambda t: self._verdict(ship, t, time.monotonic() - t0))
            first = asyncio.ensure_future(anext(lines))
            done, _ = await asyncio.wait({prefill, first}, return_when=asyncio.FIRST_COMPLETED)
            if prefill in done and first not in done:
                self._check_prefill(p, prefill)
            try:
                line = await first
            except WorkerFailed as e:
                if prefill.done():
                    self._check_prefill(p, prefill)
                if "did not complete within" in str(e):     # nothing arrived in time
                    ship.lost(time.monotonic() - t0)
                raise _Fallback("transfer failed", str(e)) from None
            yield _out(line, rid)
            async for x in lines:
                yield _out(x, rid)
        finally:
            p.inflight -= 1
            d.inflight -= 1
            if first is not None and not first.done():
                first.cancel()
            # the prefill worker's answer (the transfer's figures) may trail the first
            # token: let it finish in the background unless the request failed
            if prefill is None:
                ship.void()
            elif not prefill.done() and ship.done:
                prefill.cancel()
            if resp is not None:
                await resp.aclose()

    def _verdict(self, ship: Shipment, task, seconds: float) -> None:
        """What the prefill worker's answer says of the link (once per shipment)."""
        if task.cancelled() or task.exception() is not None:
            ship.void()
            return
        r = task.result()
        try:
            body = r.json()
        except ValueError:
            body = {}
        if r.status_code == 200:
            self.egress.add(int(body.get("bytes", 0)))
            ship.acked(body)
        elif "no acknowledgement" in str((body.get("transfer") or {}).get("error")):
            ship.lost(seconds)
        else:                       # rejected (corrupt, mismatched) or not prefilled
            ship.void()

    def _check_prefill(self, p: Worker, task) -> None:
        err = task.exception()
        if err is not None:
            if isinstance(err, httpx.TransportError):
                p.healthy, p.error = False, f"{type(err).__name__}: {err}"
            raise _Fallback("prefill worker failed",
                            f"prefill worker {p.url} failed: {type(err).__name__}: {err}")
        r = task.result()
        if r.status_code != 200:
            kind = "transfer failed" if r.status_code == 502 else "prefill worker failed"
            raise _Fallback(kind, f"prefill worker {p.url}: HTTP {r.status_code} "
                                  f"{r.text[:300]}")
