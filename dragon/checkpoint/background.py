"""Saves whose files are written in the background (--save_async).

A save snapshots what it writes and returns; one thread per rank writes the snapshots in order.
What makes a save complete stays on the training thread, where every rank calls the same
collectives in the same order: once every rank's writer is idle (BackgroundSaves.poll, after each
step), the save's completions run (dragon.checkpoint.retention: every rank's writes agreed, then
the completion marker, `latest` and the prune). Until then the checkpoint has no marker, so a
crash or a SIGKILL during a background write leaves the previous checkpoint as the resume point.

DeepSpeed 0.19.8's decoupled checkpoint engine does not serve here: on CPU it refuses to put a
ZeRO optimizer's state on its writer's queue (tensors that require grad), and it waits for the
write at the next optimizer step anyway, since it shares the live tensors rather than copying
them.
"""

import copy
import os
import queue
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from dragon.parallel.distributed import all_reduce_values


def snapshot(state: Any) -> Any:
    """A copy of `state` that training cannot change, which torch.save writes as the same bytes
    it would write for `state`: each tensor storage copied once (views keep sharing it), tensor
    types, flags and attributes kept, containers rebuilt as their own type. copy.deepcopy does
    not serve: it refuses tensors that are not graph leaves (a ZeRO optimizer's partitions)."""
    return _copy(state, {})


def _copy(obj: Any, storages: dict) -> Any:
    if isinstance(obj, torch.Tensor):
        return _copy_tensor(obj, storages)
    if isinstance(obj, dict):
        copied = copy.copy(obj)  # its type and attributes (a state dict's _metadata)
        for key, value in obj.items():
            copied[key] = _copy(value, storages)
        return copied
    if type(obj) is list or type(obj) is tuple:
        return type(obj)(_copy(value, storages) for value in obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_copy(value, storages) for value in obj))
    return copy.deepcopy(obj)  # numbers, strings, torch.Size, numpy arrays, small objects


def _copy_tensor(tensor: torch.Tensor, storages: dict) -> torch.Tensor:
    storage = tensor.untyped_storage()
    if storage._cdata not in storages:  # torch.save tells storages apart the same way
        storages[storage._cdata] = storage.clone()
    copied = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    with torch.no_grad():
        copied.set_(storages[storage._cdata], tensor.storage_offset(), tensor.size(),
                    tensor.stride())
    if isinstance(tensor, torch.nn.Parameter):
        copied = torch.nn.Parameter(copied, requires_grad=tensor.requires_grad)
    elif tensor.requires_grad:
        copied.requires_grad_(True)
    state = torch._utils._get_obj_state(tensor)
    if state:
        torch._utils._set_obj_state(copied, copy.copy(state))
    return copied


class BackgroundSaves:
    """One writer thread, and the completions of the saves it is writing (module docstring)."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._pending = 0  # jobs submitted and not yet done
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._completions: list[Callable[[], None]] = []
        # A daemon: a process that ends mid-write leaves the save unmarked, as a crash would.
        threading.Thread(target=self._work, name="dragon-save-writer", daemon=True).start()

    def submit(self, write: Callable[..., None], *args: Any) -> None:
        """Run write(*args) on the writer thread, after every write submitted before it."""
        with self._lock:
            self._pending += 1
        self._jobs.put((write, args))

    def then(self, completion: Callable[[], None]) -> None:
        """Run `completion` (a collective) on the training thread once every rank's writes are
        done."""
        self._completions.append(completion)

    @property
    def in_flight(self) -> bool:
        """Whether a save has yet to complete (the same on every rank)."""
        return bool(self._completions)

    def written(self) -> bool:
        """Whether this rank's writer has nothing left to write."""
        with self._lock:
            return self._pending == 0

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
        with self._lock:
            self._idle.wait_for(lambda: self._pending == 0)
        completions, self._completions = self._completions, []
        for completion in completions:
            completion()

    def _work(self) -> None:
        while True:
            write, args = self._jobs.get()
            try:
                write(*args)  # GuardedWrites.run keeps a write's error for agree()
            finally:
                with self._lock:
                    self._pending -= 1
                    self._idle.notify_all()


def durable(path: str) -> None:
    """fsync a written file, so that a marker written after it never names bytes still in the
    page cache only."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
