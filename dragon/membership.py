"""Elastic DiLoCo (--diloco_elastic): which islands take part in each outer step.

At every outer step each island's first rank announces itself in the islands' store. The first
island to arrive waits up to --diloco_quorum_timeout for the islands of the last quorum and then
writes this step's members; every rank of every island reads that one decision, so all agree. The
members' rank r then meet in a gloo group built for this step only (rank r of each member island,
as the static cross-island group does), and the outer step averages over them. An island that is
not in the quorum (it died, or came late) is out of the run; if the exchange itself fails (an
island died during it), the survivors form the step's quorum again and retry without it.
"""

import logging
import time
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from dragon.topology import Topology

logger = logging.getLogger("dragon")
_PREFIX = "dragon-diloco/elastic"


class Membership:
    """One island's view of the quorums; `members` is the last quorum (at first: every island)."""

    def __init__(
        self, topology: Topology, quorum_timeout: float, min_islands: int, timeout_s: float
    ):
        self.topology, self.store = topology, topology.store
        self.quorum_timeout, self.min_islands = quorum_timeout, min_islands
        self.timeout = timedelta(seconds=timeout_s)
        self.members = list(range(topology.islands))

    def quorum(self, outer_step: int, attempt: int) -> tuple[list[int], Optional[Any]]:
        """(members, their gloo group for this rank; None when this island is alone) of attempt
        `attempt` of outer step `outer_step`. Exits with one line when this island is not a member
        or the quorum is below --diloco_min_islands."""
        t, key = self.topology, f"{_PREFIX}/{outer_step}/{attempt}"
        if t.island_rank == 0:
            self.store.set(f"{key}/arrived/{t.island}", "1")
            if self.store.add(f"{key}/arrivals", 1) == 1:  # the first to arrive decides
                self.store.set(f"{key}/members", ",".join(map(str, self._arrived(key))))
        self.store.wait([f"{key}/members"], self.timeout)
        members = [int(i) for i in self.store.get(f"{key}/members").decode().split(",")]
        if t.island not in members:
            raise SystemExit(
                f"error: island {t.island} reached outer step {outer_step} after its quorum "
                f"(islands {members}) had formed; it is out of the run"
            )
        if len(members) < self.min_islands:
            raise SystemExit(
                f"error: outer step {outer_step}: {len(members)} island(s) {members} reached it, "
                f"fewer than --diloco_min_islands {self.min_islands}"
            )
        left = sorted(set(self.members) - set(members))
        if left and t.island_rank == 0:
            logger.warning(f"outer step {outer_step}: island {left} did not arrive; training on "
                           f"with islands {members}")
        self.members = members
        if len(members) == 1:
            return members, None
        store = dist.PrefixStore(f"{key}/rank{t.island_rank}", self.store)
        return members, dist.ProcessGroupGloo(
            store, members.index(t.island), len(members), self.timeout
        )

    def _arrived(self, key: str) -> list[int]:
        """The islands that announced themselves for `key`, once all of the last quorum did or
        the quorum timeout passed."""
        deadline = time.monotonic() + self.quorum_timeout
        while True:
            arrived = [
                i for i in range(self.topology.islands)
                if self.store.check([f"{key}/arrived/{i}"])
            ]
            if set(self.members) <= set(arrived) or time.monotonic() > deadline:
                return arrived
            time.sleep(0.01)
