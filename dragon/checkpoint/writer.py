"""The writer process of a rank's background saves (--save_async;
dragon.checkpoint.background_saves).

A rank starts one, with its BackgroundSaves, as a fresh interpreter at the lowest priority:
it yields the CPU to training wherever both want it (the write takes longer, the steps do not). It
reads saves from a pipe, each a skeleton of the save's states whose tensor storages lie in the
rank's shared buffer; rebuilds the states on that buffer; writes, checksums and fsyncs every file
with dragon.checkpoint.writes.GuardedWrites (the first failed write of a group of files skips the
rest of that group); and sends back each group's error and checksums. Between saves it removes
the checkpoints that the retention hook deleted (renamed out of the way), in the order handed. It
ends with its rank (Linux's PR_SET_PDEATHSIG, and the end of its pipe): a killed rank leaves no
process writing into a checkpoint that a resume may save again.
"""

import ctypes
import io
import mmap
import os
import pickle
import shutil
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from dragon.checkpoint.writes import GuardedWrites


def main(parent: int, inbox_fd: int, outbox_fd: int, buffer_fd: int) -> None:
    """The writer's loop: one save in, its report out, until the rank closes its pipe."""
    if not _dies_with(parent):  # the rank died before the writer could follow it
        return
    for preemption in (signal.SIGTERM, signal.SIGINT):  # the rank acts on it, and waits for this
        signal.signal(preemption, signal.SIG_IGN)
    inbox = Connection(inbox_fd, writable=False)
    outbox = Connection(outbox_fd, readable=False)
    try:
        paths = pickle.loads(inbox.recv_bytes())
        sys.path.extend(path for path in paths if path not in sys.path)
        buffer = Buffer(buffer_fd)
        while True:
            kind, *message = pickle.loads(inbox.recv_bytes())
            if kind == "save":
                size, places, groups, skeleton = message
                buffer.map(size)
                report = write(groups, skeleton, [buffer.storage(*place) for place in places])
                outbox.send_bytes(pickle.dumps(report))
            elif kind == "remove":  # a deleted checkpoint, renamed out of the way
                shutil.rmtree(message[0], ignore_errors=True)
            elif kind == "settle":  # all that came before is done
                outbox.send_bytes(b"")
    except (EOFError, OSError):  # the rank is done (or gone)
        pass


def write(groups: int, skeleton: bytes, storages: list[torch.UntypedStorage]
          ) -> dict[int, tuple[Any, dict[str, int]]]:
    """Every file of one save: {group: (its first error or None, {path: CRC-32})}."""
    done = [GuardedWrites() for _ in range(groups)]
    try:
        jobs = _Rebuilder(io.BytesIO(skeleton), storages).load()
    except Exception as e:  # a state this process cannot rebuild: every file of the save fails
        traceback.print_exc()
        for writes in done:
            writes.error = f"the writer process could not rebuild the save ({_line(e)})"
        jobs = []
    for group, write_file, state, path in jobs:
        writes = done[group]
        try:
            writes.write_now(write_file, state, path, fsync=True)
        except Exception as e:  # not a write error: a state torch.save cannot write, a bug
            traceback.print_exc()
            writes.error = writes.error or f"{_line(e)}; writing {path}"
    return {group: (writes.error, writes.checksums) for group, writes in enumerate(done)}


class Buffer:
    """The rank's shared buffer (dragon.checkpoint.background_saves.SharedBuffer), mapped here; each
    storage of a save a storage of its own on it, as torch.save tells storages apart."""

    def __init__(self, fd: int):
        self.fd, self.size, self.memory = fd, 0, None

    def map(self, size: int) -> None:
        if size != self.size:  # grown by the rank
            self.size, self.memory = size, mmap.mmap(self.fd, size)

    def storage(self, offset: int, size: int) -> torch.UntypedStorage:
        if size == 0:
            return torch.UntypedStorage(0)
        view = torch.frombuffer(self.memory, dtype=torch.uint8, count=size, offset=offset)
        return view.untyped_storage()


class _Rebuilder(pickle.Unpickler):
    """The save's (group, write, state, path) jobs, their storages on the buffer."""

    def __init__(self, file, storages: list[torch.UntypedStorage]):
        super().__init__(file)
        self.storages = storages

    def persistent_load(self, pid: tuple) -> Any:
        _, number, dtype = pid
        if dtype is None:
            return self.storages[number]
        return torch.storage.TypedStorage(wrap_storage=self.storages[number], dtype=dtype,
                                          _internal=True)


def _line(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _dies_with(parent: int) -> bool:
    """Have the writer end with the rank that started it (Linux's PR_SET_PDEATHSIG; the rank
    starts it from its main thread, which lives as long as the rank); False when the rank is
    already gone."""
    try:
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        pass
    return os.getppid() == parent
