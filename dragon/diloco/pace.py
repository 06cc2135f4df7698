"""Islands of unequal speed (--diloco_island_steps): in each window of H inner steps an island
trains only as many steps as its speed allows, spread evenly over the window, and rests through
the others, so that every island reaches each outer step at about the same time and a fast
island does not wait for a slow one.

Every island still counts every step of the window: the step count, the LR schedule, the save
points and the outer steps stay the same on every island; only the work differs. A resting step
reads no batch and takes no optimizer step.

The plan (the steps each island trains per window) is fixed by the user ("8,5") or, with
"auto", set at every outer step from the seconds of a trained step that each island measured
since its last one: island i trains k_i = clamp(floor(H t_fastest / t_i + SLACK), 1, H) steps,
the most that fit in the fastest island's window (so that the fastest, which trains every step,
does not wait; SLACK keeps timing noise from costing an equal island a step). Every island reads
every island's figures from one small all-reduce, so all hold the same plan.

The outer average weights each island's pseudo-gradient by the tokens it trained since its last
outer step (its trained steps x its tokens per step), as Decoupled DiLoCo (Douillard et al.,
2026) weights its learners: an island sends n T_i / sum_j T_j times its pseudo-gradient, and
the exchange's mean over the n islands is the token-weighted mean.
"""

import time
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from dragon.parallel.distributed import all_reduce_values

if TYPE_CHECKING:  # annotations only
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
    (None: auto, every island all H until the first outer step measures them);
    `tokens_per_step`: this island's tokens in a trained step."""

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
        """At an outer step that syncs, among the `members` meeting in `group` (rank r of each):
        every member's tokens and step seconds since its last one, in one all-reduce. Returns
        the scale of this island's pseudo-gradient (the contributors, whose average the
        exchange takes, times w_i T_i / sum w T; `weight`: each contributor's w, by staleness
        dragon.diloco.membership.staleness_weight; a joiner has none), the step's metrics (its
        steps, tokens, weight, seconds a step, and the seconds since its last trained step: its
        rest and its wait for the others) and the plan from here on (auto: from the members'
        seconds). Nothing changes until settle(plan): an elastic round may be retried."""
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
        """A saved pace (None: saved with equal islands; this one starts its window afresh). A
        fixed plan given now stands over the saved one."""
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
