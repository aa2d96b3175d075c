""""Sent" means acknowledged (issue 30 item 2): the decode side acknowledges every state
it verified and loaded (or rejected), the sender reports the end-to-end and wire times,
and a transfer to an address where nothing listens, or over a dead link, fails at its
deadline instead of counting as sent."""

import asyncio
import socket
import time

from hyla.disagg.live.transfer.frames import transfer_key
from hyla.disagg.live.transfer.net import StateReceiver, StateSender
from hyla.model import preset
from hyla.model.state import SequenceState

KEY = transfer_key("ack-secret")


def _state():
    return SequenceState.empty(preset("debug"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_acknowledged_with_times():
    st = _state()
    rx = StateReceiver("fp", st.kinds, key=KEY)
    tx = StateSender("fp", key=KEY)
    try:
        stats = tx.send("a", rx.address, st, 5, deadline_s=10).wait(15)
        assert stats["acked"] and stats["error"] is None
        assert stats["seconds"] > 0 and 0 <= stats["wire_s"] <= stats["seconds"]
        assert stats["bytes"] >= st.nbytes and rx.stats["acks"] == 1
        assert asyncio.run(rx.wait("a", 5)).first_token == 5
        tx.faults["corrupt"] = True                      # rejected: a negative ack
        stats = tx.send("b", rx.address, st, 5, deadline_s=10).wait(15)
        assert not stats["acked"] and "rejected" in stats["error"]
        assert tx.stats == {"acked": 1, "failed": 1, "abandoned": 0, "bad_acks": 0}
    finally:
        tx.close()
        rx.close()


def test_nothing_listens_fails_at_the_deadline_then_recovers():
    st = _state()
    port = _free_port()
    tx = StateSender("fp", key=KEY)
    rx = None
    try:
        t0 = time.monotonic()
        stats = tx.send("x", f"tcp://127.0.0.1:{port}", st, 1, deadline_s=0.5).wait(10)
        took = time.monotonic() - t0
        assert not stats["acked"] and "no acknowledgement within 0.50 s" in stats["error"]
        assert 0.4 < took < 3.0 and tx.stats["abandoned"] == 1
        assert tx.num_sockets == 0                       # the connection was dropped
        rx = StateReceiver("fp", st.kinds, bind=f"tcp://127.0.0.1:{port}", key=KEY)
        stats = tx.send("y", rx.address, st, 2, deadline_s=10).wait(15)
        assert stats["acked"], stats                     # a fresh connection works
        assert asyncio.run(rx.wait("y", 5)).first_token == 2
    finally:
        tx.close()
        if rx is not None:
            rx.close()


def test_unsigned_ack_is_ignored():
    """An acknowledgement must carry the cluster secret's HMAC like every frame."""
    import json

    import zmq

    st = _state()
    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    tx = StateSender("fp", key=KEY)
    try:
        out = tx.send("z", f"tcp://127.0.0.1:{port}", st, 1, deadline_s=1.0)
        peer = None
        while True:
            assert router.poll(10_000)
            peer, *frames = router.recv_multipart()
            if json.loads(frames[0])["type"] == "end":
                break
        router.send_multipart([peer, json.dumps({"v": 2, "type": "ack", "rid": "z",
                                                 "ok": True}).encode()])
        stats = out.wait(10)
        assert not stats["acked"] and "no acknowledgement" in stats["error"]
        assert tx.stats["bad_acks"] == 1
    finally:
        router.close(linger=0)
        tx.close()
