"""Elastic islands' side of an outer step (a part of dragon.diloco.outer.DiLoCo): the round
among the islands that reach it (dragon.diloco.membership runs and retries it), the late average
redone without a lost island, a joiner let in with the live islands' state, and the end of a run.
"""

from typing import Optional

import torch

from dragon.diloco.exchange import broadcast_object


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

    def _late_average(self, group, members: list[int]):
        """Delayed: the average in flight since the last outer step. When it failed on any member
        (an island died during it), the members redo it from their kept pseudo-gradients: the late
        average is then the survivors' average."""
        exchanges = [] if self.pending is None else [self.pending]
        contributors = self.membership.failed(
            self.outer_step, "the average in flight since the last outer step", exchanges,
            self.contributed, group)
        if contributors is None:
            return self.pending
        self.previous_share = contributors
        redo = self.exchange(self.previous.clone(), group, len(members), contributors)
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
        """After the last outer step: the exchange thread stops, and the membership ends the run
        (a fixed group waits for every island; elastic islands tell joiners where it ended)."""
        if self.background is not None:
            self.background.close()
        self.membership.finish(ended_at)
