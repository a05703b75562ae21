"""Per-key limits: what one key may take of the pools (README.md "Limits per key").

- ``keys.py``: each key's limits, its own over ``[limits]``, per model too;
- ``budgets.py``: the per-minute windows, kept in this process or shared by the replicas
  (``shared.py``, Redis), behind one interface;
- ``admission.py``: a request admitted or refused (429) before any worker call, and what it
  reserved settled at its end; the ``x-ratelimit-*`` headers.

The fair queue of a saturated pool is the pool's (backends/queue.py, policies/fair_queue.py):
this package only says which band a request waits in.
"""

from __future__ import annotations

from router.config import Config
from router.limits.admission import Admission, LimitMeters, Ticket
from router.limits.budgets import Budgets, LocalBudgets
from router.limits.keys import KeyPolicy, default_policy, policies

__all__ = ["Admission", "KeyPolicy", "Ticket", "make_admission"]


def make_admission(config: Config, meters: LimitMeters | None = None, *, queued: bool = False) -> Admission | None:
    """The router's admission, or None when no key has a rate or concurrency limit and no pool
    queues (then a request pays nothing for limits). Budgets in this process, or shared
    ([limits.shared]). ``queued``: a pool has a fair queue, which needs each request's key."""
    keyed = policies(config)
    default = default_policy(config)
    if not queued and not default.limited and not any(p.limited for p in keyed.values()):
        return None
    shared = config.limits.shared
    budgets: Budgets
    if shared.redis_url:
        from router.limits.shared import SharedBudgets  # redis is imported only when used

        budgets = SharedBudgets(shared.redis_url, prefix=shared.key_prefix, lease_fraction=shared.lease_fraction,
                                retry_s=shared.retry_s)
    else:
        budgets = LocalBudgets()
    return Admission(keyed, default, budgets, default_output_tokens=config.limits.default_output_tokens, meters=meters)
