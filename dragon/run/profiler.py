"""--profile_steps A:B: a torch.profiler trace of steps A to B on every rank, written under the
run's directory as <run dir>/profile/rank<r>/rank<r>.<ns>.pt.trace.json (torch's
tensorboard_trace_handler: Chrome's trace format, which TensorBoard's profiler plugin and
Perfetto open), and after step B, on rank 0, a table of the operators that took the most self
CPU time. A recipe makes one StepProfiler and calls its step() once at the end of every step."""

import os
import re
from typing import Optional

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile, tensorboard_trace_handler


TOP_OPERATORS = 10


_WINDOW = re.compile(r"(\d+):(\d+)")


def profile_window(text: str, max_steps: int) -> tuple[int, int]:
    """(A, B) of --profile_steps A:B; a one-line ValueError unless 1 <= A <= B <= max_steps."""
    match = _WINDOW.fullmatch(text.strip())
    first, last = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
    if not 1 <= first <= last <= max_steps:
        # YAML 1.1 reads an unquoted 2:3 as the base-60 number 123
        quote = "; quote it in a YAML file (\"2:3\")" if text.strip().isdigit() else ""
        raise ValueError(
            f"--profile_steps {text!r}: valid is A:B, the first and last step to profile, "
            f"1 <= A <= B <= --max_steps {max_steps} (e.g. 2:3){quote}"
        )
    return first, last


class StepProfiler:
    """torch.profiler over steps A..B of this rank; with `window` None it does nothing. `done`:
    the steps done before the loop starts (a resume profiles what is left of A..B)."""

    def __init__(self, window: Optional[str], run_dir: str, rank: int, max_steps: int,
                 done: int = 0):
        self.first, self.last = profile_window(window, max_steps) if window else (0, -1)
        self.rank = rank
        self.trace_dir = os.path.join(run_dir, "profile", f"rank{rank}")
        self._profiler: Optional[profile] = None
        self._start_before(done + 1)

    def step(self, step: int) -> None:
        """At the end of step `step`: the profiler starts before step A, marks each step, and
        after step B writes the trace (rank 0 prints its table)."""
        if self._profiler is None:
            self._start_before(step + 1)
        elif step < self.last:
            self._profiler.step()  # the trace's ProfilerStep#<step + 1> begins
        else:
            self._profiler.stop()  # calls the trace handler: the file is written
            if self.rank == 0:
                print(self.table(), flush=True)
            self._profiler = None

    def _start_before(self, step: int) -> None:
        if not self.first <= step <= self.last:
            return
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        handler = tensorboard_trace_handler(self.trace_dir, worker_name=f"rank{self.rank}")
        self._profiler = profile(activities=activities, on_trace_ready=handler,
                                 schedule=_record_every_step)
        self._profiler.step_num = step  # the trace's ProfilerStep#N are the run's step numbers
        self._profiler.start()
        self.first = step

    def table(self) -> str:
        """The operators of steps A..B by self CPU time, as torch.profiler prints them."""
        averages = self._profiler.key_averages()
        return (f"torch.profiler, steps {self.first}-{self.last} on rank {self.rank} (traces in "
                f"{os.path.dirname(self.trace_dir)}): the top {TOP_OPERATORS} operators by self "
                "CPU time\n"
                + averages.table(sort_by="self_cpu_time_total", row_limit=TOP_OPERATORS))


def _record_every_step(step: int) -> ProfilerAction:
    # torch marks steps in the trace (ProfilerStep#N) only for a profiler with a schedule; this
    # one records from start() to stop(), which StepProfiler calls around steps A..B.
    return ProfilerAction.RECORD
