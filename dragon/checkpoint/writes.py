"""A save that every rank learns the fate of together.

A write that fails on one rank (a full disk, a lost mount: OSError, or torch's RuntimeError from its
writer) must not leave the other ranks waiting at a barrier of the save. GuardedWrites holds one
save's writes: the first failed write is kept, the writes after it on that rank are skipped, and
the rank carries on through DeepSpeed's collectives. agree() then raises SaveFailed on every rank
if any rank failed, or returns the CRC-32 of every file written (dragon.checkpoint.verify). With
--save_async (a GuardedWrites given a BackgroundSaves) save() leaves the file to the writer
process, and the writer's report fills in the error and checksums before agree().

DeepSpeed writes every file of a checkpoint through the engine's CheckpointEngine, so
GuardedCheckpointEngine stands in for it once, from the retention hook's attach on
(dragon.parallel.deepspeed_fixes.guard_checkpoint_writes): during a save it hands each file to
that save's GuardedWrites; outside one (a load) it is DeepSpeed's own.
"""

import errno
import os
import shutil
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from safetensors import SafetensorError

from dragon.checkpoint import stream
from dragon.checkpoint.background_saves import BackgroundSaves
from dragon.checkpoint.verify import crc32_of

# torch's writer and safetensors report a full disk as errors of their own, not OSError
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)
NEARLY_FULL = 2**20  # bytes free under which such an error is taken for a full disk


class SaveFailed(RuntimeError):
    """A save that some rank could not write; `latest` still names the previous checkpoint."""


