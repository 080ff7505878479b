"""How long an idle connection may wait in the pool: ``keepalive_expiry``, or below it
the limit learned from the upstream closing idle connections, which climbs back after
a restart taught it too low (``docs/design/upstream-client.md``, "Reusing an idle
connection safely"). Pure bookkeeping per endpoint: no I/O, no clock."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.wire.endpoint import Endpoint

# A learned idle limit is used at this fraction, and never below MIN_LEARNED_EXPIRY.
LEARNED_MARGIN = 0.75
MIN_LEARNED_EXPIRY = 0.25
# A learned idle limit doubles (back toward keepalive_expiry) after this many idle
# connections in a row outlived it; each doubling the upstream undoes doubles the run
# the next one needs, up to MAX_RECOVERY_RUN.
RECOVERY_RUN = 3
MAX_RECOVERY_RUN = 48


@dataclass(slots=True)
class Recovery:
    """How one endpoint's learned idle limit climbs back (:meth:`IdleLimits.outlived`)."""

    run: int = 0  # idle connections in a row that outlived the limit
    needed: int = RECOVERY_RUN  # the run that doubles it
    raised: bool = False  # the limit in use is a doubling no idle close has undone


class IdleLimits:
    """The idle limit per endpoint: :meth:`expiry` is what the pool applies.

    Parameters:
        keepalive_expiry: the limit for every endpoint, and the most a learned one
            climbs back to before it is forgotten.
    """

    __slots__ = ("keepalive_expiry", "learned", "recovery")

    def __init__(self, *, keepalive_expiry: float) -> None:
        self.keepalive_expiry = keepalive_expiry
        self.learned: dict[Endpoint, float] = {}
        self.recovery: dict[Endpoint, Recovery] = {}

    def expiry(self, endpoint: Endpoint) -> float:
        return self.learned.get(endpoint, self.keepalive_expiry)

    def learn(self, endpoint: Endpoint, idle_s: float) -> None:
        """The upstream closed a connection that had been idle ``idle_s`` seconds: the
        limit goes down if this one is lower, and a run of connections that outlived
        the limit (:meth:`outlived`) starts over either way."""
        recovery = self.recovery.get(endpoint)
        if recovery is not None:
            recovery.run = 0
        limit = max(MIN_LEARNED_EXPIRY, idle_s * LEARNED_MARGIN)
        if limit >= self.expiry(endpoint):
            return
        self.learned[endpoint] = limit
        if recovery is None:
            self.recovery[endpoint] = Recovery()
        elif recovery.raised:  # the last doubling went past the upstream's own limit
            recovery.needed = min(2 * recovery.needed, MAX_RECOVERY_RUN)
            recovery.raised = False

    def outlived(self, endpoint: Endpoint) -> None:
        """An idle connection to ``endpoint`` outlived the learned limit: the pool
        retired it at that age and the upstream still had it open. After
        :data:`RECOVERY_RUN` such retirements with no idle close in between, the limit
        doubles, up to ``keepalive_expiry``, where the learned limit is forgotten, so
        one restart of the upstream does not end reuse for good."""
        limit = self.learned.get(endpoint)
        recovery = self.recovery.get(endpoint)
        if limit is None or recovery is None:
            return
        recovery.run += 1
        if recovery.run < recovery.needed:
            return
        recovery.run = 0
        if 2 * limit >= self.keepalive_expiry:
            del self.learned[endpoint]
            del self.recovery[endpoint]
        else:
            self.learned[endpoint] = 2 * limit
            recovery.raised = True
