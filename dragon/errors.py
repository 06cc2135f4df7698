"""How a run ends before its last step: one exception per outcome, each with its exit code and one
line for the user. Library code raises them and never ends the process itself; each recipe's
main() catches RunStopped once and exits with `sys.exit(stop.exit_status())`."""


class RunStopped(Exception):
    """The run stops here, for `reason` (one line); exit code 1 unless a subclass says 0."""

    exit_code = 1

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason

    def exit_status(self):
        """What sys.exit takes: "error: <reason>" (printed to stderr, exit code 1), or 0 for an
        end that its raiser has already reported."""
        return f"error: {self.reason}" if self.exit_code else 0


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
