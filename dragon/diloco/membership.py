"""Which islands take part in each outer step: a fixed group (every island, always), or elastic
islands (--diloco_elastic). Both have one interface, so an outer step has one code path:
run_round(outer_step, attempt) runs attempt(members, their group, joiners) among the step's
members; failed(exchanges, ...) says whether an exchange in flight has to be redone without a lost
island; publish, metrics and finish report the step and end the run.

Elastic islands (ElasticIslands).
At every outer step the islands that reach it agree on its members in their store
(dragon.diloco.quorum). The members' rank r then meet in a gloo group built for this step only
(rank r of each member island, as the static cross-island group does), and the outer step
averages over them. An island that is not in the quorum (it died, or came late) is out of the
run; if the exchange itself fails (an island died during it), the survivors form the step's
quorum again and retry without it. A member whose exchange failed on it alone, while the others
completed the step with its share, finds so at its retry and joins the next outer step as a
joiner does.

An island started with --diloco_join announces itself as joining for the live islands' next outer
step; it is a member of that step if it arrived before the decision, else it tries the step after.
It adds a zero Delta (the average divides by the other members), receives theta_outer, the outer
optimizer's state_dict and the step from the first other member, and applies the outer gradient
that member applies (sync: the average; delayed: that member's eager gradient), so it ends the step
on that member's weights. Its data stream continues from its own checkpoint, or (a fresh island)
from where an island that trained all along would read at that step: islands read disjoint samples.

An island that reaches an outer step after its quorum formed without it (past the quorum
timeout: the grace) lands late, in sync mode with one fragment: the others do not wait for it. It
keeps its pseudo-gradient, joins the live islands' next outer step as a joiner does (announced
"late N": N outer steps late), and sends that pseudo-gradient, weighted by staleness_weight(N);
it then takes the live islands' theta_outer, as every member does, so it counts once and every
island ends the step identical. Elsewhere (delayed mode, fragments, the last outer step) it is
out of the run, as an island that died.

Delayed mode: an average in flight that failed on any member (an island died during it) is
redone at the next outer step among its members, from the pseudo-gradients each kept, divided by
the members that contributed to it: the late average is then the survivors' average.
"""

import gc
import json
import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from dragon.diloco.quorum import DECISION_SLACK, PREFIX, MissedRound, Quorum, step_key
from dragon.errors import IslandLost, JoinRefused
from dragon.parallel.topology import Topology

logger = logging.getLogger("dragon")


@dataclass
class Round:
    """What one round among the islands settled; applied once it succeeded."""

    landed: dict = field(default_factory=dict)  # fragment -> the average that lands
    syncing: list = field(default_factory=list)
    started: list = field(default_factory=list)  # their exchanges
    deltas: list = field(default_factory=list)  # the pseudo-gradients they sent
    synced: dict = field(default_factory=dict)  # blocking: fragment -> its average
    gradient: Optional[torch.Tensor] = None  # eager: the outer gradient
    contributors: int = 1
    contributes: bool = True
    scale: float = 1.0  # unequal islands: of this island's pseudo-gradients, by its tokens
    paced: dict = field(default_factory=dict)  # unequal islands: their metrics
    plan: Optional[list] = None  # unequal islands: the plan agreed
    step: int = 0  # the step, as the live islands have it (a joiner's)
    late: dict = field(default_factory=dict)  # islands landing late -> outer steps late
    flights: list = field(default_factory=list)  # the exchanges in flight that landed


class LateForQuorum(Exception):
    """This island reached outer step `outer_step` after its quorum had formed without it: it
    lands late (DiLoCo._land_late). `counted`: the others completed the step with this island's
    share while its exchange failed here alone; it joins the next one instead."""

    def __init__(self, outer_step: int, members: list[int], counted: bool = False):
        super().__init__(outer_step, members)
        self.outer_step, self.members, self.counted = outer_step, members, counted


def staleness_weight(outer_steps_late: int) -> float:
    """The weight of a pseudo-gradient that lands `outer_steps_late` outer steps late, against 1
    for a fresh one: 1 / (1 + late), the staleness-dependent learning rate of Zhang et al. (2016,
    "Staleness-aware Async-SGD"), which divides a gradient's step by its staleness."""
    return 1.0 / (1 + outer_steps_late)


def _on_any_rank(flag: bool) -> bool:
    """Whether `flag` holds on any rank of this island (its own world)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, flag)
    return any(flags)


class FixedGroup:
    """Every island in every outer step, on the topology's cross-island group: an island lost
    ends the run (dragon.errors.IslandLost), so nothing is ever redone."""

    def __init__(self, topology: Topology):
        self.topology, self.group = topology, topology.cross_group
        self.members = list(range(topology.islands))

    def first_group(self, joining: bool) -> Optional[Any]:
        """The group the islands that start together meet in at the first weights."""
        return self.group

    def run_round(self, outer_step: int, attempt: Callable[..., Any], joining: bool = False,
                  final: bool = False) -> Any:
        return attempt(self.members, self.group, [], {})

    def failed(self, outer_step: int, what: str, exchanges: list, contributed: bool, group,
               redo: bool = False) -> Optional[int]:
        """None: a fixed group's exchange fails only with the run (its result() raises)."""
        return None

    def metrics(self) -> dict:
        return {}

    def publish(self, outer_step: int, step: int, shape: dict) -> None:
        pass

    def finish(self, ended_at: Optional[int]) -> None:
        """Wait for every island after the last outer step (so the store outlives its users)."""
        self.topology.barrier()


