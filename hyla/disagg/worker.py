"""The two worker roles of a disaggregated deployment, in one place (``hyla serve --role``).

- prefill (:mod:`hyla.disagg.worker_prefill`): runs prompts and ships each finished
  layer's state to a decode worker;
- decode (:mod:`hyla.disagg.worker_decode`): the ordinary engine API plus a receiver that
  admits shipped states straight to decoding.
"""

from hyla.disagg.worker_decode import add_decode_routes, build_decode_worker
from hyla.disagg.worker_prefill import PrefillService, create_prefill_app

__all__ = ["PrefillService", "add_decode_routes", "build_decode_worker", "create_prefill_app"]
