"""Discrete-event simulation (SimPy) of PD-disaggregated serving, with Prefill-as-a-Service.

Each simulated instance (one model replica, e.g. 8 GPUs) runs a real
:class:`hyla.serve.scheduler.Scheduler`, iteration by iteration: the scheduler picks the
step's prefill chunks and decode batch, :func:`hyla.disagg.sim.hardware.step_time` prices
them, and the sequences advance with dummy tokens (``ignore_eos``; ``max_tokens`` from the
trace). Every instance is simulated: no instance stands for a group.

Deployments (:class:`Deployment`), all prefill/decode disaggregated:

- ``homogeneous``: one cluster, ``local_prefill`` of its instances prefill, the rest decode;
  the state moves inside the cluster (RDMA, ``intra_gbps`` per transfer, no contention).
- ``naive``: every prefill runs in the remote cluster; all states cross the link.
- ``prfaas``: the routing policy (:class:`hyla.disagg.policy.PrfaasRouter`, built by
  :func:`hyla.disagg.policy.build_policy` from ``Deployment.policy`` as the live router
  builds its own) sends long incremental prefills to the remote cluster and keeps the rest
  on the local prefill instances; it observes the link and both queues every ``observe_s``
  and moves its threshold.

In every deployment the policy's ``pick`` chooses the instance of a pool that gets a
request (the least queued prefill, then the fewest requests), as it chooses live workers.

``colocated=True`` makes every local instance a PD instance, as a hyla PD worker is: one
scheduler that prefills local requests and decodes everything, in mixed steps (then
``local_prefill`` must be 0). ``SimConfig`` can also mirror hyla's own engine where the
simulator is checked against it: ``snapshot_interval`` cuts local prefill chunks at GLA
snapshot boundaries (the engine's prefix cache), ``prefill_max_seqs=1`` makes a prefill
instance serial (a hyla prefill worker), and ``request_latency_s`` delays every request by
the serving path's fixed cost (HTTP hops, router, tokenizer), measured on the idle system.
``host_cores`` > 0 puts every instance on one machine's CPU cores
(:class:`hyla.disagg.sim.cpu.HostCPU`, processor sharing): engine steps, ``request_cpu_s``
of serving work per request (before it is placed) and ``token_cpu_s`` per streamed token
(in the background) all share them.

The inter-cluster link is one FIFO pipe of ``link_gbps`` plus ``link_latency_s``; a state
is sent once its prefill ends (the published system pipelines layers; at these sizes a
transfer takes tens of milliseconds either way). Prefix caches are per cluster: a session's
next turn finds its previous context in the local cluster once that turn finished decoding,
and its previous prompt in the cluster that prefilled it; linear-attention states only
match exactly at those boundaries. Cache capacity is unbounded (an assumption).

TTFT is measured up to the moment the decode instance holds the state (prefill, queueing
and the transfer), or for a request prefilled on a PD instance to the end of the step that
samples its first token; TPOT is the mean time per later token.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import simpy

from hyla.disagg.policy import LOCAL, REMOTE, RouterConfig, build_policy
from hyla.disagg.sim.cpu import HostCPU
from hyla.disagg.sim.hardware import InstanceProfile, ModelSpec, step_time
from hyla.disagg.sim.metrics import summarize
from hyla.disagg.sim.workload import Request
from hyla.serve.scheduler import Scheduler, SchedulerConfig
from hyla.serve.sequence import SamplingParams, Sequence

KINDS = ("homogeneous", "naive", "prfaas")


@dataclass(kw_only=True)
class Deployment:
    """Hardware and policy of one deployment. ``local_prefill``: local instances that
    prefill (the rest decode). ``remote``: instances of the remote prefill cluster.
    ``colocated``: every local instance prefills and decodes (``local_prefill`` = 0).
    ``policy``: the routing policy's knobs (threshold, adaptation; its ``link_gbps`` is
    replaced by the simulated link's, ``SimConfig.link_gbps``)."""

    name: str
    kind: str
    local: InstanceProfile
    local_instances: int
    local_prefill: int
    remote: InstanceProfile | None = None
    remote_instances: int = 0
    policy: RouterConfig = field(default_factory=RouterConfig)
    colocated: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"deployment kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind != "homogeneous" and (self.remote is None or self.remote_instances < 1):
            raise ValueError(f"{self.kind} needs a remote prefill cluster")
        if self.colocated:
            if self.local_prefill != 0 or self.local_instances < 1:
                raise ValueError(f"{self.name}: colocated PD instances need local_prefill=0 "
                                 f"and >= 1 local instance, got {self.local_prefill} of "
                                 f"{self.local_instances}")
            return
        n_dec = self.local_instances - self.local_prefill
        need_local_prefill = self.kind == "homogeneous"
        if n_dec < 1 or self.local_prefill < int(need_local_prefill):
            raise ValueError(f"{self.name}: need >= 1 decode instance and "
                             f"{'>= 1' if need_local_prefill else '>= 0'} prefill instances, "
                             f"got {self.local_prefill} of {self.local_instances}")

    def gpus(self) -> int:
        return self.local.gpus * self.local_instances + (
            self.remote.gpus * self.remote_instances if self.remote else 0)


