"""The two worker roles of a disaggregated deployment, in one place (``hyla serve --role``).

- prefill (:mod:`hyla.disagg.live.worker.prefill`): prefills prompts on an engine and ships
  each one's state to a decode worker;
- decode (:mod:`hyla.disagg.live.worker.decode`): the ordinary engine API plus a receiver that
  admits shipped states straight to decoding.
"""

from hyla.disagg.live.worker.decode import add_decode_routes, build_decode_worker
from hyla.disagg.live.worker.prefill import PrefillService, create_prefill_app

__all__ = ["PrefillService", "add_decode_routes", "build_decode_worker", "create_prefill_app"]
