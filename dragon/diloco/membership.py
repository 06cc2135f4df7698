"""Which islands take part in each outer step: every island (FixedGroup) or, with
--diloco_elastic, those that reach it (ElasticIslands). Both have one interface (run_round,
failed, publish, metrics, finish), so an outer step has one code path.

Elastic islands agree on each step's members in their store (dragon.diloco.quorum); rank r of
each member meets in a gloo group built for that step only. A failed exchange is retried among
the survivors. An island left out of a quorum is out of the run unless it lands late; a fresh
joiner (--diloco_join) reads data from where an island that trained all along would read."""

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
    scale: float = 1.0  # on this island's pseudo-gradients: its tokens, or its staleness
    paced: dict = field(default_factory=dict)  # unequal islands: their metrics
    plan: Optional[list] = None  # unequal islands: the plan agreed
    step: int = 0  # the step, as the live islands have it (a joiner's)
    late: dict = field(default_factory=dict)  # islands landing late -> outer steps late
    flights: list = field(default_factory=list)  # the exchanges in flight that landed


class LateForQuorum(Exception):
    """This island missed its quorum at `outer_step` (DiLoCo._land_late). `counted`: the others
    completed the step with its share while its exchange failed here, so it joins the next one."""

    def __init__(self, outer_step: int, members: list[int], counted: bool = False):
        super().__init__(outer_step, members)
        self.outer_step, self.members, self.counted = outer_step, members, counted


def staleness_weight(outer_steps_late: int) -> float:
    """A late pseudo-gradient's weight against 1 for a fresh one: 1 / (1 + late), the
    staleness-dependent learning rate of Zhang et al. (2016, "Staleness-aware Async-SGD")."""
    return 1.0 / (1 + outer_steps_late)


def _on_any_rank(flag: bool) -> bool:
    """Whether `flag` holds on any rank of this island (its own world)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, flag)
    return any(flags)


class FixedGroup:
    """Every island in every outer step, on the cross-island group: a lost island ends the run
    (dragon.errors.IslandLost), so nothing is ever redone."""

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
    """One island's view of the quorums. A joiner sends a zero Delta, takes theta_outer, the outer
    optimizer's state and the step from the first other member and applies its outer gradient; a
    late island sends its kept pseudo-gradient, weighted by staleness_weight. Both end the step on
    the others' weights."""

    def __init__(self, topology: Topology, quorum_timeout: float, min_islands: int,
                 timeout_s: float, late_landing: bool = False):
        self.topology, self.store = topology, topology.store
        self.min_islands, self.timeout = min_islands, timedelta(seconds=timeout_s)
        self.late_landing = late_landing  # sync mode with one fragment only
        self.decisions = Quorum(topology, quorum_timeout, self.timeout)
        self.admitted: Optional[tuple] = None  # the quorum admit() let this island into

    @property
    def members(self) -> list[int]:
        """The last quorum this island took part in (at first: every island)."""
        return self.decisions.last

    def first_group(self, joining: bool) -> Optional[Any]:
        """The islands that start together meet at outer step 0 (a joiner meets them later)."""
        if joining:
            self.decisions.starts_as_joiner()
            return None
        return self.quorum(0, 0)[1]

    def metrics(self) -> dict:
        return {"outer_quorum": len(self.members)}

    def failed(self, outer_step: int, what: str, exchanges: list, contributed: bool, group,
               redo: bool = False) -> Optional[int]:
        """None when `exchanges` in flight succeeded on every member; else (one failed, or
        `redo`) how many members contributed: the members redo them, divided by that."""
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
        """Tell islands still joining where the run ended (the store outlives the run)."""
        if ended_at is not None:
            self.end(ended_at)

    def quorum(self, outer_step: int, attempt: int, joining: bool = False, final: bool = False,
               late: int = 0) -> Optional[tuple[list[int], Optional[Any], list[int], dict]]:
        """(members, their gloo group or None when alone, the joiners, {joiner landing late:
        outer steps late}) of an attempt; `late`: this joiner's. A joiner left out gets None; a
        member left out raises LateForQuorum where it can land late, else IslandLost, as does a
        quorum below --diloco_min_islands. The `final` step admits no joiner, late or not."""
        t = self.topology
        members = self.decisions.members(outer_step, attempt, joining, final, late)
        if members is None:  # a joiner in an attempt its dead launch arrived at
            return None
        if t.island not in members:
            if joining:
                return None
            if attempt and self.decisions.completed(outer_step, attempt - 1):
                raise LateForQuorum(outer_step, members, counted=True)
            # at outer step 0 a late island has nothing to land
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
        try:  # a member that died after the decision never connects: wait as long as a
            # decision may take, then retry without it
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
        """attempt(*quorum) among the quorum of `outer_step` (a joiner's first: admit()'s). When
        an island is lost during it, the quorum forms again and the whole attempt is retried."""
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
            # Close the failed group (its exchanges may hold it in cycles), so a member still
            # waiting in it fails at once and reaches the retry in time.
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
        """Tell islands still joining that the run ended at `step`."""
        if self.topology.island_rank == 0:
            self.store.set(f"{PREFIX}/ended", str(step))

    def publish(self, outer_step: int, step: int, shape: dict) -> None:
        """Where the run is, and what a joiner must match."""
        if self.topology.island_rank == 0:
            self.store.set(f"{PREFIX}/progress", json.dumps([outer_step, step, shape]))

    def admit(self, shape: dict, late_since: Optional[int] = None, after: int = 0) -> int:
        """The live islands' first outer step after `after` that lets this joiner in (late:
        since missing `late_since`); its quorum is left in `admitted`."""
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
        """The last outer step the live islands published (waits for one); raises JoinRefused
        when this island's model or H differ from theirs."""
        self.store.wait([f"{PREFIX}/progress"], self.timeout)
        outer_step, _, theirs = json.loads(self.store.get(f"{PREFIX}/progress"))
        wrong = [f"{k} {v} (theirs {theirs.get(k)})" for k, v in shape.items()
                 if v != theirs.get(k)]
        if wrong:
            raise JoinRefused(f"--diloco_join: this island's {', '.join(wrong)}; join with "
                             "the live islands' model and --diloco_inner_steps")
        return outer_step
