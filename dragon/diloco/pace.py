"""Islands of unequal speed (--diloco_island_steps): in each window of H inner steps an island
trains only the steps its speed allows, spread evenly, and rests through the others, so that all
islands reach each outer step at about the same time. Every island still counts every step (the
LR schedule, saves and outer steps stay the same); a resting step reads no batch and takes no
optimizer step. The plan, the steps each island trains per window, is fixed ("8,5") or, with
"auto", set at every outer step from the islands' measured seconds a step (Pace.agree). The outer
average weights each island's pseudo-gradient by the tokens T_i it trained since its last outer
step, as Decoupled DiLoCo (Douillard et al., 2026) weights its learners: an island sends
n T_i / sum_j T_j times its pseudo-gradient, so the exchange's mean is token-weighted."""

import time
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from dragon.parallel.distributed import all_reduce_values

if TYPE_CHECKING:
    from dragon.diloco.config import DiLoCoConfig
    from dragon.parallel.topology import Topology

AUTO = "auto"
SLACK = 0.1  # of a step: an island this close to fitting one more step in the window trains it


def trains_at(step: int, k: int, H: int) -> bool:
    """Whether an island that trains k of every H steps trains inner step `step` (1-based): the
    k steps spread evenly over the window, its last step always among them."""
    p = (step - 1) % H
    return (p + 1) * k // H > p * k // H


class Pace:
    """One island's side of unequal islands. `plan`: the steps each island trains per window
    (None: auto, all H until the first outer step measures them); `tokens_per_step`: its own."""

    def __init__(self, plan: Optional[list[int]], H: int, islands: int, island: int,
                 tokens_per_step: int = 1):
        self.auto = plan is None
        self.plan = list(plan) if plan is not None else [H] * islands
        self.H, self.islands, self.island = H, islands, island
        self.tokens_per_step = tokens_per_step
        self.trained = 0  # steps trained since the last outer step
        self.seconds = 0.0  # their time
        self._began: Optional[float] = None
        self._last_end = time.perf_counter()  # of a trained step: what follows is waiting

    def trains(self, step: int) -> bool:
        """Whether this island trains inner step `step` (else it rests); starts its clock."""
        if trains_at(step, self.plan[self.island], self.H):
            self.trained += 1
            self._began = time.perf_counter()
            return True
        return False

    def islands_training(self, step: int) -> int:
        """How many islands train inner step `step` under the plan (each of them its tokens)."""
        return sum(trains_at(step, k, self.H) for k in self.plan)

    def ended(self) -> None:
        """After a trained step's optimizer step, before anything waits for other islands."""
        if self._began is not None:
            self._last_end = time.perf_counter()
            self.seconds += self._last_end - self._began
            self._began = None

    def agree(self, group, members: list[int], weight: dict
              ) -> tuple[float, dict, list[int]]:
        """At an outer step that syncs: every member's tokens and seconds a step since its last
        one, in one all-reduce over `group` (rank r of each island). Returns this island's
        pseudo-gradient scale (the contributors x w_i T_i / sum w T; `weight`: each contributor's
        dragon.diloco.membership.staleness_weight, none for a joiner), the metrics, and the plan
        from here on (auto: for each member, the most steps that fit in the fastest one's window).
        Nothing changes until settle(plan): an elastic round may be retried."""
        n = self.islands
        # the island's slowest rank: every rank of an island must come to the same plan
        step_seconds = all_reduce_values([self.seconds / max(self.trained, 1)],
                                         dist.ReduceOp.MAX)[0]
        mine = torch.zeros(2 * n, dtype=torch.float64)
        mine[self.island] = self.trained * self.tokens_per_step
        mine[n + self.island] = step_seconds
        if group is not None:
            group.allreduce([mine], dist.ReduceOp.SUM).wait()
        waited = time.perf_counter() - self._last_end  # resting, then for the other islands
        tokens, seconds = mine[:n].tolist(), mine[n:].tolist()
        weighed = [tokens[i] * weight.get(i, 0.0) for i in range(n)]
        total, own = sum(weighed), weight.get(self.island, 0.0)
        share = weighed[self.island] / total if total > 0 else own / sum(weight.values())
        plan, timed = list(self.plan), [i for i in members if seconds[i] > 0]
        if self.auto and timed:  # a joiner has trained no step yet: its entry stays
            fastest = min(seconds[i] for i in timed)
            for i in timed:
                plan[i] = min(self.H, max(1, int(self.H * fastest / seconds[i] + SLACK)))
        metrics = {"island_steps": self.trained, "island_tokens": int(tokens[self.island]),
                   "outer_weight": share, "island_step_seconds": seconds[self.island],
                   "island_waited_seconds": waited, "island_plan": plan[self.island]}
        return share * len(weight), metrics, plan

    def settle(self, plan: list[int]) -> None:
        """The round that agreed on `plan` succeeded: a new window of counts begins."""
        self.plan, self.trained, self.seconds = plan, 0, 0.0

    def state_dict(self) -> dict:
        return {"plan": list(self.plan), "trained": self.trained, "seconds": self.seconds}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """A saved pace (None: saved with equal islands, so start afresh); a fixed plan wins."""
        if state is None:
            return
        if self.auto:
            self.plan = list(state["plan"])
        self.trained, self.seconds = state["trained"], state["seconds"]


def pace_for(config: "DiLoCoConfig", topology: "Topology", tokens_per_step: int
             ) -> Optional[Pace]:
    """This island's Pace for --diloco_island_steps; None when every island trains every step."""
    if config.island_steps is None:
        return None
    plan = None if config.island_steps == AUTO else config.island_steps
    return Pace(plan, config.inner_steps, topology.islands, topology.island, tokens_per_step)
