"""Two hosts on one Linux machine, joined by a link you can shape, cut, delay and make
lossy: the PrfaaS cluster on a real network stack, for tests and benchmarks (root only).

The prefill side and the decode side are network namespaces. Between them, a TUN device
in each, and a forwarding thread in this process that copies packets from one to the
other: it drops them all while the link is ``down``, a share ``loss`` of them at random,
and holds each ``delay_s`` seconds (one way). The prefill side's egress (the states) is
rate-limited by the kernel's token bucket (``tc qdisc ... tbf``, :meth:`NetLab.shape`).
``tc netem`` would do delay and loss in the kernel; where the kernel lacks it (and
iptables' statistic match) this forwarder does them instead.

Example (as root)::

    lab = NetLab()                   # NetLab.why_not() says why it cannot run here
    lab.start()
    lab.shape(4.0)                   # 4 Mbit/s prefill -> decode
    p = lab.popen("prefill", [sys.executable, "-m", "hyla", "serve", ...])
    lab.set(down=True)               # an outage
    lab.run_in("decode", fn)         # call fn() from a thread inside the decode side
    lab.close()
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import os
import random
import select
import shutil
import struct
import subprocess
import threading
import time
import uuid

TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454CA, 0x0001, 0x1000
CLONE_NEWNET = 0x40000000


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


class NetLab:
    """The two namespaces (``prefill`` at ``prefill_ip``, ``decode`` at ``decode_ip``) and
    the link between them (see the module docstring)."""

    def __init__(self, prefill_ip: str = "10.77.0.1", decode_ip: str = "10.77.0.2",
                 seed: int = 0):
        tag = uuid.uuid4().hex[:6]
        self.ip = {"prefill": prefill_ip, "decode": decode_ip}
        self.ns = {"prefill": f"hyla-p-{tag}", "decode": f"hyla-d-{tag}"}
        self.dev = {"prefill": f"hytp{tag}", "decode": f"hytd{tag}"}
        self.down, self.loss, self.delay_s = False, 0.0, 0.0
        self.stats = {"forwarded": 0, "dropped": 0}
        self._rng = random.Random(seed)
        self._fds: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def why_not() -> str | None:
        """Why a NetLab cannot be built here (None: it can)."""
        if os.geteuid() != 0:
            return "needs root (network namespaces, TUN devices and tc)"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return f"`{tool}` is not installed"
        if not os.path.exists("/dev/net/tun"):
            return "/dev/net/tun is missing"
        probe = f"hyla-probe-{uuid.uuid4().hex[:6]}"
        try:
            r = _run("ip", "netns", "add", probe, check=False)
            if r.returncode:
                return f"`ip netns add` failed: {r.stderr.strip()}"
            r = _run("ip", "netns", "exec", probe, "ip", "link", "set", "lo", "up", check=False)
            if r.returncode:
                return f"`ip netns exec` failed: {r.stderr.strip()}"
        finally:
            _run("ip", "netns", "del", probe, check=False)
        return None

    def start(self) -> NetLab:
        """Build both sides and start forwarding (RuntimeError naming the step that
        failed; what was built is removed)."""
        try:
            for side in ("prefill", "decode"):
                _run("ip", "netns", "add", self.ns[side])
                fd = os.open("/dev/net/tun", os.O_RDWR)
                self._fds[side] = fd
                fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", self.dev[side].encode(),
                                                       IFF_TUN | IFF_NO_PI))
                _run("ip", "link", "set", self.dev[side], "netns", self.ns[side])
            for side, other in (("prefill", "decode"), ("decode", "prefill")):
                ex = ("ip", "netns", "exec", self.ns[side])
                _run(*ex, "ip", "addr", "add", self.ip[side], "peer", self.ip[other],
                     "dev", self.dev[side])
                _run(*ex, "ip", "link", "set", self.dev[side], "up")
                _run(*ex, "ip", "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, OSError) as e:
            err = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else e
            self.close()
            raise RuntimeError(f"building the network namespaces failed: {err}") from None
        self._thread = threading.Thread(target=self._forward, name="hyla-netlab", daemon=True)
        self._thread.start()
        return self

    def shape(self, mbit: float | None, burst_kbit: int = 32) -> None:
        """Rate-limit the prefill side's egress to ``mbit`` Mbit/s with tbf (None: no
        limit)."""
        ex = ("ip", "netns", "exec", self.ns["prefill"], "tc", "qdisc")
        _run(*ex, "del", "dev", self.dev["prefill"], "root", check=False)
        if mbit is not None:
            _run(*ex, "add", "dev", self.dev["prefill"], "root", "tbf", "rate",
                 f"{mbit}mbit", "burst", f"{burst_kbit}kbit", "latency", "2s")

    def set(self, *, down: bool | None = None, loss: float | None = None,
            delay_s: float | None = None) -> None:
        """Cut or restore the link, set its random packet loss (0..1) and one-way delay."""
        if down is not None:
            self.down = down
        if loss is not None:
            if not 0 <= loss < 1:
                raise ValueError(f"loss must be in [0, 1), got {loss}")
            self.loss = loss
        if delay_s is not None:
            self.delay_s = max(0.0, delay_s)

    def exec_args(self, side: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side]]

    def popen(self, side: str, args: list[str], **kw) -> subprocess.Popen:
        """Start ``args`` inside ``side`` (its own session, so it can be killed whole)."""
        return subprocess.Popen(self.exec_args(side) + list(args), start_new_session=True,
                                **kw)

    def run_in(self, side: str, fn, *args, timeout: float = 600):
        """``fn(*args)`` in a new thread that lives in ``side``'s network namespace (its
        sockets are that side's); its result, or its exception raised here."""
        box: dict = {}

        def target():
            try:
                fd = os.open(f"/run/netns/{self.ns[side]}", os.O_RDONLY)
                try:
                    libc = ctypes.CDLL(None, use_errno=True)
                    if libc.setns(fd, CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), "setns failed")
                finally:
                    os.close(fd)
                box["result"] = fn(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                box["error"] = e
        t = threading.Thread(target=target, daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} ran past {timeout} s")
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def _forward(self) -> None:
        a, b = self._fds["prefill"], self._fds["decode"]
        other = {a: b, b: a}
        held: list = []                              # (due, seq, fd, packet)
        seq = 0
        while not self._stop.is_set():
            now = time.monotonic()
            while held and held[0][0] <= now:
                _, _, fd, pkt = heapq.heappop(held)
                try:
                    os.write(fd, pkt)
                    self.stats["forwarded"] += 1
                except OSError:
                    pass
            wait = min(0.1, max(0.0, held[0][0] - now)) if held else 0.1
            try:
                ready, _, _ = select.select([a, b], [], [], wait)
            except (OSError, ValueError):
                return
            for fd in ready:
                try:
                    pkt = os.read(fd, 65536)
                except OSError:
                    return
                if self.down or (self.loss and self._rng.random() < self.loss):
                    self.stats["dropped"] += 1
                    continue
                if self.delay_s <= 0:
                    try:
                        os.write(other[fd], pkt)
                        self.stats["forwarded"] += 1
                    except OSError:
                        pass
                    continue
                seq += 1
                heapq.heappush(held, (time.monotonic() + self.delay_s, seq, other[fd], pkt))

    def close(self) -> None:
        """Stop forwarding and delete both namespaces (their processes should be gone)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        for ns in self.ns.values():
            _run("ip", "netns", "del", ns, check=False)
