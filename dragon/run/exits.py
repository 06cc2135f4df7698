"""How a recipe process ends: a finished run tears its process groups down; an early end
(RunStopped: a refusal, a preemption, a failed step or save) prints its one line and exits with
its code; a peer that died or whose link broke is named in one line; any other error is this
process's own fault and keeps its traceback."""

import sys
from typing import Callable

from dragon.errors import RunStopped
from dragon.parallel.distributed import end_distributed, peer_failed, peer_lost


def run_recipe(main: Callable[[], None]) -> None:
    """Run a recipe's main() to its exit (module docstring)."""
    try:
        main()
    except RunStopped as stop:  # every early end: one line, and its exit code
        end_distributed()  # every rank agreed to stop: nothing is in flight
        sys.exit(stop.exit_status())
    except RuntimeError as error:
        if not peer_failed(error):  # a fault of this process: its traceback
            raise
        sys.exit(peer_lost(error).exit_status())  # a rank on another node died, or its link broke
    end_distributed()
