"""Saves whose files are written in the background (--save_async).

A save hands every file it writes to BackgroundSaves instead of writing it. Once the save's calls
return, start() takes the snapshot: it copies every tensor storage of the save's states into one
shared-memory buffer of the rank (a memfd, sized at the first save and grown only when a save
outgrows it) and pickles the rest of the states, a few kilobytes, with each storage named by its
place in the buffer. The rank's writer process (dragon.checkpoint.writer: a fresh interpreter at
the lowest priority, started once, with the BackgroundSaves) rebuilds the states on the buffer,
writes each file with the save's own writer (torch.save, DeepSpeed's checkpoint engine) straight
to the disk, checksummed as it writes (dragon.checkpoint.stream), fsyncs it, and reports back
through a pipe. So the step pays for a memory copy and a message:
no fork copies the rank's page tables, no copy-on-write charges the steps after it for every page
they write, and no writer thread contends for the training process's GIL. A rebuilt state pickles
exactly as the original (the same storages, views, shared storages and objects), so a background
file is the synchronous save's file, byte for byte. The buffer holds one save at a time: a save
waits for the writer's report of the one before it.

What makes a save complete stays on the training thread, where every rank calls the same
collectives in the same order: once every rank's writer has reported (poll(), after each step),
the save's completions run (dragon.checkpoint.save_hook's SaveHook.complete: every rank's writes
agreed, then the completion marker, `latest` and the prune, whose deleted checkpoints the writer
removes: freeing their pages takes no training time). The hook owns the BackgroundSaves of its
engine's saves. Until then the checkpoint has no marker, so a crash or
a SIGKILL during a background write leaves the previous checkpoint as the resume point; the writer
dies with its rank (it ignores the SIGTERM and SIGINT that its rank acts on). A writer that ends
before it reports fails the save in flight on every rank (SaveFailed); the next save starts
another.

DeepSpeed 0.19.8's decoupled checkpoint engine does not serve here: on CPU it refuses to put a
ZeRO optimizer's state on its writer's queue (tensors that require grad), and it waits for the
write at the next optimizer step anyway, since it shares the live tensors rather than copying
them.
"""

import inspect
import io
import mmap
import os
import pickle
import shutil
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from dragon.parallel.distributed import all_reduce_values

ALIGNMENT = 64  # bytes: each storage's place in the buffer
# The writer takes the lowest priority before it imports anything (SCHED_IDLE: a training thread
# that wakes takes its core at once, not after a slice), and runs this very dragon.
BOOT = ("import os, sys; os.setpriority(os.PRIO_PROCESS, 0, 19); "
        "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)); "
        "sys.path.insert(0, sys.argv[1]); "
        "from dragon.checkpoint.writer import main; main(*map(int, sys.argv[2:]))")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class BackgroundSaves:
    """The files of the save in flight, its rank's writer process, and its completions (module
    docstring)."""

    def __init__(self):
        self._jobs: list[tuple] = []  # (GuardedWrites, write, state, path) not yet started
        self._writing: list = []  # the GuardedWrites of the save in the writer, till it reports
        self._writer = WriterProcess()  # now: it has imported what it needs by the first save
        self._completions: list[Callable[[], None]] = []
        self._removing = False  # the writer was handed a directory to remove since it settled

    def submit(self, writes, write: Callable[[Any, str], None], state: Any, path: str) -> None:
        """Have the writer process write `state` to `path` with write(state, path) for `writes`
        (a dragon.checkpoint.writes.GuardedWrites, which keeps its error and checksums). `write`
        must pickle: a function, or a method of an object that pickles (a checkpoint engine)."""
        self._jobs.append((writes, _portable(write), state, path))

    def then(self, completion: Callable[[], None]) -> None:
        """Run `completion` (a collective) on the training thread once every rank's writes are
        done."""
        self._completions.append(completion)

    def start(self) -> None:
        """Hand the files submitted so far to the writer: returns once they are copied into the
        shared buffer (after the writer's report of the save before them, if it is still
        writing)."""
        if not self._jobs:
            return
        self._collect(block=True)  # the buffer is that save's until it is written
        jobs, self._jobs = self._jobs, []
        if not self._writer.alive():  # it died with the save before: another
            self._writer = WriterProcess()
        groups = list({id(writes): writes for writes, *_ in jobs}.values())
        index = {id(writes): i for i, writes in enumerate(groups)}
        self._writer.send(len(groups), [(index[id(w)], write, state, path)
                                        for w, write, state, path in jobs])
        self._writing = groups

    @property
    def in_flight(self) -> bool:
        """Whether a save has yet to complete (the same on every rank)."""
        return bool(self._completions)

    def written(self) -> bool:
        """Whether this rank's files are all written (or failed)."""
        self.start()
        return self._collect(block=False)

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
        self.complete(settle=False)

    def complete(self, settle: bool = True) -> None:
        """Wait for this rank's writes, then run the completions in order (a collective): they
        raise SaveFailed on every rank when some rank's writes failed. `settle`: then wait for
        the directories the writer was handed to remove, too (before the rank goes on to a save
        or exits)."""
        self.start()
        self._collect(block=True)
        completions, self._completions = self._completions, []
        for completion in completions:
            completion()
        if settle and self._removing:
            self._writer.settle()
            self._removing = False

    def remove(self, path: str) -> None:
        """Have the writer remove the directory `path` (a deleted checkpoint, renamed out of the
        way: dragon.checkpoint.save_hook), after what it was handed before; freeing the pages of
        its files takes no training time. complete() waits for it."""
        if self._writer.alive():
            self._writer.outbox.send_bytes(pickle.dumps(("remove", path)))
            self._removing = True
        else:
            shutil.rmtree(path, ignore_errors=True)

    def _collect(self, block: bool) -> bool:
        """The writer's report into each GuardedWrites of the save it writes, if it has reported
        (or, with `block`, once it has); whether no save is left in the writer."""
        if not self._writing:
            return True
        report = self._writer.report(block)
        if report is None:
            return False
        for i, writes in enumerate(self._writing):
            error, checksums = report.get(i, (None, {}))
            writes.error = writes.error or error
            writes.checksums.update(checksums)
        self._writing = []
        return True


