"""Hosts on one Linux machine joined by a link to shape, cut, delay and make lossy (root
only): :mod:`.hosts` (:class:`NetLab`, the namespaces and the link) and :mod:`.cluster` (a
PrfaaS cluster across them, for tests and benchmarks)."""

from hyla.disagg.live.netlab.hosts import NetLab

__all__ = ["NetLab"]
