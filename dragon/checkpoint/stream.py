"""Checkpoint files that torch.save writes to a file object, checksummed as they are written.

A save's checksum (the completion marker's CRC-32) is taken of each chunk on its way to the file,
not by reading the file back. A background save's writer process (dragon.checkpoint.writer) also
writes past the page cache: a file written through it costs its writer a fresh page of memory for
every 4 KiB (allocated, then filled) and the kernel's writeback after it, and on a machine whose
cores training keeps busy, that time comes out of the steps. With `direct`, the file is opened
with O_DIRECT and the disk takes the bytes from one aligned buffer that the process reuses; a file
system that refuses O_DIRECT gets the same writes through its page cache. The synchronous save
keeps the page cache: its call returns once the bytes are there, not once the disk has them.

The file's CRC-32 is what dragon checks (dragon.checkpoint.verify), so torch.save does not also
take the CRC-32 of each record inside the file's zip archive (torch's set_crc32_options: torch.load
never checks them; a zip tool that does reports them as wrong).

torch.save names the records of a file object's archive `archive/`, where a path's archive takes
the file's name: both ways of saving write through a file object, so that a background file is
the synchronous save's file byte for byte.
"""

import fcntl
import mmap
import os
from typing import Any, Callable

import torch
from torch.utils.serialization import config
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from dragon.checkpoint.verify import crc32

CHUNK = 8 * 2**20  # bytes a write hands the file: a multiple of every block size
PIECE = 2**20  # bytes checksummed, then copied, while they are in the CPU's cache
BLOCK = 4096  # O_DIRECT's alignment of a write's size (the last, short write clears O_DIRECT)


class ChecksummedFile:
    """A write-only file object that writes in chunks of CHUNK bytes and takes their CRC-32
    (`crc`); `direct`: with O_DIRECT, and fsynced at close(). `name` is the path, as a file's."""

    def __init__(self, path: str, direct: bool = False):
        self.name = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.fd = -1
        if direct:
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError:  # a file system without O_DIRECT: its page cache, then
                pass
        if self.fd < 0:
            self.fd = os.open(path, flags, 0o644)
        self.direct, self.buffer = direct, _aligned_buffer()
        self.used, self.crc = 0, 0
        self.error = None  # what a write raised: torch.save reports it as an error of its own

    def write(self, data: Any) -> int:
        data = memoryview(data).cast("B")
        taken = 0
        while taken < len(data):
            size = min(CHUNK - self.used, len(data) - taken, PIECE)
            piece = data[taken:taken + size]
            self.crc = crc32(piece, self.crc)
            self.buffer[self.used:self.used + size] = piece
            self.used += size
            taken += size
            if self.used == CHUNK:
                self._drain()
        return taken

    def flush(self) -> None:  # torch.save's at its end: close() writes what is left
        pass

    def close(self) -> None:
        """Write what is left (and with `direct`, make the file durable)."""
        try:
            if self.used % BLOCK:  # O_DIRECT takes whole blocks only
                flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
                fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            self._drain()
            if self.direct:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)

    def _drain(self) -> None:
        chunk = self.buffer[:self.used]
        written = 0
        try:
            while written < len(chunk):  # a write may take part of it
                written += os.write(self.fd, chunk[written:])
        except OSError as e:
            self.error = e
            raise
        self.used = 0


def streams(write: Callable) -> bool:
    """Whether `write(state, path)` is torch.save's, which takes a file object for the path:
    torch.save itself, or the save of DeepSpeed's TorchCheckpointEngine (a bound method, or one
    that dragon.checkpoint.background_saves pickles by its `owner` and `name`)."""
    owner = getattr(write, "__self__", getattr(write, "owner", None))
    function = getattr(write, "__func__", None) or getattr(type(owner), getattr(write, "name", ""),
                                                           None)
    return write is torch.save or (isinstance(owner, TorchCheckpointEngine)
                                   and function is TorchCheckpointEngine.save)


def write_checksummed(write: Callable, state: Any, path: str, direct: bool = False) -> int:
    """write(state, a ChecksummedFile of `path`); its CRC-32. A failed write leaves the file
    as far as it got: unmarked, so no resume takes it."""
    file = ChecksummedFile(path, direct)
    try:
        with config.patch({"save.compute_crc32": False}):
            write(state, file)  # the file's CRC-32 stands for its records' (module docstring)
    except BaseException as e:
        os.close(file.fd)
        if file.error is not None and file.error is not e:
            raise file.error from e  # a full disk, as the disk said it
        raise
    file.close()
    return file.crc


_BUFFERS: list[memoryview] = []


def _aligned_buffer() -> memoryview:
    """One page-aligned buffer of CHUNK bytes for the process (mmap's pages are), reused by every
    file it writes (one at a time)."""
    if not _BUFFERS:
        _BUFFERS.append(memoryview(mmap.mmap(-1, CHUNK)))
    return _BUFFERS[0]
