"""Fair shares of a router's slots between tenants (an API key, or one end user of a key), by virtual
token counters (VTC, "Fairness in Serving Large Language Models", Sheng et al., OSDI 2024): a
tenant's counter grows by the tokens of each request admitted for it, divided by the tenant's
weight, and among waiting requests the next slot goes to the tenant whose counter is smallest. The
virtual time is the counter at which the last request was admitted; a tenant that starts waiting is
lifted to it, so time spent idle banks no credit. So a tenant sending ten times the others gets its
share and no more while the others wait, and an idle fleet serves anyone at once. Tokens are the
router's estimate at admission (prompt + expected output)."""

from __future__ import annotations


class FairShare:
    """Invariants: a counter never decreases; `virtual_time` never decreases; a tenant without a
    counter has been charged nothing."""

    def __init__(self):
        self.counters: dict[str, float] = {}
        self.virtual_time = 0.0

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def charge(self, tenant: str, tokens: int, weight: float) -> None:
        """A request of `tokens` admitted for `tenant` (of `weight`, > 0)."""
        start = self.counter(tenant)
        self.virtual_time = max(self.virtual_time, start)
        self.counters[tenant] = start + tokens / weight

    def lift(self, tenant: str) -> None:
        """`tenant` starts waiting: its counter is at least the virtual time."""
        self.counters[tenant] = max(self.counter(tenant), self.virtual_time)
