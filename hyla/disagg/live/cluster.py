"""``hyla cluster``: a router, a remote prefill pool and a local PD pool on one machine,
each worker its own OS process (``python -m hyla serve --role ...``).

Across machines run the same roles by hand and point them at each other's addresses:
``--role prefill`` and ``--role decode`` workers, then ``--role router --prefill-workers
URL,... --decode-workers URL,...``.

A ``cluster.toml`` holds the same settings as the flags (underscores for dashes), e.g.::

    preset = "debug"          # or checkpoint = "runs/quickstart"
    port = 8000
    prefill_workers = 1
    decode_workers = 2
    link_gbps = 1.0
    threshold = 512
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field

import httpx


@dataclass(kw_only=True)
class ClusterSpec:
    """What ``hyla cluster`` starts. ``preset`` or ``checkpoint`` names the model (all
    workers must load the same one: the transfer checks a fingerprint)."""

    preset: str | None = None
    checkpoint: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_workers: int = 1
    decode_workers: int = 2
    link_gbps: float = 10.0
    threshold: int = 1024
    transfer_timeout: float = 30.0
    max_num_seqs: int = 16
    max_model_len: int = 2048
    threads: int = 1
    seed: int = 0
    api_key: str | None = None
    log_dir: str | None = None
    log_level: str = "warning"
    force_path: str | None = None                 # "local" / "remote": bypass the policy
    static_threshold: bool = False
    env: dict = field(default_factory=dict)      # extra environment for every worker

    def __post_init__(self) -> None:
        if self.preset is not None and self.checkpoint is not None:
            raise ValueError("give one of preset or checkpoint, not both")
        if self.prefill_workers < 0 or self.decode_workers < 1:
            raise ValueError(f"need prefill_workers >= 0 and decode_workers >= 1, got "
                             f"{self.prefill_workers}, {self.decode_workers}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in [1, 65535], got {self.port}")
        if not self.link_gbps > 0:
            raise ValueError(f"link_gbps must be > 0, got {self.link_gbps}")


def load_spec(path: str | None, **overrides) -> ClusterSpec:
    """A ClusterSpec from a TOML file (optional) and flag values (None: not given)."""
    values: dict = {}
    if path is not None:
        try:
            values = tomllib.loads(pathlib.Path(path).read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"cluster config {path!r}: {e}") from None
        known = {f.name for f in dataclasses.fields(ClusterSpec)}
        bad = sorted(set(values) - known)
        if bad:
            raise ValueError(f"cluster config {path!r}: unknown keys {bad}; expected some of "
                             f"{sorted(known)}")
    values |= {k: v for k, v in overrides.items() if v is not None}
    if values.get("preset") is not None and overrides.get("checkpoint") is not None:
        values.pop("preset")
    if values.get("checkpoint") is not None and overrides.get("preset") is not None:
        values.pop("checkpoint")
    return ClusterSpec(**values)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    role: str
    url: str
    popen: subprocess.Popen
    log: pathlib.Path


class Cluster:
    """The running processes of a ClusterSpec (see :func:`launch`)."""

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.log_dir = pathlib.Path(spec.log_dir or tempfile.mkdtemp(prefix="hyla-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []
        # The transfer channel's HMAC secret: the operator's, else a fresh one per cluster.
        from hyla.disagg.live.auth import cluster_secret
        self.secret = cluster_secret() or secrets.token_hex(32)

    @property
    def auth(self):
        """An ``httpx`` auth that signs ``/internal/*`` calls to this cluster's workers
        (``httpx.get(url, auth=cluster.auth)``): they refuse unsigned ones."""
        from hyla.disagg.live.internal_auth import InternalAuth, internal_key

        return InternalAuth(internal_key(self.secret), role="launcher")

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    def _model_args(self) -> list[str]:
        s = self.spec
        if s.checkpoint is not None:
            return ["--checkpoint", s.checkpoint]
        return ["--preset", s.preset or "debug", "--seed", str(s.seed)]

    def _start(self, role: str, name: str, port: int, extra: list[str]) -> Proc:
        s = self.spec
        log = self.log_dir / f"{name}.log"
        cmd = [sys.executable, "-m", "hyla", "serve", "--role", role, *self._model_args(),
               "--host", s.host, "--port", str(port), "--threads", str(s.threads),
               "--max-num-seqs", str(s.max_num_seqs), "--max-model-len", str(s.max_model_len),
               "--log-level", s.log_level, *extra]
        # Secrets travel in the environment (readable only by this user), never in argv.
        env = dict(os.environ, PYTHONUNBUFFERED="1", HYLA_CLUSTER_PARENT=str(os.getpid()),
                   HYLA_CLUSTER_SECRET=self.secret, **{k: str(v) for k, v in s.env.items()})
        env.pop("HYLA_CLUSTER_SECRET_FILE", None)
        if s.api_key:
            env["HYLA_API_KEY"] = s.api_key
        else:
            env.pop("HYLA_API_KEY", None)
        with open(log, "wb") as f:
            popen = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        p = Proc(role, f"http://{s.host}:{port}", popen, log)
        self.procs.append(p)
        return p

    def start_workers(self) -> None:
        s = self.spec
        for i in range(s.prefill_workers):
            self._start("prefill", f"prefill-{i}", free_port(s.host),
                        ["--link-gbps", str(s.link_gbps)])
        for i in range(s.decode_workers):
            self._start("decode", f"decode-{i}", free_port(s.host),
                        ["--transfer-timeout", str(s.transfer_timeout)])

    def start_router(self) -> None:
        s = self.spec
        pre = ",".join(p.url for p in self.procs if p.role == "prefill")
        dec = ",".join(p.url for p in self.procs if p.role == "decode")
        extra = ["--decode-workers", dec, "--link-gbps", str(s.link_gbps),
                 "--threshold", str(s.threshold), "--transfer-timeout", str(s.transfer_timeout)]
        if pre:
            extra += ["--prefill-workers", pre]
        if s.force_path:
            extra += ["--force-path", s.force_path]
        if s.static_threshold:
            extra += ["--static-threshold"]
        self._start("router", "router", s.port, extra)

    def wait_ready(self, procs: list[Proc], timeout: float, path: str) -> None:
        """Until each of ``procs`` answers ``path`` with 200; ValueError (with its log's
        tail) if one exits or the time runs out."""
        deadline = time.monotonic() + timeout
        pending = list(procs)
        while pending:
            for p in list(pending):
                if p.popen.poll() is not None:
                    raise ValueError(f"{p.role} worker exited with {p.popen.returncode} while "
                                     f"starting:\n{tail(p.log)}")
                headers = {"authorization": f"Bearer {self.spec.api_key}"} \
                    if self.spec.api_key else {}
                try:
                    if httpx.get(p.url + path, timeout=1.0, headers=headers,
                                 auth=self.auth).status_code == 200:
                        pending.remove(p)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise ValueError(f"{[p.role for p in pending]} not ready after {timeout:g} s:"
                                 f"\n{tail(pending[0].log)}")
            time.sleep(0.2)

    def stop(self, grace_s: float = 5.0) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(5)


def launch(spec: ClusterSpec, timeout: float = 300.0) -> Cluster:
    """Start every process of ``spec`` and wait until the router serves; the caller must
    :meth:`Cluster.stop` it (also on error: then it is stopped here)."""
    c = Cluster(spec)
    try:
        c.start_workers()
        c.wait_ready(list(c.procs), timeout, "/internal/info")
        c.start_router()
        c.wait_ready([c.procs[-1]], timeout, "/health")
    except BaseException:
        c.stop()
        raise
    return c


def tail(path: pathlib.Path, n: int = 3000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""
