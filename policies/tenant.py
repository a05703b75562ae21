"""Who a worker call is for, as a saturated pool's fair queue sees it (backends/gate.py).

Made by the HTTP layer from the request's key (router/limits/), carried down to the pool's
call; the run's end settles what it was charged against what it used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class Tenant:
    key: str  # the key's name ("" when the router has no keys)
    band: int = 0  # 0 interactive, 1 batch, 2 flex: the fair queue serves lower bands first
    tokens: int = 0  # what one call of it is expected to cost (prompt + answer), charged as it is dispatched
    gone: Callable[[], bool] | None = None  # whether its client has left: then it leaves the queue
    charged: int = 0  # tokens charged to the key so far
    correct: Callable[[float], None] | None = field(default=None, repr=False)  # the last gate's: charge more or less

    def settle(self, used: int) -> None:
        """Its real usage, once it has ended: the key's service corrected by what it was charged."""
        if self.correct is not None and used != self.charged:
            self.correct(used - self.charged)
            self.charged = used
