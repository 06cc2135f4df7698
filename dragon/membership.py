"""Elastic DiLoCo (--diloco_elastic): which islands take part in each outer step.

At every outer step each island's first rank announces itself in the islands' store. The first
island to arrive waits up to --diloco_quorum_timeout for the islands of the last quorum and then
writes this step's members; every rank of every island reads that one decision, so all agree. The
members' rank r then meet in a gloo group built for this step only (rank r of each member island,
as the static cross-island group does), and the outer step averages over them. An island that is
not in the quorum (it died, or came late) is out of the run; if the exchange itself fails (an
island died during it), the survivors form the step's quorum again and retry without it.

An island started with --diloco_join announces itself as joining for the live islands' next outer
step (it never decides a quorum: it would not know whom to wait for); it is a member of that step
if it arrived before the decision, else it tries the step after.
"""

import json
import logging
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from dragon.exchange import flatten
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

    def quorum(
        self, outer_step: int, attempt: int, joining: bool = False
    ) -> Optional[tuple[list[int], Optional[Any], list[int]]]:
        """(members, their gloo group for this rank or None when this island is alone, the
        members that are joining) of attempt `attempt` of outer step `outer_step`. Exits with one
        line when this island is not a member (None instead when joining) or the quorum is below
        --diloco_min_islands."""
        t, key = self.topology, f"{_PREFIX}/{outer_step}/{attempt}"
        if t.island_rank == 0:
            if joining:
                self.store.set(f"{key}/joining/{t.island}", "1")
            self.store.set(f"{key}/arrived/{t.island}", "1")
            if not joining and self.store.add(f"{key}/arrivals", 1) == 1:  # the first decides
                self.store.set(f"{key}/members", ",".join(map(str, self._arrived(key))))
        self.store.wait([f"{key}/members"], self.timeout)
        members = [int(i) for i in self.store.get(f"{key}/members").decode().split(",")]
        if t.island not in members:
            if joining:
                return None
            raise SystemExit(
                f"error: island {t.island} reached outer step {outer_step} after its quorum "
                f"(islands {members}) had formed; it is out of the run"
            )
        if len(members) < self.min_islands:
            raise SystemExit(
                f"error: outer step {outer_step}: {len(members)} island(s) {members} reached it, "
                f"fewer than --diloco_min_islands {self.min_islands}"
            )
        joiners = [i for i in members if self.store.check([f"{key}/joining/{i}"])]
        self._report(outer_step, members, joiners)
        self.members = members
        if len(members) == 1:
            return members, None, joiners
        store = dist.PrefixStore(f"{key}/rank{t.island_rank}", self.store)
        group = dist.ProcessGroupGloo(store, members.index(t.island), len(members), self.timeout)
        return members, group, joiners

    def _report(self, outer_step: int, members: list[int], joiners: list[int]) -> None:
        if self.topology.island_rank != 0:
            return
        left = sorted(set(self.members) - set(members))
        if left:
            logger.warning(f"outer step {outer_step}: island {left} did not arrive; training on "
                           f"with islands {members}")
        if joiners:
            logger.info(f"outer step {outer_step}: island {joiners} joins islands {members}")

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

    def publish(self, outer_step: int, step: int, shape: dict) -> None:
        """After an outer step: where the run is, and what a joiner must match."""
        if self.topology.island_rank == 0:
            self.store.set(f"{_PREFIX}/progress", json.dumps([outer_step, step, shape]))

    def progress(self, shape: dict) -> int:
        """The last outer step the live islands published (waits for one); exits with one line
        when this island's model or H differ from theirs."""
        self.store.wait([f"{_PREFIX}/progress"], self.timeout)
        outer_step, _, theirs = json.loads(self.store.get(f"{_PREFIX}/progress"))
        wrong = [f"{k} {v} (theirs {theirs.get(k)})" for k, v in shape.items()
                 if v != theirs.get(k)]
        if wrong:
            raise SystemExit(f"error: --diloco_join: this island's {', '.join(wrong)}; join with "
                             "the live islands' model and --diloco_inner_steps")
        return outer_step


def join(outer) -> int:
    """--diloco_join for DiLoCo `outer`: wait for the live islands' next outer step, take
    theta_outer, the outer optimizer's state and the step from them, and take that outer step
    with them (adding no pseudo-gradient: this island trained nothing from their theta_outer);
    returns the step."""
    while True:
        target = outer.membership.progress(outer._shape()) + 1
        quorum = outer.membership.quorum(target, 0, joining=True)
        if quorum is not None:
            break
    members, group, joiners = quorum
    step = share_state(outer, group, members, joiners, 0)
    outer.outer_step = target
    zeros = torch.zeros(sum(outer.numels))
    exchange = outer._exchange(zeros, group, len(members), len(members) - len(joiners))
    outer._apply(exchange.result())
    outer._write(outer.outer_params)
    return step


def share_state(outer, group, members: list[int], joiners: list[int], step: int) -> int:
    """Broadcast theta_outer, the SGD momentum and the step from the first member that is not
    joining; the joiners take them. Returns the step."""
    params, numels = outer.outer_params, outer.numels
    root = members.index(min(i for i in members if i not in joiners))
    state = [outer.optimizer.state.get(p, {}).get("momentum_buffer") for p in params]
    momentum = [torch.zeros_like(p) if b is None else b for b, p in zip(state, params)]
    flags = torch.tensor([float(step), float(state[0] is not None)])
    flat = torch.cat([flatten(params), flatten(momentum), flags])
    group.broadcast(flat, root).wait()
    if outer.topology.island in joiners:
        n = sum(numels)
        values, buffers = flat[:n].split(numels), flat[n : 2 * n].split(numels)
        with torch.no_grad():
            for p, v, b in zip(params, values, buffers):
                p.copy_(v.view_as(p))
                if flat[-1] > 0:
                    outer.optimizer.state[p] = {"momentum_buffer": b.view_as(p).clone()}
    return int(flat[-2])