class ElasticIslands:
    """One island's view of the quorums; `members` is the last quorum (at first: every island)."""

    def __init__(self, topology: Topology, quorum_timeout: float, min_islands: int,
                 timeout_s: float, late_landing: bool = False):
        self.topology, self.store = topology, topology.store
        self.min_islands, self.timeout = min_islands, timedelta(seconds=timeout_s)
        self.late_landing = late_landing  # a late island lands in the next outer step
        self.decisions = Quorum(topology, quorum_timeout, self.timeout)
        self.admitted: Optional[tuple] = None  # the quorum admit() let this island into

    @property
    def members(self) -> list[int]:
        """The last quorum this island took part in (at first: every island)."""
        return self.decisions.last

    def first_group(self, joining: bool) -> Optional[Any]:
        """The islands that start together meet at outer step 0 (a joiner meets them later)."""
        return None if joining else self.quorum(0, 0)[1]

    def metrics(self) -> dict:
        return {"outer_quorum": len(self.members)}

    def failed(self, outer_step: int, what: str, exchanges: list, contributed: bool, group,
               redo: bool = False) -> Optional[int]:
        """None when `exchanges` (in flight since an earlier round) succeeded on every member;
        else (one failed anywhere, or `redo`: a joiner is in the round) how many members
        contributed to them: the members redo them among themselves, divided by that."""
        failed = 0.0
        try:
            for exchange in exchanges:
                exchange.result()
        except RuntimeError:  # gloo: a member of the exchange is gone
            failed = 1.0
        flags = torch.tensor([failed, float(redo), float(contributed)], dtype=torch.float64)
        if group is not None:
            group.allreduce([flags]).wait()
        if flags[0] > 0 and self.topology.island_rank == 0:
            logger.warning(f"outer step {outer_step}: {what} failed; islands {self.members} "
                           "redo it among themselves")
        return None if flags[0] + flags[1] == 0 else max(int(flags[2]), 1)

    def finish(self, ended_at: Optional[int]) -> None:
        """The store runs on its own, and islands may be gone: a run that `ended_at` its last step
        says so to islands still joining."""
        if ended_at is not None:
            self.end(ended_at)

    def quorum(self, outer_step: int, attempt: int, joining: bool = False, final: bool = False,
               late: int = 0) -> Optional[tuple[list[int], Optional[Any], list[int], dict]]:
        """(members, their gloo group for this rank or None when this island is alone, the
        members that are joining, those of them landing late: island -> outer steps late) of
        attempt `attempt` of outer step `outer_step`; `late`: this joiner's. When this island is
        not a member: a joiner gets None, a late member lands late (LateForQuorum) where it can,
        else it exits with one line, as it does when the quorum is below --diloco_min_islands.
        The run's `final` outer step lets no joiner in (a late one neither: it would not know
        the step is the last)."""
        t = self.topology
        members = self.decisions.members(outer_step, attempt, joining, final, late)
        if members is None:  # a joiner in an attempt its dead launch arrived at
            return None
        if t.island not in members:
            if joining:  # it arrived late: it tries a later outer step
                return None
            if attempt and self.decisions.completed(outer_step, attempt - 1):
                raise LateForQuorum(outer_step, members, counted=True)
            # a late island lands in the next outer step (at the start it has nothing to land)
            if self.late_landing and not final and outer_step > 0:
                raise LateForQuorum(outer_step, members)
            raise IslandLost(
                f"island {t.island} reached outer step {outer_step} after its quorum "
                f"(islands {members}) had formed; it is out of the run (a late island lands in "
                "the next outer step only in sync mode with one fragment, before the last "
                "two); start it again with --diloco_join --resume_from_checkpoint auto"
            )
        if len(members) < self.min_islands:
            raise IslandLost(
                f"outer step {outer_step}: {len(members)} island(s) {members} reached it, "
                f"fewer than --diloco_min_islands {self.min_islands}"
            )
        kinds = {i: self.decisions.announced(outer_step, attempt, i) for i in members}
        joiners = [i for i in members if kinds[i] is not None]
        late = {i: int(kinds[i][1]) for i in joiners if kinds[i][0] == "late"}
        self._report(outer_step, members, joiners, late)
        self.decisions.last = members
        if len(members) == 1:
            return members, None, joiners, late
        store = dist.PrefixStore(f"{step_key(outer_step, attempt)}/rank{t.island_rank}",
                                 self.store)
        try:  # the rendezvous waits as long as a decision may take: a member that died after
            # the decision never connects, and the others retry without it within that bound
            meet = timedelta(seconds=self.decisions.quorum_timeout + DECISION_SLACK)
            group = dist.ProcessGroupGloo(store, members.index(t.island), len(members), meet)
            group._set_default_timeout(self.timeout)  # an exchange: as long as a link needs
        except RuntimeError as e:  # a member lost before the group formed
            group = e
        if _on_any_rank(isinstance(group, RuntimeError)):  # the island's ranks act as one
            raise group if isinstance(group, RuntimeError) else RuntimeError(
                f"outer step {outer_step}: another rank of this island could not form its group")
        return members, group, joiners, late

    def run_round(self, outer_step: int, attempt: Callable[..., Any], joining: bool = False,
                  final: bool = False) -> Any:
        """attempt(members, their gloo group, the joining members, those landing late) among the
        quorum of `outer_step` (`joining`: this island's, first the one admit() let it into).
        When an island is lost during it, the step's quorum forms again without it and the
        whole attempt is retried (nothing is applied before one succeeds)."""
        late = 0
        for retry in range(self.topology.islands):
            quorum = None
            try:  # a member lost before its group formed fails the attempt as one lost in it
                if joining and retry == 0:  # held here only, so that a failure closes its group
                    quorum, self.admitted = self.admitted, None
                    late = quorum[3].get(self.topology.island, 0)
                else:
                    quorum = self.quorum(outer_step, retry, joining, final, late)
                    if quorum is None:
                        raise MissedRound()
                done = attempt(*quorum)
                self.decisions.succeeded(outer_step, retry)  # tells one that failed alone
                return done
            except RuntimeError as e:  # gloo: a member's connection closed, or the timeout
                among = f"islands {quorum[0]}" if quorum is not None else "the quorum's islands"
                logger.warning(
                    f"outer step {outer_step}: the exchange among {among} failed "
                    f"({str(e).splitlines()[0][:160]}); retrying without the lost island"
                )
            # The failed group's connections close, so that a member still waiting in it (one
            # held up, a joiner) fails at once and reaches the retry in time; its exchanges may
            # hold it in reference cycles.
            quorum = None
            gc.collect()
        raise RuntimeError(f"outer step {outer_step}: no exchange succeeded")

    def _report(self, outer_step: int, members: list[int], joiners: list[int], late: dict
                ) -> None:
        if self.topology.island_rank != 0:
            return
        left = sorted(set(self.members) - set(members))
        if left:
            logger.warning(f"outer step {outer_step}: island {left} did not arrive; training on "
                           f"with islands {members}")
        for i in joiners:
            if i in late:
                logger.warning(f"outer step {outer_step}: island {i} lands {late[i]} outer "
                               f"step(s) late, weighted {staleness_weight(late[i]):g}, with "
                               f"islands {members}")
            else:
                logger.info(f"outer step {outer_step}: island {i} joins islands {members}")

    def end(self, step: int) -> None:
        """The run reached its last step: islands still joining are told so."""
        if self.topology.island_rank == 0:
            self.store.set(f"{PREFIX}/ended", str(step))

    def publish(self, outer_step: int, step: int, shape: dict) -> None:
        """After an outer step: where the run is, and what a joiner must match."""
        if self.topology.island_rank == 0:
            self.store.set(f"{PREFIX}/progress", json.dumps([outer_step, step, shape]))

    def admit(self, shape: dict, late_since: Optional[int] = None, after: int = 0) -> int:
        """--diloco_join, or an island landing late that missed outer step `late_since`: the
        live islands' next outer step that lets this island in, later than outer step `after`
        (one that went on without it: its attempts are over); its quorum is `admitted`."""
        while True:
            target = max(self.progress(shape), after) + 1
            late = 0 if late_since is None else target - late_since
            try:
                self.admitted = self.quorum(target, 0, joining=True, late=late)
            except JoinRefused as refused:
                if late_since is None:
                    raise
                raise IslandLost(f"island {self.topology.island} missed outer step {late_since} "
                                 "and could not land late: "
                                 f"{str(refused).removeprefix('--diloco_join: ')}") from None
            except RuntimeError as e:  # gloo: a member lost before the group formed
                logger.warning(f"outer step {target}: joining it failed "
                               f"({str(e).splitlines()[0][:160]}); this island joins a later one")
                self.admitted = None
                gc.collect()
            if self.admitted is not None:
                return target
            after = target

    def progress(self, shape: dict) -> int:
        """The last outer step the live islands published (waits for one); exits with one line
        when this island's model or H differ from theirs."""
        self.store.wait([f"{PREFIX}/progress"], self.timeout)
        outer_step, _, theirs = json.loads(self.store.get(f"{PREFIX}/progress"))
        wrong = [f"{k} {v} (theirs {theirs.get(k)})" for k, v in shape.items()
                 if v != theirs.get(k)]
        if wrong:
            raise JoinRefused(f"--diloco_join: this island's {', '.join(wrong)}; join with "
                             "the live islands' model and --diloco_inner_steps")
        return outer_step
