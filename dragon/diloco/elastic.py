"""Elastic islands' side of an outer step (a part of dragon.diloco.outer.DiLoCo): the round
among the islands that reach it (dragon.diloco.membership runs and retries it), the late average
redone without a lost island, a joiner let in with the live islands' state, and the end of a run.
"""

import logging
from typing import Optional

import torch

from dragon.diloco.exchange import RoundOutcome, broadcast_object

logger = logging.getLogger("dragon")


class ElasticRounds:
    """What an outer step does with --diloco_elastic (and, for every run, its close)."""

    def join(self) -> tuple[int, dict]:
        """--diloco_join: wait to be let into the live islands' next outer step, take
        theta_outer, the outer optimizer's state and the step from them, and take that outer step
        with them (sync: their average; delayed: the gradient their first island applies), ending
        it on their weights. Returns the step and the outer step's metrics."""
        target, quorum = self.membership.admit(self.shape())
        self.outer_step = target - 1
        for stale in (self.previous, self.residual):  # what this island's checkpoint had
            if stale is not None:
                stale.zero_()
        self.pending, self.contributed = None, False
        metrics = self._outer_step(0, False, joining=quorum)
        return self.joined_step, metrics

    def shape(self) -> dict:
        return {"parameters on this rank": sum(self.numels), "H": self.H, "islands": self.islands,
                "fragments": self.config.fragments}

    def _elastic_round(self, delta, own, step: int, final: bool, joining=None) -> RoundOutcome:
        """The exchange among this outer step's quorum (`joining`: the quorum a joiner was let
        into), retried by the membership without an island lost during it; delayed, also the late
        average and the eager gradient. Joiners take the shared state."""

        def attempt(members: list[int], group, joiners: list[int]) -> RoundOutcome:
            late = self._late_average(group, members) if self.mode == "delayed" else None
            contributors = len(members) - len(joiners)
            exchange = self.exchange(delta.clone(), group, len(members), contributors)
            gradient, at_step = None, step
            if self.mode == "delayed":
                gradient = self.eager_gradient(own, late, exchange, final, contributors)
            if joiners:
                at_step, gradient = self._share_state(group, members, joiners, step, gradient)
            self.membership.publish(self.outer_step, at_step, self.shape())
            self.group = group
            return RoundOutcome(exchange, late, gradient, contributors, at_step)

        return self.membership.run_round(self.outer_step, attempt, joining, final)

    def _late_average(self, group, members: list[int]):
        """Delayed: the average in flight since the last outer step. When it failed on any member
        (an island died during it), the members redo it from their kept pseudo-gradients: the late
        average is then the survivors' average."""
        failed = 0.0
        if self.pending is not None:
            try:
                self.pending.result()
            except RuntimeError:
                failed = 1.0
        flags = [failed, float(self.contributed)]
        if group is not None:
            t = torch.tensor(flags, dtype=torch.float64)
            group.allreduce([t]).wait()
            flags = t.tolist()
        if flags[0] == 0:
            return self.pending
        logger.warning(f"outer step {self.outer_step}: the average in flight since the last outer "
                       f"step failed; islands {members} redo it among themselves")
        self.previous_share = max(int(flags[1]), 1)
        redo = self.exchange(self.previous.clone(), group, len(members), self.previous_share)
        redo.result()
        return redo

    def _share_state(self, group, members: list[int], joiners: list[int], step: int, gradient):
        """Broadcast theta_outer, the outer optimizer's state, the step and (delayed) the outer
        gradient from the first member that is not joining; the joiners take theta_outer and the
        optimizer's state. Returns (step, gradient) as the sender has them."""
        root = members.index(min(i for i in members if i not in joiners))
        joining = self.topology.island in joiners
        state = None if joining else {
            "step": step,
            "theta_outer": [p.detach().cpu() for p in self.outer_params],
            "optimizer": self.outer_optimizer_state(),
            "gradient": gradient,
        }
        state = broadcast_object(state, group, root)
        if joining:
            with torch.no_grad():
                for p, v in zip(self.outer_params, state["theta_outer"]):
                    p.copy_(v.view_as(p))
            self.load_outer_optimizer_state(state["optimizer"])
        return state["step"], state["gradient"]

    def outer_optimizer_state(self):
        return self.optimizer.state_dict()

    def load_outer_optimizer_state(self, state) -> None:
        self.optimizer.load_state_dict(state)

    def close(self, ended_at: Optional[int] = None) -> None:
        """Wait for every island after the last outer step (so the store outlives its users); an
        elastic run's store runs on its own, and its islands may be gone: a run that `ended_at`
        its last step says so to islands still joining."""
        if self.background is not None:
            self.background.close()
        if self.membership is None:
            self.topology.barrier()
        elif ended_at is not None:
            self.membership.end(ended_at)
