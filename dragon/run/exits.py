"""How a recipe process ends, as its exit status (the recipe itself calls sys.exit with it): a
finished run tears its process groups down (0); an early end (RunStopped: a refusal, a preemption,
a failed step or save) gives its one line and code; a peer that died or whose link broke is named
in one line; any other error is this process's own fault and keeps its traceback."""

from typing import Callable, Union

from dragon.errors import RunStopped
from dragon.parallel.distributed import end_distributed, peer_failed, peer_lost


def run_recipe(main: Callable[[], None]) -> Union[int, str]:
    """Run a recipe's main(); what sys.exit takes for the way it ended (module docstring)."""
    try:
        main()
    except RunStopped as stop:  # every early end: one line, and its exit code
        end_distributed()  # every rank agreed to stop: nothing is in flight
        return stop.exit_status()
    except RuntimeError as error:
        if not peer_failed(error):  # a fault of this process: its traceback
            raise
        return peer_lost(error).exit_status()  # a rank on another node died, or its link broke
    end_distributed()
    return 0
