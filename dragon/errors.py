"""How a run ends before its last step: one exception per outcome, each with its exit code and one
line for the user. Library code raises them and never ends the process itself:
dragon.run.exits.run_recipe catches RunStopped once, and each recipe exits with what it returns,
`end_process(run_recipe(main))`."""

import os
import warnings


class RunStopped(Exception):
    """The run stops here, for `reason` (one line); exit code 1 unless a subclass says 0."""

    exit_code = 1

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason

    def exit_status(self):
        """What sys.exit takes: "error: <reason>" (printed to stderr, exit code 1) on the rank
        that reports (rank 0 of the process group, or of the launch before there is one), 1
        elsewhere, so a launch prints its error once; 0 for an end its raiser has reported."""
        if not self.exit_code:
            return 0
        return f"error: {self.reason}" if _reporting_rank() else self.exit_code


def warn(message: str) -> None:
    """warnings.warn(message) on the rank that reports, so that a launch says it once."""
    if _reporting_rank():
        warnings.warn(message, stacklevel=2)


def _reporting_rank() -> bool:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


class InputRefused(RunStopped):
    """A bad argument, config, data file or resume target, found before any process group."""


class PlanShown(RunStopped):
    """--dry_run printed the plan of the run; nothing was trained."""

    exit_code = 0


class Preempted(RunStopped):
    """A preemption signal: every rank saved at the next safe point."""

    exit_code = 0


class TrainingFailed(RunStopped):
    """Non-finite steps past the policy, non-finite weights, or a save that failed."""


class IslandLost(RunStopped):
    """A DiLoCo island did not reach an outer step, or this island is out of the run."""


class JoinRefused(RunStopped):
    """--diloco_join found no outer step to join, or live islands of another shape."""


class PeerLost(RunStopped):
    """A collective failed: a rank of this world is gone (its node lost, its processes killed) or
    the link to it broke. Nothing was agreed, so every surviving node reports it once (its local
    rank 0), whichever rank is gone."""

    def exit_status(self):
        return f"error: {self.reason}" if os.environ.get("LOCAL_RANK", "0") == "0" else 1
