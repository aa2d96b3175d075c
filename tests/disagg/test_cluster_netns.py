"""A prefill worker and a decode worker (+ router) in two Linux network namespaces joined
by a veth pair whose prefill side is shaped with ``tc`` (tbf): the state crosses a
real, slow link. Needs root, ``ip netns`` and ``tc``; skipped (saying why) otherwise."""

import json
import os
import re
import shutil
import subprocess
import sys
import uuid

import pytest

P_IP, D_IP = "10.77.0.1", "10.77.0.2"


def _run(*cmd, check=True):
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
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


@pytest.fixture(scope="module")
def netns():
    why = _why_not()
    if why:
        pytest.skip(why)
    tag = uuid.uuid4().hex[:6]
    nsp, nsd, vp, vd = f"hyla-p-{tag}", f"hyla-d-{tag}", f"hp{tag}", f"hd{tag}"
    try:
        _run("ip", "netns", "add", nsp)
        _run("ip", "netns", "add", nsd)
        _run("ip", "link", "add", vp, "type", "veth", "peer", "name", vd)
        _run("ip", "link", "set", vp, "netns", nsp)
        _run("ip", "link", "set", vd, "netns", nsd)
        for ns, dev, ip in ((nsp, vp, P_IP), (nsd, vd, D_IP)):
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", dev)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        # The cross-cluster link: 20 Mbit/s out of the prefill side (token bucket filter).
        r = _run("ip", "netns", "exec", nsp, "tc", "qdisc", "add", "dev", vp, "root", "tbf",
                 "rate", "20mbit", "burst", "32kbit", "latency", "400ms", check=False)
        if r.returncode:
            pytest.skip(f"tc cannot shape the veth (tbf): {r.stderr.strip()}")
        yield nsp, nsd, vp
    finally:
        _run("ip", "netns", "del", nsp, check=False)
        _run("ip", "netns", "del", nsd, check=False)


def _start(ns, log, *args):
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "hyla", "serve", "--preset", "debug",
         "--threads", "1", "--log-level", "warning", "--max-model-len", "1024", *args],
        stdout=log, stderr=subprocess.STDOUT,
        # across machines the transfer channel needs a shared secret (HMAC on every frame)
        env=dict(os.environ, PYTHONUNBUFFERED="1", HYLA_CLUSTER_SECRET="netns-test-secret"),
        start_new_session=True)


_CLIENT = """
import httpx, json, sys, time
base = sys.argv[1]
deadline = time.monotonic() + 150
while True:
    try:
        if httpx.get(base + "/health", timeout=1).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    if time.monotonic() > deadline:
        sys.exit("router not ready")
    time.sleep(0.3)
prompt = list(range(1, 200)) * 3          # 597 tokens: remote, ~40 KB of state
r = httpx.post(base + "/v1/completions", timeout=120,
               json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
print(json.dumps({"status": r.status_code, "body": r.json(),
                  "cluster": httpx.get(base + "/cluster").json()}))
"""


def test_state_crosses_a_shaped_veth_link(netns, tmp_path):
    nsp, nsd, vp = netns
    procs = []
    log = open(tmp_path / "roles.log", "w+b")  # noqa: SIM115 - closed below
    try:
        procs.append(_start(nsp, log, "--role", "prefill", "--host", P_IP, "--port", "8101"))
        procs.append(_start(nsd, log, "--role", "decode", "--host", D_IP, "--port", "8201"))
        procs.append(_start(nsd, log, "--role", "router", "--host", D_IP, "--port", "8000",
                            "--prefill-workers", f"http://{P_IP}:8101",
                            "--decode-workers", f"http://{D_IP}:8201", "--threshold", "64",
                            "--link-gbps", "0.02"))
        r = subprocess.run(["ip", "netns", "exec", nsd, sys.executable, "-c", _CLIENT,
                            f"http://{D_IP}:8000"], capture_output=True, text=True, timeout=240)
        log.seek(0)
        logs = log.read().decode(errors="replace")[-3000:]
        assert r.returncode == 0, r.stderr[-2000:] + logs
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["status"] == 200, out
        assert out["body"]["usage"]["completion_tokens"] == 8
        counts = out["cluster"]["counts"]
        assert counts["remote_ok"] == 1 and counts["fallback_local"] == 0, out["cluster"]
        pre = [w for w in out["cluster"]["workers"] if w["role"] == "prefill"][0]
        assert pre["healthy"]
        # The state went through the shaped qdisc on the prefill side of the veth.
        stats = _run("ip", "netns", "exec", nsp, "tc", "-s", "qdisc", "show", "dev", vp).stdout
        sent = max(int(x) for x in re.findall(r"Sent (\d+) bytes", stats))
        assert sent > 30_000, stats
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
            p.wait(10)
        log.close()
