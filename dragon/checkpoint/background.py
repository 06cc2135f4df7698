"""Saves whose files are written in the background (--save_async).

A save hands every file it writes to BackgroundSaves instead of writing it; once the save's calls
return, start() forks a writer process that writes them all, checksums and fsyncs them, and
reports back through a pipe. The fork is the snapshot: the child sees the state as it was at the
fork (the kernel copies a page only when training changes it), and no writer thread contends for
the training process's GIL or CPU. What makes a save complete stays on the training thread, where
every rank calls the same collectives in the same order: once every rank's writer has reported
(poll(), after each step), the save's completions run (dragon.checkpoint.retention: every rank's
writes agreed, then the completion marker, `latest` and the prune). Until then the checkpoint has
no marker, so a crash or a SIGKILL during a background write leaves the previous checkpoint as
the resume point; the writer dies with its rank.

DeepSpeed 0.19.8's decoupled checkpoint engine does not serve here: on CPU it refuses to put a
ZeRO optimizer's state on its writer's queue (tensors that require grad), and it waits for the
write at the next optimizer step anyway, since it shares the live tensors rather than copying
them.
"""

import ctypes
import os
import pickle
import signal
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from dragon.parallel.distributed import all_reduce_values


class BackgroundSaves:
    """The files of the save in flight, its writer process, and its completions (module
    docstring)."""

    def __init__(self):
        self._jobs: list[tuple] = []  # (GuardedWrites, write, state, path) not yet started
        self._writer: threading.Thread | None = None  # waits for the writer process's report
        self._completions: list[Callable[[], None]] = []

    def submit(self, writes, write: Callable[[Any, str], None], state: Any, path: str) -> None:
        """Have the writer process write `state` to `path` with write(state, path) for `writes`
        (a dragon.checkpoint.writes.GuardedWrites, which keeps its error and checksums)."""
        if any(t.device.type != "cpu" for t in _tensors(state)):
            state = _to_cpu(state)  # an accelerator's memory does not cross a fork
        self._jobs.append((writes, write, state, path))

    def then(self, completion: Callable[[], None]) -> None:
        """Run `completion` (a collective) on the training thread once every rank's writes are
        done."""
        self._completions.append(completion)

    def start(self) -> None:
        """Fork the writer of the files submitted so far; returns at once."""
        if not self._jobs:
            return
        jobs, self._jobs = self._jobs, []
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the writer: write, report, leave without running the parent's exit code
            os.close(read_end)
            try:
                _write_all(jobs, write_end)
            finally:
                os._exit(0)
        os.close(write_end)
        self._writer = threading.Thread(target=_collect, args=(pid, read_end, jobs),
                                        name="dragon-save-writer", daemon=True)
        self._writer.start()

    @property
    def in_flight(self) -> bool:
        """Whether a save has yet to complete (the same on every rank)."""
        return bool(self._completions)

    def written(self) -> bool:
        """Whether this rank's files are all written (or failed)."""
        self.start()
        return self._writer is None or not self._writer.is_alive()

    def poll(self) -> None:
        """Complete the save in flight if every rank has written its files (a collective, called
        by every rank at the same points); else return at once."""
        if not self.in_flight:
            return
        if dist.is_initialized() and dist.get_world_size() > 1:
            if all_reduce_values([float(self.written())], dist.ReduceOp.MIN)[0] == 0:
                return
        elif not self.written():
            return
        self.complete()

    def complete(self) -> None:
        """Wait for this rank's writes, then run the completions in order (a collective): they
        raise SaveFailed on every rank when some rank's writes failed."""
        self.start()
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        completions, self._completions = self._completions, []
        for completion in completions:
            completion()


def _write_all(jobs: list[tuple], report_fd: int) -> None:
    """In the writer process: every job, then each GuardedWrites' error and checksums."""
    _die_with_parent()
    _lowest_priority()
    for preemption in (signal.SIGTERM, signal.SIGINT):  # the rank acts on it, and waits for this
        signal.signal(preemption, signal.SIG_IGN)
    for writes, write, state, path in jobs:
        writes.write_now(write, state, path)
    done = {id(writes): writes for writes, *_ in jobs}
    report = {key: (writes.error, writes.checksums) for key, writes in done.items()}
    with os.fdopen(report_fd, "wb") as f:
        f.write(pickle.dumps(report))


def _collect(pid: int, read_fd: int, jobs: list[tuple]) -> None:
    """In the training process: the writer's report into each GuardedWrites of its jobs."""
    with os.fdopen(read_fd, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    report = pickle.loads(data) if data else {}
    for writes, *_ in jobs:
        error, checksums = report.get(id(writes), (None, {}))
        if id(writes) not in report:
            error = f"the writer process ended before it reported (wait status {status})"
        writes.error = writes.error or error
        writes.checksums.update(checksums)


def _tensors(state: Any):
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from _tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _tensors(value)


def _to_cpu(state: Any) -> Any:
    """`state` with every tensor copied to the CPU (each storage once, views kept)."""
    storages: dict = {}

    def move(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in storages:
            storages[storage._cdata] = storage.cpu()
        moved = torch.empty(0, dtype=t.dtype)
        return moved.set_(storages[storage._cdata], t.storage_offset(), t.size(), t.stride())

    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return move(obj.detach())
        if isinstance(obj, dict):
            return type(obj)((k, walk(v)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(walk(v) for v in obj)
        return obj

    return walk(state)


def _die_with_parent() -> None:
    """The writer ends with the rank that forked it (Linux's PR_SET_PDEATHSIG): a killed rank
    leaves no process writing into a checkpoint that a resume may save again."""
    try:
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        pass
    if os.getppid() == 1:  # the rank died before the line above
        os._exit(1)


def _lowest_priority() -> None:
    """The writer yields the CPU to training wherever both want it: the write takes longer, the
    steps do not."""
    os.setpriority(os.PRIO_PROCESS, 0, 19)


def durable(path: str) -> None:
    """fsync a written file, so that a marker written after it never names bytes still in the
    page cache only."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
