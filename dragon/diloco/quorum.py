"""Who takes each attempt of each outer step of elastic islands: one decision per attempt, made
in the islands' store and read by every rank of every island, so all agree.

The first island to arrive is elected (compare_set) and waits up to --diloco_quorum_timeout for
the last quorum before writing the members; if it dies deciding, the first to see no decision in
time takes over. A joiner never decides: it would not know whom to wait for. Each launch carries a
token, so a restarted island never joins an attempt whose group waits for its dead launch. The
first outer step waits longer for the islands that start together (START_TIMEOUT): starts vary
more than steps; a joiner says so at the start, so that no one waits for it there."""

import logging
import time
import uuid
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from dragon.errors import IslandLost, JoinRefused
from dragon.parallel.topology import Topology

logger = logging.getLogger("dragon")
PREFIX = "dragon-diloco/elastic"
# seconds, beyond the quorum timeout, that a decision may take to reach the store
DECISION_SLACK = 10.0
# seconds the first outer step waits for the islands that start together, at least
START_TIMEOUT = 60.0


class MissedRound(Exception):
    """A joiner's outer step went on without it; it joins a later one."""


def step_key(outer_step: int, attempt: int = 0) -> str:
    """The store prefix of one attempt: `/arrived/<island>`, `/joining/<island>` ("join", or
    "late N": N outer steps late), `/decider<k>` (elected to decide; k > 0: to take over),
    `/members` (the decision) and `/done/<island>` (the attempt succeeded there)."""
    return f"{PREFIX}/{outer_step}/{attempt}"


def _launch_token() -> str:
    """A token of this launch of the island, the same on all of its ranks."""
    token = [uuid.uuid4().hex]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(token, src=0)
    return token[0]


