"""The transfer channel is authenticated and validates every field (issue 15, items 5-6):
forged, unsigned or malformed frames are dropped and counted and the receiver goes on; a
sender ships only to registered destinations through a bounded socket cache."""

import asyncio
import json
import time

import pytest
import zmq

from hyla.disagg.live.transfer.frames import (
    PROTOCOL,
    TransferAssembler,
    encode_transfer,
    frame_mac,
    transfer_key,
)
from hyla.disagg.live.transfer.net import StateReceiver, StateSender
from hyla.model import preset
from hyla.model.state import SequenceState

KEY = transfer_key("cluster-secret")


def _state():
    return SequenceState.empty(preset("debug"))


def _push(address: str, msgs: list[list], key: bytes | None) -> None:
    s = zmq.Context.instance().socket(zmq.DEALER)   # the receiver is a ROUTER
    s.setsockopt(zmq.LINGER, 1000)
    s.connect(address)
    for m in msgs:
        frames = [bytes(memoryview(f).cast("B")) for f in m]
        s.send_multipart(frames + [frame_mac(key, frames)] if key else frames)
    s.close()


def _wait_stats(rx, key, n, timeout=10):
    deadline = time.monotonic() + timeout
    while rx.stats[key] < n and time.monotonic() < deadline:
        time.sleep(0.02)
    return rx.stats[key]


def test_forged_frames_are_dropped_and_the_receiver_goes_on():
    st = _state()
    rx = StateReceiver("fp", st.kinds, key=KEY, vocab_size=256)
    tx = StateSender("fp", key=KEY)
    try:
        # unsigned, and signed with another key: dropped before parsing
        _push(rx.address, encode_transfer("forged", "fp", st, 3), None)
        _push(rx.address, encode_transfer("forged2", "fp", st, 3), transfer_key("other"))
        assert _wait_stats(rx, "unauthenticated", 2 + 2 * 2) >= 4
        # signed (an insider) but malformed: every field checked, none stops the thread
        bad_end = [m for m in encode_transfer("bad-first", "fp", st, 3)]
        bad_end[-1] = [json.dumps({"v": PROTOCOL, "rid": "bad-first", "type": "end",
                                   "first_token": "x", "chunks": 1}).encode()]
        _push(rx.address, bad_end, KEY)
        huge = [m for m in encode_transfer("too-big-token", "fp", st, 10 ** 30)]
        _push(rx.address, huge, KEY)
        _push(rx.address, [[b"not json"], [b"\xff\xfe"], [json.dumps(
            {"v": PROTOCOL, "rid": 5, "type": "begin"}).encode()]], KEY)
        _push(rx.address, [[json.dumps({"v": PROTOCOL, "rid": "big", "type": "begin",
                                        "fingerprint": "fp", "kinds": st.kinds,
                                        "num_tokens": 0, "nbytes": 1 << 50,
                                        "chunks": 1}).encode()]], KEY)
        for rid, why in (("bad-first", "first_token"), ("too-big-token", "first_token"),
                         ("big", "limit")):
            with pytest.raises(Exception, match=why):
                asyncio.run(rx.wait(rid, 10))
        assert _wait_stats(rx, "dropped", 3) >= 3
        assert rx.alive
        # a genuine transfer still goes through
        tx.send("ok", rx.address, st, first_token=7).wait(10)
        assert asyncio.run(rx.wait("ok", 10)).first_token == 7
        with pytest.raises(Exception, match="did not complete"):
            asyncio.run(rx.wait("forged", 0.5))         # never accepted
    finally:
        tx.close()
        rx.close()


def test_sender_only_ships_to_registered_destinations_with_bounded_sockets():
    st = _state()
    rxs = [StateReceiver("fp", st.kinds, key=KEY) for _ in range(10)]
    tx = StateSender("fp", key=KEY, allowed={r.address for r in rxs}, max_sockets=4)
    try:
        for dest in ("tcp://10.255.255.1:9", "ipc:///tmp/x", "http://a:1", "", None):
            with pytest.raises(ValueError, match="dest"):
                tx.send("r", dest, st, 1)
        for i, rx in enumerate(rxs * 2):
            tx.send(f"r{i}", rx.address, st, 1).wait(10)
            assert tx.num_sockets <= 4
        for i, rx in enumerate(rxs * 2):
            assert asyncio.run(rx.wait(f"r{i}", 10)).first_token == 1
    finally:
        tx.close()
        for rx in rxs:
            rx.close()


def test_assembler_limits_concurrent_transfers():
    st = _state()
    asm = TransferAssembler("fp", st.kinds, max_partial=2)
    begins = [encode_transfer(f"r{i}", "fp", st, 1)[0] for i in range(3)]
    assert asm.feed(begins[0]) is None and asm.feed(begins[1]) is None
    err = asm.feed(begins[2])
    assert "already in progress" in str(err)
