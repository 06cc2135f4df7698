"""A save that every rank learns the fate of together.

A write that fails on one rank (a full disk, a lost mount: OSError, or torch's RuntimeError from its
writer) must not leave the other ranks waiting at a barrier of the save. GuardedWrites stands in
for the engine's DeepSpeed CheckpointEngine during one save (DeepSpeed writes every file of a
checkpoint through that interface): the first failed write is kept, the writes after it on that
rank are skipped, and the rank carries on through DeepSpeed's collectives. agree() then raises
SaveFailed on every rank if any rank failed.
"""

from typing import Optional

import torch.distributed as dist

from dragon.parallel.distributed import all_reduce_values, rank, world_size

WRITE_ERRORS = (OSError, RuntimeError)


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
        """write(*args) unless a write of this save already failed; keep its error."""
        if self.error is not None:
            return
        try:
            write(*args)
        except WRITE_ERRORS as e:
            self.error = e

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


def agree_on_write_errors(error: Optional[BaseException], what: str) -> None:
    """Raise SaveFailed on every rank naming the ranks whose `error` was not None (a collective).
    """
    flags = [float(error is not None and r == rank()) for r in range(world_size())]
    failed = [r for r, f in enumerate(all_reduce_values(flags, dist.ReduceOp.MAX)) if f]
    if failed:
        mine = f" ({error})" if error else ""
        raise SaveFailed(f"saving {what} failed on rank {', '.join(map(str, failed))}{mine}")