class WriterProcess:
    """A rank's writer (dragon.checkpoint.writer), its pipes, and the shared buffer it reads the
    saves from."""

    def __init__(self):
        self.buffer = SharedBuffer()
        inbox, self._to = os.pipe()
        self._from, outbox = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-c", BOOT, ROOT, str(os.getpid()), str(inbox), str(outbox),
             str(self.buffer.fd)],
            pass_fds=(inbox, outbox, self.buffer.fd), stdin=subprocess.DEVNULL)
        os.close(inbox)
        os.close(outbox)  # the writer's end only: its death reads as the end of the pipe
        self.inbox = Connection(self._from, writable=False)
        self.outbox = Connection(self._to, readable=False)
        self.outbox.send_bytes(pickle.dumps(sys.path))  # where this rank finds its modules
        self._groups = 0  # of the save last sent

    def alive(self) -> bool:
        return self.process.poll() is None

    def send(self, groups: int, jobs: list[tuple]) -> None:
        """Copy the storages of `jobs` ((group, write, state, path)) into the buffer and send
        the writer the rest: (buffer size, [(offset, bytes)] of each storage, groups, jobs)."""
        skeleton = io.BytesIO()
        pickler = _SkeletonPickler(skeleton)
        pickler.dump(jobs)
        places, end = [], 0
        for storage in pickler.storages:
            places.append((end, storage.nbytes()))
            end += -storage.nbytes() % ALIGNMENT + storage.nbytes()
        self.buffer.fit(end)
        for (offset, size), storage in zip(places, pickler.storages):
            if size:
                self.buffer.view[offset:offset + size].copy_(_bytes_of(storage))
        self._groups = groups
        message = ("save", self.buffer.size, places, groups, skeleton.getvalue())
        self.outbox.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def settle(self) -> None:
        """Wait until the writer has done all it was handed (the removals after a save's
        report); at once if it has ended."""
        try:
            self.outbox.send_bytes(pickle.dumps(("settle",)))
            self.inbox.recv_bytes()
        except (EOFError, OSError):
            pass

    def report(self, block: bool) -> Optional[dict]:
        """The writer's report of the save it was sent ({group: (error, checksums)}), or None
        while it writes (without `block`); an error for every group if it ended first."""
        if not block and not self.inbox.poll():
            return None
        try:
            return pickle.loads(self.inbox.recv_bytes())
        except (EOFError, OSError):
            status = self.process.wait()
            error = f"the writer process ended before it reported (exit status {status})"
            return {group: (error, {}) for group in range(self._groups)}


class SharedBuffer:
    """Anonymous shared memory (a memfd) that the writer maps too, mapped here as a byte
    tensor; grown when a save outgrows it, never shrunk."""

    def __init__(self):
        self.fd = os.memfd_create("dragon-save-async", os.MFD_CLOEXEC)
        self.size, self.view = 0, torch.empty(0, dtype=torch.uint8)

    def fit(self, size: int) -> None:
        if size <= self.size:
            return
        self.size = size + size // 8  # some room for a state that grows a little
        os.ftruncate(self.fd, self.size)
        self.view = torch.frombuffer(mmap.mmap(self.fd, self.size), dtype=torch.uint8)


class _SkeletonPickler(pickle.Pickler):
    """Pickles a state as torch.save does, but with each tensor storage named by its number
    (each storage once, however many tensors view it): torch.save's pickling on the rebuilt
    state sees the same storages, views and objects."""

    def __init__(self, file):
        super().__init__(file, protocol=2)  # torch.save's
        self.storages: list[torch.UntypedStorage] = []
        self.numbers: dict[int, int] = {}  # a StorageImpl's number: each saved once, as torch.save

    def persistent_id(self, obj: Any) -> Optional[tuple]:
        if isinstance(obj, torch.storage.TypedStorage):
            storage, dtype = obj._untyped_storage, obj.dtype
        elif torch.is_storage(obj):
            storage, dtype = obj, None
        else:
            return None
        if storage._cdata not in self.numbers:
            self.numbers[storage._cdata] = len(self.storages)
            self.storages.append(storage)
        return ("storage", self.numbers[storage._cdata], dtype)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A storage's bytes as a tensor (on the storage's device)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _Method:
    """A method that pickles by its owner and the name the owner's class knows it by (a method
    patched onto a class keeps the name of the function that replaced it)."""

    def __init__(self, owner: Any, name: str):
        self.owner, self.name = owner, name

    def __call__(self, *args, **kwargs):
        return getattr(self.owner, self.name)(*args, **kwargs)


def _portable(write: Callable) -> Callable:
    if not inspect.ismethod(write):
        return write
    owner, function = write.__self__, write.__func__
    names = [write.__name__] + [name for name in dir(type(owner))
                                if getattr(type(owner), name, None) is function]
    name = next(n for n in names if getattr(owner, n, None) == write)
    return _Method(owner, name)