class GuardedWrites:
    """The writes of one save (a checkpoint's, through the retention hook), or those a caller
    makes through run() (an export, a metrics line); `background`: save() hands files to it."""

    def __init__(self, background: Optional[BackgroundSaves] = None):
        self.error: Optional[str] = None
        self.background = background  # --save_async
        self.checksums: dict[str, int] = {}  # absolute path -> CRC-32 of what this rank wrote

    def save(self, state_dict, path: str, write: Callable[[Any, str], None]) -> None:
        """Write `state_dict` to `path` with write (torch.save, a CheckpointEngine's save) and
        checksum it; with --save_async, in the writer process."""
        if self.background is None:
            self.write_now(write, state_dict, path)
        elif self.error is None:
            self.background.submit(self, write, state_dict, path)

    def write_now(self, write: Callable[[Any, str], None], state_dict, path: str,
                  fsync: bool = False) -> None:
        """write(state_dict, path), then its checksum; `fsync`: then make it durable (a
        background save is marked only once its files are); a torch.save is checksummed as it
        writes, and with `fsync` straight to the disk (dragon.checkpoint.stream)."""
        if stream.streams(write):
            self.run(self._write_checksummed, state_dict, path, write, fsync)
            return
        self.run(write, state_dict, path)
        self.run(self._checksum, path)  # read back while the bytes are in the page cache
        if fsync:
            self.run(durable, path)

    def _write_checksummed(self, state_dict, path: str, write: Callable[[Any, str], None],
                           direct: bool) -> None:
        self.checksums[os.path.abspath(path)] = stream.write_checksummed(write, state_dict, path,
                                                                         direct)

    def _checksum(self, path: str) -> None:
        self.checksums[os.path.abspath(path)] = crc32_of(path)

    def run(self, write, *args, path: Optional[str] = None) -> None:
        """write(*args) unless a write of this save already failed; keep what failed and why (the
        path is `path` or the first str argument, the state the first other one)."""
        if self.error is not None:
            return
        try:
            write(*args)
        except WRITE_ERRORS as e:
            path = path or next((a for a in args if isinstance(a, str)), None)
            state = next((a for a in args if not isinstance(a, str)), None)
            self.error = write_error(e, path, state)

    def agree(self, what: str) -> dict[str, int]:
        """Raise SaveFailed on every rank if any rank's writes failed, naming the ranks and the
        first one's cause; else every rank's checksums, by absolute path (a collective)."""
        reports = [(self.error, self.checksums)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            reports = [None] * dist.get_world_size()
            dist.all_gather_object(reports, (self.error, self.checksums))
        failed = [r for r, (error, _) in enumerate(reports) if error is not None]
        if failed:
            raise SaveFailed(f"saving {what} failed on rank {', '.join(map(str, failed))} "
                             f"({reports[failed[0]][0]})")
        return {path: crc for _, checksums in reports for path, crc in checksums.items()}


class GuardedCheckpointEngine(CheckpointEngine):
    """The engine's CheckpointEngine, set once (module docstring): during recording(writes) its
    saves go through `writes`; every other call, and every call outside a save, is DeepSpeed's
    own engine's (`inner`)."""

    def __init__(self, inner: CheckpointEngine):
        super().__init__()
        self.inner = inner
        self.writes: Optional[GuardedWrites] = None  # the save in progress

    @contextmanager
    def recording(self, writes: GuardedWrites) -> Iterator[GuardedWrites]:
        """DeepSpeed's writes of one save, inside, into `writes`."""
        self.writes = writes
        try:
            yield writes
        finally:
            self.writes = None

    def save(self, state_dict, path: str) -> None:
        if self.writes is None:
            return self.inner.save(state_dict, path)
        self.writes.save(state_dict, path, self.inner.save)

    # the rest of DeepSpeed's CheckpointEngine interface, delegated as it is

    def create(self, info) -> Any:
        return self.inner.create(info)

    def makedirs(self, path, exist_ok=False) -> None:
        return self.inner.makedirs(path, exist_ok=exist_ok)

    def load(self, path: str, map_location=None) -> Any:
        return self.inner.load(path, map_location=map_location)

    def commit(self, info) -> Any:
        return self.inner.commit(info)

    def is_data_parallel_writer(self, dp_rank) -> bool:
        return self.inner.is_data_parallel_writer(dp_rank)

    def is_decoupled(self) -> bool:
        return self.inner.is_decoupled()

    def set_commit_info(self, info) -> None:
        return self.inner.set_commit_info(info)

    def get_commit_info(self) -> Any:
        return self.inner.get_commit_info()

    def cleanup(self) -> None:
        return self.inner.cleanup()

    def preserves_storage_sharing(self) -> bool:
        return self.inner.preserves_storage_sharing()

    def __getattr__(self, name: str) -> Any:  # an attribute of a subclass of DeepSpeed's
        if "inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["inner"], name)


def durable(path: str) -> None:
    """fsync a written file, so that a marker written after it never names bytes still in the
    page cache only."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_error(error: BaseException, path: Optional[str], state: Any = None) -> str:
    """One line on a failed write: the cause (a full disk said so, also when torch's writer or
    safetensors reports it in its own words), the path, and the bytes free there and needed."""
    free = _free_bytes(path)
    cause = str(error).splitlines()[0] if str(error) else type(error).__name__
    full = getattr(error, "errno", None) == errno.ENOSPC
    if not isinstance(error, OSError) and free is not None and free < NEARLY_FULL:
        cause, full = f"{os.strerror(errno.ENOSPC)} ({type(error).__name__}: {cause})", True
    where = f"writing {path}" if path else "writing"
    if full and free is not None:
        need = _bytes_of(state)
        where += f": {free} bytes free" + (f", the file needs ~{need}" if need else "")
    return f"{cause}; {where}"


def _free_bytes(path: Optional[str]) -> Optional[int]:
    """Free bytes on the file system of `path` (its nearest existing parent)."""
    while path:
        if os.path.exists(path):
            return shutil.disk_usage(path).free
        parent = os.path.dirname(path)
        path = None if parent == path else parent
    return None


def _bytes_of(state: Any) -> int:
    """The tensor bytes in a (nested) state dict: about what torch.save writes for it."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, torch.nn.Module):
        return _bytes_of(state.state_dict())
    if isinstance(state, dict):
        return sum(_bytes_of(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_bytes_of(v) for v in state)
    return 0