@dataclass(kw_only=True)
class SimConfig:
    link_gbps: float = 100.0
    link_latency_s: float = 0.005
    intra_gbps: float = 400.0
    observe_s: float = 5.0
    prefill_chunk: int = 16_384
    max_num_seqs: int = 256
    block_size: int = 256
    ttft_base_s: float = 2.0        # SLO: TTFT <= base + incremental tokens / ttft_tok_s
    ttft_tok_s: float = 2_000.0
    tpot_slo_s: float = 0.1
    prefill_max_seqs: int = 16      # sequences a prefill instance batches in one step
    snapshot_interval: int = 0      # > 0: cut local prefill chunks as hyla's prefix cache does
    request_latency_s: float = 0.0  # fixed serving-path delay before a request is placed
    kv_blocks: int | None = None    # KV blocks a decode/PD instance has (None: all that fit)
    host_cores: float = 0.0         # > 0: all instances share this many CPU cores
    request_cpu_s: float = 0.0      # serving CPU work per request (with host_cores)
    token_cpu_s: float = 0.0        # serving CPU work per streamed token (with host_cores)


class Instance:
    """One replica: a Scheduler and the SimPy process that runs its engine steps.

    ``role``: "prefill" (prefill only, the state is shipped), "decode" (decode shipped
    states) or "pd" (prefill local requests and decode everything, in mixed steps)."""

    def __init__(self, sim: Sim, name: str, prof: InstanceProfile, role: str):
        self.sim, self.name, self.prof, self.role = sim, name, prof, role
        m, c = sim.model, sim.cfg
        if role == "prefill":
            cfg = SchedulerConfig(max_num_seqs=c.prefill_max_seqs,
                                  max_num_batched_tokens=c.prefill_chunk,
                                  max_model_len=1 << 22, enable_prefix_caching=False)
        else:
            free = prof.free_bytes(m) - c.max_num_seqs * m.state_bytes
            if free <= 0:
                raise ValueError(f"{name}: {c.max_num_seqs} sequences' states do not fit "
                                 f"{prof.label()} beside the weights")
            blocks = int(free // (c.block_size * m.kv_bytes_per_token)) \
                if m.kv_bytes_per_token else 0
            if c.kv_blocks is not None and m.kv_bytes_per_token:
                blocks = c.kv_blocks
            snapshots = role == "pd" and c.snapshot_interval > 0 and m.state_bytes > 0
            cfg = SchedulerConfig(max_num_seqs=c.max_num_seqs,
                                  max_num_batched_tokens=c.prefill_chunk if role == "pd"
                                  else c.max_num_seqs,
                                  max_model_len=1 << 22, block_size=c.block_size,
                                  num_kv_blocks=blocks, enable_prefix_caching=snapshots,
                                  num_state_snapshots=c.max_num_seqs if snapshots else 0,
                                  snapshot_interval=c.snapshot_interval or 512)
        self.sched = Scheduler(cfg)
        self.queued_tokens = 0          # prefill tokens not yet computed
        self.busy_s = 0.0
        self.wake = sim.env.event()
        sim.env.process(self.run())

    def add(self, seq: Sequence) -> None:
        if seq.external_state is None:
            self.queued_tokens += seq.num_prompt_tokens - seq.num_computed_tokens
        self.sched.add(seq)
        if not self.wake.triggered:
            self.wake.succeed()

    def load(self) -> int:
        return self.sched.num_running + self.sched.num_waiting

    @property
    def inflight(self) -> int:
        """Requests it holds (what the policy's ``pick`` weighs after queued tokens)."""
        return self.sched.num_running + self.sched.num_waiting

    def run(self):
        env, m = self.sim.env, self.sim.model
        while True:
            out = self.sched.schedule() if self.sched.has_unfinished() else None
            if out is None or out.is_empty:
                self.wake = env.event()
                yield self.wake
                continue
            chunks = [(c.start, c.num_tokens) for c in out.prefills]
            ctx = sum(s.num_tokens for s in out.decodes)
            dt = step_time(self.prof, m, chunks, ctx, len(out.decodes))
            cpu = self.sim.cpu
            yield cpu.work(dt) if cpu is not None else env.timeout(dt)
            self.busy_s += dt
            self.queued_tokens -= sum(n for _, n in chunks)
            sampled = dict.fromkeys((s.request_id for s in out.decodes), 0)
            for c in out.prefills:
                if c.samples:
                    sampled[c.seq.request_id] = 0
            if cpu is not None and self.role != "prefill" and self.sim.cfg.token_cpu_s:
                cpu.work(len(sampled) * self.sim.cfg.token_cpu_s)    # streaming them out
            if self.role == "pd":
                # a local request's first token: its first sample, from a prefill chunk or
                # (when the last prompt token is left over) a decode step; a shipped state
                # already recorded it on arrival
                for rid in sampled:
                    self.sim.rec[rid].setdefault("first_token", env.now)
            for seq in self.sched.update(out, sampled):
                self.sim.on_finished(self, seq)


class Sim:
    """One simulation run: ``Sim(model, deployment, cfg).run(requests) -> metrics dict``."""

    def __init__(self, model: ModelSpec, dep: Deployment, cfg: SimConfig | None = None):
        self.model, self.dep, self.cfg = model, dep, cfg or SimConfig()
        self.env = simpy.Environment()
        self.link = simpy.Resource(self.env, capacity=1)
        self.cpu = HostCPU(self.env, self.cfg.host_cores) if self.cfg.host_cores else None
        n_dec = dep.local_instances - dep.local_prefill
        self.local_p = [Instance(self, f"lp{i}", dep.local, "prefill")
                        for i in range(dep.local_prefill)]
        role = "pd" if dep.colocated else "decode"
        self.decode = [Instance(self, f"d{i}", dep.local, role) for i in range(n_dec)]
        self.remote_p = [Instance(self, f"rp{i}", dep.remote, "prefill")
                         for i in range(dep.remote_instances)] if dep.remote else []
        self.router = build_policy(dataclasses.replace(dep.policy,
                                                       link_gbps=self.cfg.link_gbps))
        self.reqs: dict[str, Request] = {}
        self.rec: dict[str, dict] = {}
        self.cache = {LOCAL: {}, REMOTE: {}}      # session -> cached prefix tokens
        self.egress_bytes = 0.0
        self._window_bytes = 0.0
        self._fail_budget, self._fails, self.stopped_early = None, 0, False

    # -- routing -------------------------------------------------------------------------
    def _cached(self, r: Request) -> dict[str, int]:
        if r.prefix_len == 0:
            return {LOCAL: 0, REMOTE: 0}
        return {k: min(v.get(r.session, 0), r.prefix_len) for k, v in self.cache.items()}

    def _place(self, r: Request) -> tuple[str, int]:
        """(cluster, cached tokens) for a request's prefill, per the deployment's policy."""
        cached = self._cached(r)
        kind = self.dep.kind
        if kind == "homogeneous":
            return LOCAL, cached[LOCAL]
        if kind == "naive":
            return REMOTE, cached[REMOTE]
        d = self.router.route(r.prompt_len, cached, self.env.now)
        if d.cache_transfer is not None:
            self.egress_bytes += self.model.transfer_bytes(d.cache_transfer[2]) \
                if d.cache_transfer[0] == REMOTE else 0.0
        if d.target == LOCAL and not self.local_p and not self.dep.colocated:
            # No local prefill instance: the deployment cannot keep it local.
            return REMOTE, cached[REMOTE]
        return d.target, d.cached_tokens

    def arrive(self, r: Request):
        yield self.env.timeout(max(0.0, r.arrival - self.env.now) + self.cfg.request_latency_s)
        if self.cpu is not None and self.cfg.request_cpu_s:
            yield self.cpu.work(self.cfg.request_cpu_s)
        rid = str(r.rid)
        self.reqs[rid] = r
        cluster, cached = self._place(r)
        cached = min(cached, r.prompt_len - 1)
        self.rec[rid] = {"arrival": r.arrival, "cluster": cluster, "cached": cached,
                         "incremental": r.prompt_len - cached}
        pd = cluster == LOCAL and self.dep.colocated
        pool = self.remote_p if cluster == REMOTE else (self.decode if pd else self.local_p)
        inst = self.router.pick(pool)
        # A PD instance's prefix cache hashes the prompt: give every request its own ids.
        ids = [r.rid + 1] * r.prompt_len if pd and self.cfg.snapshot_interval else \
            _prompt(r.prompt_len)
        seq = Sequence(rid, ids, SamplingParams(max_tokens=r.output_len if pd else 1,
                                                ignore_eos=True), arrival_time=self.env.now)
        seq.num_computed_tokens = cached
        inst.add(seq)

    # -- completion ----------------------------------------------------------------------
    def on_finished(self, inst: Instance, seq: Sequence) -> None:
        rid, now = seq.request_id, self.env.now
        r, rec = self.reqs[rid], self.rec[rid]
        if inst.role == "prefill":
            rec["prefill_done"] = now
            cluster = REMOTE if inst in self.remote_p else LOCAL
            self.cache[cluster][r.session] = r.prompt_len
            self.env.process(self.ship(r, seq, cluster))
        else:
            self.cache[LOCAL][r.session] = r.prompt_len + r.output_len
            self._finish(rid)

    def ship(self, r: Request, seq: Sequence, cluster: str):
        nbytes = self.model.transfer_bytes(r.prompt_len)
        if cluster == REMOTE:
            with self.link.request() as req:
                yield req
                yield self.env.timeout(nbytes * 8 / (self.cfg.link_gbps * 1e9))
            self.egress_bytes += nbytes
            self._window_bytes += nbytes
            yield self.env.timeout(self.cfg.link_latency_s)
        else:
            yield self.env.timeout(nbytes * 8 / (self.cfg.intra_gbps * 1e9))
        rid = str(r.rid)
        self.rec[rid]["first_token"] = self.env.now
        if r.output_len <= 1:
            self._finish(rid)
            return
        dseq = Sequence(rid, seq.prompt_ids, SamplingParams(max_tokens=r.output_len,
                                                            ignore_eos=True),
                        arrival_time=r.arrival)
        dseq.num_computed_tokens = r.prompt_len
        dseq.output_ids.append(0)
        dseq.external_state = True
        self.router.pick(self.decode, prefill=False).add(dseq)

    def _finish(self, rid: str) -> None:
        rec = self.rec[rid]
        rec["done"] = self.env.now
        self._n_left -= 1
        if self._n_left == 0 and not self._done.triggered:
            self._done.succeed()
        if self._fail_budget is not None and not self._meets_slo(self.reqs[rid], rec):
            self._fails += 1
            if self._fails > self._fail_budget and not self._done.triggered:
                self.stopped_early = True
                self._done.succeed()

    def _meets_slo(self, r: Request, rec: dict) -> bool:
        """Both SLOs, for a finished request (as :func:`~hyla.disagg.sim.metrics.summarize`
        counts them)."""
        c = self.cfg
        tt = rec["first_token"] - r.arrival
        tp = (rec["done"] - rec["first_token"]) / (r.output_len - 1) if r.output_len > 1 else 0
        return tt <= c.ttft_base_s + rec["incremental"] / c.ttft_tok_s and tp <= c.tpot_slo_s

    # -- short-timescale control -----------------------------------------------------------
    def _queue_s(self, pool: list[Instance]) -> float:
        """Seconds of prefill queued on a pool's instances, at their prefill speed."""
        if not pool:
            return 0.0
        rate = sum(1.0 / step_time(i.prof, self.model, [(0, 8192)], 0) * 8192 for i in pool)
        return sum(i.queued_tokens for i in pool) / rate

    def observer(self):
        c = self.cfg
        while True:
            yield self.env.timeout(c.observe_s)
            gbps = self._window_bytes * 8 / c.observe_s / 1e9
            self._window_bytes = 0.0
            self.router.observe(self.env.now, egress_gbps=gbps,
                                remote_queue_s=self._queue_s(self.remote_p),
                                local_queue_s=self._queue_s(
                                    self.decode if self.dep.colocated else self.local_p))

    def run(self, requests: list[Request], horizon_s: float | None = None,
            stop_below: float | None = None) -> dict:
        """Simulate ``requests`` to completion (or ``horizon_s``); returns the metrics.

        ``stop_below``: stop as soon as so many requests have missed an SLO that the SLO
        attainment must end below this fraction (the run's verdict is then known; its
        metrics cover what finished, ``stopped_early`` is True and ``slo_attainment`` is an
        upper bound below ``stop_below``). Capacity searches use it: runs above a
        deployment's capacity are most of their cost.
        """
        for r in requests:
            self.env.process(self.arrive(r))
        if self.dep.kind == "prfaas":
            self.env.process(self.observer())
        self._n_left = len(requests)
        self._fails, self.stopped_early = 0, False
        self._fail_budget = None if stop_below is None else \
            len(requests) - math.ceil(stop_below * len(requests) - 1e-9)
        self._done = done = self.env.event()
        self.env.run(until=done if horizon_s is None else simpy.AnyOf(
            self.env, [done, self.env.timeout(horizon_s)]))
        return summarize(self, requests)


_PROMPTS: dict[int, list[int]] = {}


def _prompt(n: int) -> list[int]:
    """Dummy prompt ids (shared lists: the simulator never reads or mutates them)."""
    p = _PROMPTS.get(n)
    if p is None:
        p = _PROMPTS[n] = [0] * n
        if len(_PROMPTS) > 4096:
            _PROMPTS.clear()
    return p
