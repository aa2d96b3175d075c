"""The router role (``hyla serve --role router``), the cluster's OpenAI-compatible front:
:mod:`.core` (:class:`LiveRouter`: where each request prefills and decodes), :mod:`.remote`
(the remote path: shipping a prefill and waiting for its state), :mod:`.links` (the measured
prefill -> decode paths), :mod:`.workers` (what it knows of each worker) and :mod:`.app`
(the HTTP routes)."""

from hyla.disagg.live.router.core import LiveRouter, LiveRouterConfig, WorkerFailed, live_policy
from hyla.disagg.live.router.workers import Worker

__all__ = ["LiveRouter", "LiveRouterConfig", "Worker", "WorkerFailed", "live_policy"]