class Quorum:
    """One island's side of the decisions; `last` is the last quorum it took part in."""

    def __init__(self, topology: Topology, quorum_timeout: float, timeout: timedelta):
        self.topology, self.store = topology, topology.store
        self.quorum_timeout, self.timeout = quorum_timeout, timeout
        self.last = list(range(topology.islands))
        self.launch = _launch_token()  # what its rank 0 writes on arriving

    def grace(self, outer_step: int) -> float:
        """Seconds the decision of `outer_step` waits for the islands of the last quorum."""
        return max(self.quorum_timeout, START_TIMEOUT) if outer_step == 0 else self.quorum_timeout

    def starts_as_joiner(self) -> None:
        """Say at the first outer step that this island joins later, so that no one waits for it."""
        if self.topology.island_rank == 0:
            self.store.set(f"{step_key(0)}/joining/{self.topology.island}", "join")

    def members(self, outer_step: int, attempt: int, joining: bool = False, final: bool = False,
                late: int = 0) -> Optional[list[int]]:
        """The members decided for an attempt, once this island has arrived (`late`: a joiner's
        outer steps late). None: a joiner found its dead launch's arrival there."""
        t, key = self.topology, step_key(outer_step, attempt)
        before = step_key(outer_step, attempt - 1) if attempt else None  # the attempt it retries
        arrival = f"{key}/arrived/{t.island}"
        if joining and self.store.check([arrival]) and self.store.get(arrival).decode() != \
                self.launch:  # its group may wait for that launch: never for this one
            if t.island_rank == 0:
                logger.warning(f"outer step {outer_step}: an earlier launch of this island "
                               "arrived at it and died; this island joins a later one")
            return None
        if t.island_rank == 0:
            if joining:
                self.store.set(f"{key}/joining/{t.island}", f"late {late}" if late else "join")
            self.store.set(arrival, self.launch)
            if not joining and self._elected(key, 0):
                self._decide(key, final, self._arrived(key, outer_step, before))
        self._wait_for_decision(key, joining, outer_step, attempt, final)
        return [int(i) for i in self.store.get(f"{key}/members").decode().split(",")]

    def announced(self, outer_step: int, attempt: int, island: int) -> Optional[list[str]]:
        """How `island` announced itself: ["join"], ["late", N] or None (a member)."""
        key = f"{step_key(outer_step, attempt)}/joining/{island}"
        return self.store.get(key).decode().split() if self.store.check([key]) else None

    def completed(self, outer_step: int, attempt: int) -> list[int]:
        """The islands whose attempt succeeded."""
        return self._arrivals(step_key(outer_step, attempt), "done")

    def succeeded(self, outer_step: int, attempt: int) -> None:
        """The attempt succeeded on this island (told to a member whose exchange failed alone)."""
        if self.topology.island_rank == 0:
            self.store.set(f"{step_key(outer_step, attempt)}/done/{self.topology.island}", "1")

    def _elected(self, key: str, k: int) -> bool:
        """Whether this island is the k-th elected to decide `key` (one is, whoever asks)."""
        me = str(self.topology.island)
        return self.store.compare_set(f"{key}/decider{k}", "", me).decode() == me

    def _decide(self, key: str, final: bool, arrived: list[int]) -> None:
        """Decide `key`: those that `arrived` (the last step: no joiner), unless one did first."""
        if final:
            arrived = [i for i in arrived if not self.store.check([f"{key}/joining/{i}"])]
        self.store.compare_set(f"{key}/members", "", ",".join(map(str, arrived)))

    def _take_over(self, key: str, k: int, outer_step: int, final: bool) -> None:
        """No decision in time: the elected island died deciding. The first island to see it
        decides without it and without the k - 1 islands elected after it."""
        if self.topology.island_rank != 0 or not self._elected(key, k):
            return
        gone = [int(self.store.get(f"{key}/decider{j}")) for j in range(k)]
        arrived = [i for i in self._arrivals(key) if i not in gone]
        logger.warning(f"outer step {outer_step}: island {gone[-1]} was to decide who takes it "
                       f"and did not; island {self.topology.island} decides without {gone}")
        self._decide(key, final, arrived)

    def _arrived(self, key: str, outer_step: int, before: Optional[str] = None) -> list[int]:
        """The islands arrived for `key` (an attempt of `outer_step`) once the whole last quorum
        did or its grace passed; or, if islands completed the attempt it retries (it failed here
        alone), just those."""
        deadline = time.monotonic() + self.grace(outer_step)
        while True:
            completed = [] if before is None else self._arrivals(before, "done")
            if completed:
                return completed
            arrived, awaited = self._arrivals(key), set(self.last)
            if outer_step == 0:  # at the start, a joiner says so instead of arriving
                awaited -= set(self._arrivals(key, "joining"))
            if awaited <= set(arrived) or time.monotonic() > deadline:
                return arrived
            time.sleep(0.01)

    def _arrivals(self, key: str, what: str = "arrived") -> list[int]:
        """The islands that announced themselves for `key` so far (`done`: that completed it)."""
        return [i for i in range(self.topology.islands)
                if self.store.check([f"{key}/{what}/{i}"])]

    def _wait_for_decision(self, key: str, joining: bool, outer_step: int, attempt: int,
                           final: bool) -> None:
        """Wait for the decision on `key`: it comes within the quorum timeout, but a joiner's
        first attempt waits for the live islands' next outer step (or the run's end). A member
        that sees none takes over (_take_over); a joiner's retry raises MissedRound."""
        first_join = joining and attempt == 0
        bound = self.timeout.total_seconds() if first_join else (
            self.grace(outer_step) + DECISION_SLACK)
        deadline, takeovers = time.monotonic() + bound, 0
        while not self.store.check([f"{key}/members"]):
            if first_join and self.store.check([f"{PREFIX}/ended"]):
                step = self.store.get(f"{PREFIX}/ended").decode()
                raise JoinRefused(f"--diloco_join: the live islands ended the run at step "
                                 f"{step}; no outer step is left to join (to train on, resume "
                                 "every island with a larger --max_steps)")
            if time.monotonic() > deadline:
                if first_join:
                    raise JoinRefused(f"--diloco_join: no outer step of the live islands "
                                     f"within {bound:.0f} s")
                if joining:
                    raise MissedRound()
                if takeovers == self.topology.islands - 1:
                    raise IslandLost(
                        f"outer step {outer_step}: no quorum of islands within "
                        f"{bound + takeovers * DECISION_SLACK:.0f} s; start this island again "
                        "with --diloco_join --resume_from_checkpoint auto")
                takeovers += 1
                self._take_over(key, takeovers, outer_step, final)
                deadline = time.monotonic() + DECISION_SLACK  # a live taker decides at once
            time.sleep(0.05 if joining else 0.01)
