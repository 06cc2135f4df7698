"""A save that every rank learns the fate of together.

A write that fails on one rank (a full disk, a lost mount: OSError, or torch's RuntimeError from its
writer) must not leave the other ranks waiting at a barrier of the save. GuardedWrites stands in
for the engine's DeepSpeed CheckpointEngine during one save (DeepSpeed writes every file of a
checkpoint through that interface): the first failed write is kept, the writes after it on that
rank are skipped, and the rank carries on through DeepSpeed's collectives. agree() then raises
SaveFailed on every rank if any rank failed.
"""

import errno
import os
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist


WRITE_ERRORS = (OSError, RuntimeError)
NEARLY_FULL = 2**20  # bytes: torch's writer reports a full disk as a bare RuntimeError


class SaveFailed(RuntimeError):
    """A save that some rank could not write; `latest` still names the previous checkpoint."""


class GuardedWrites:
    """`with GuardedWrites(engine) as writes:` engine.checkpoint_engine is this, for one save."""

    def __init__(self, engine):
        self.engine, self.error = engine, None
        self.inner = getattr(engine, "checkpoint_engine", None)

    def save(self, state_dict, path: str) -> None:
        self.run(self.inner.save, state_dict, path)

    def run(self, write, *args) -> None:
        """write(*args) unless a write of this save already failed; keep what failed and why (the
        path is the first str argument, the state the first other one)."""
        if self.error is not None:
            return
        try:
            write(*args)
        except WRITE_ERRORS as e:
            path = next((a for a in args if isinstance(a, str)), None)
            state = next((a for a in args if not isinstance(a, str)), None)
            self.error = write_error(e, path, state)

    def __getattr__(self, name: str):  # everything but save: the engine's own
        return getattr(self.inner, name)

    def __enter__(self) -> "GuardedWrites":
        if self.inner is not None:
            self.engine.checkpoint_engine = self
        return self

    def __exit__(self, *exc) -> None:
        if self.inner is not None:
            self.engine.checkpoint_engine = self.inner

    def agree(self, what: str) -> None:
        """Raise SaveFailed on every rank if any rank's writes failed (a collective)."""
        agree_on_write_errors(self.error, what)


def write_error(error: BaseException, path: Optional[str], state: Any = None) -> str:
    """One line on a failed write: the cause (a full disk said so, also when torch's writer
    reports it as a bare RuntimeError), the path, and the bytes free there and needed."""
    free = _free_bytes(path)
    cause = str(error).splitlines()[0] if str(error) else type(error).__name__
    full = getattr(error, "errno", None) == errno.ENOSPC
    if not isinstance(error, OSError) and free is not None and free < NEARLY_FULL:
        cause, full = f"{os.strerror(errno.ENOSPC)} (torch: {cause})", True
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
    if isinstance(state, dict):
        return sum(_bytes_of(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_bytes_of(v) for v in state)
    return 0


def agree_on_write_errors(error: Optional[str], what: str) -> None:
    """Raise SaveFailed on every rank naming the ranks whose `error` was not None and the first
    one's cause (a collective)."""
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    failed = [r for r, e in enumerate(errors) if e is not None]
    if failed:
        raise SaveFailed(f"saving {what} failed on rank {', '.join(map(str, failed))} "
                         f"({errors[failed[0]]})")
