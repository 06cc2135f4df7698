"""What a run does when something goes wrong between two steps: a preemption signal, a loss or
gradient norm that is not finite. Every rank reaches the same verdict (one small all-reduce per
step), so no rank is ever left waiting in a collective the others skipped."""

import logging
import math
import signal
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from dragon.errors import IslandLost
from dragon.parallel.distributed import all_reduce_values

logger = logging.getLogger("dragon")

NAN_POLICIES = ("skip", "stop")
SAVE_FAILURES = ("stop", "continue")
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass
class Verdict:
    """What the recipe does after a step: save now (a preemption's safe point), stop."""

    save: bool = False
    stop: bool = False
    exit_code: int = 0
    message: str = ""


class StepGuard:
    """Preemption signals and non-finite steps, agreed by every rank of this world.

    SIGTERM or SIGINT (to the launcher, which forwards it, or to any one rank) only sets a flag;
    after the step the ranks agree on it, save at the next safe point and exit 0. With DiLoCo the
    islands share the flag at each outer step, the only point at which they save together, and
    an island missing there (dead, or past the timeout) stops the others with its name. A second
    signal is not caught: it ends the process at once.
    """

    def __init__(self, nan_policy: str, max_bad_steps: int, topology=None):
        self.nan_policy, self.max_bad_steps, self.topology = nan_policy, max_bad_steps, topology
        self.signal: Optional[int] = None
        self.bad_steps = 0
        self._previous = {s: signal.signal(s, self._on_signal) for s in PREEMPT_SIGNALS}

    def _on_signal(self, signum, frame) -> None:
        self.signal = signum
        for s, handler in self._previous.items():  # a second signal acts at once
            signal.signal(s, handler)

    def signalled(self) -> bool:
        """Whether any rank of this world got a preemption signal (a collective)."""
        return _all_reduce_max([float(self.signal or 0)])[0] > 0

    def after_step(
        self, step: int, loss: float, grad_norm: Optional[float], boundary: bool = True
    ) -> Verdict:
        """The verdict after optimizer step `step` with this rank's `loss` and the gradient norm
        (None where unknown); `boundary`: whether a save is consistent here (DiLoCo: an outer
        step)."""
        values = [
            float(self.signal or 0),  # the signal's number, as any rank got it
            float(not math.isfinite(loss)),
            float(grad_norm is not None and not math.isfinite(grad_norm)),
        ]
        flags = _all_reduce_max(values)
        preempted = flags[0] > 0
        if boundary and self.topology is not None and self.topology.cross_group is not None:
            self.topology.reach(step)
            try:
                preempted = _all_reduce_max([flags[0]], self.topology.cross_group)[0] > 0
            except RuntimeError as e:  # gloo: the peer's connection closed, or the timeout
                raise IslandLost(self.topology.lost(step, e)) from None
        if flags[1] > 0 or flags[2] > 0:
            self.bad_steps += 1
            what = "loss" if flags[1] > 0 else "gradient norm"
            value = loss if not math.isfinite(loss) else grad_norm
            shown = value if value is not None and not math.isfinite(value) else "nan"
            if self.nan_policy == "stop" or self.bad_steps >= self.max_bad_steps:
                return Verdict(
                    stop=True,
                    exit_code=1,
                    message=(
                        f"step {step}: the {what} is {shown} on some rank, "
                        f"{self.bad_steps} bad step(s) in a row (--nan_policy {self.nan_policy}, "
                        f"--max_bad_steps {self.max_bad_steps}); the update was not applied"
                    ),
                )
            logger.warning(
                f"step {step}: the {what} is {shown} on some rank; the update was skipped "
                f"({self.bad_steps} of at most {self.max_bad_steps} bad steps in a row)"
            )
        else:
            self.bad_steps = 0
        if preempted and boundary:
            got = signal.Signals(int(flags[0])).name if flags[0] else "SIGTERM or SIGINT"
            where = "this rank" if self.signal else "another rank" if flags[0] else "another island"
            return Verdict(
                save=True,
                stop=True,
                message=f"preempted ({got} to {where}): saved step {step}; continue with "
                "--resume_from_checkpoint latest",
            )
        return Verdict()


def _all_reduce_max(values: list[float], group=None) -> list[float]:
    """The maximum over this world, or over `group` (a cross-island gloo group)."""
    if group is None:
        return all_reduce_values(values, dist.ReduceOp.MAX)
    t = torch.tensor(values, dtype=torch.float64)
    group.allreduce([t], dist.ReduceOp.MAX).wait()
    return t.tolist()
