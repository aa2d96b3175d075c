"""Shipping a :class:`~hyla.model.state.SequenceState` from a prefill worker to a decode
worker over TCP (pyzmq): :mod:`.frames` (the wire format, its MACs and checksums),
:mod:`.sender` (:class:`StateSender`, a zmq DEALER a destination) and :mod:`.net`
(:class:`StateReceiver`, which acknowledges every transfer)."""

from hyla.disagg.live.transfer.frames import TransferError, model_fingerprint
from hyla.disagg.live.transfer.net import StateReceiver
from hyla.disagg.live.transfer.sender import StateSender

__all__ = ["StateReceiver", "StateSender", "TransferError", "model_fingerprint"]
