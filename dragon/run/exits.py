"""How a recipe process ends, as its exit status (the recipe ends with end_process(status)): a
finished run tears its process groups down (0); an early end (RunStopped: a refusal, a preemption,
a failed step or save) gives its one line and code; a peer that died or whose link broke is named
in one line; any other error is this process's own fault and keeps its traceback."""

import atexit
import os
import sys
from typing import Callable, NoReturn, Union

from dragon.errors import RunStopped
from dragon.parallel.distributed import (end_distributed, peer_failed, peer_lost,
                                         started_distributed)


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


def end_process(status: Union[int, str, None]) -> NoReturn:
    """End this process as sys.exit(status) would (a string is printed to stderr, exit code 1).

    A process that started a process group runs Python's exit handlers (the run lock, logging,
    trackers) and then ends without the interpreter's finalization: there gloo's threads, still
    holding work of DeepSpeed's or DiLoCo's groups, now and then abort the process (SIGABRT,
    "terminate called without an active exception") after a run that ended well, or after the
    one line of a run that stopped. A process that never started one exits normally."""
    if not started_distributed():
        sys.exit(status)
    if isinstance(status, str):
        print(status, file=sys.stderr)
    code = status if isinstance(status, int) else (0 if status is None else 1)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
