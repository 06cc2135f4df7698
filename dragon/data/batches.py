"""Deterministic, resumable batches of packed samples for each data-parallel rank.

Every rank reads its own part of the same global batches, so changing the number of ranks at a
fixed global batch keeps the data identical; the position is saved with each checkpoint.
"""

from typing import Optional

import torch
from datasets import Dataset

from dragon.data.text import DataError


def shard_indices(n: int, rank: int, world: int) -> range:
    """One rank's strided share (rank::world) of n items: disjoint, complete, sizes within 1."""
    if world < 1 or not 0 <= rank < world:
        raise DataError(f"rank {rank} is not in [0, world={world})")
    return range(rank, n, world)


def _torch_rows(dataset: Dataset) -> Dataset:
    return dataset.with_format("torch", columns=["input_ids"])


class TrainBatches:
    """Deterministic, resumable stream of training micro-batches for one data-parallel rank."""

    def __init__(
        self,
        dataset: Dataset,
        micro_batch_size: int,
        dp_rank: int,
        dp_world: int,
        grad_accum: int = 1,
        seed: int = 0,
    ):
        for name, value in (
            ("micro_batch_size", micro_batch_size),
            ("dp_world", dp_world),
            ("grad_accum", grad_accum),
        ):
            if value < 1:
                raise DataError(f"{name} {value} is invalid; it must be >= 1")
        if not 0 <= dp_rank < dp_world:
            raise DataError(f"dp_rank {dp_rank} is not in [0, dp_world={dp_world})")
        n = len(dataset)
        if n // micro_batch_size < dp_world:
            raise DataError(
                f"{n} samples make only {n // micro_batch_size} micro-batches of "
                f"{micro_batch_size}, fewer than the {dp_world} data-parallel ranks; "
                "lower --block_size or the micro batch size, or add data"
            )
        self.global_batch = micro_batch_size * dp_world * grad_accum
        if n < self.global_batch:
            raise DataError(
                f"{n} samples are fewer than one global batch of {self.global_batch} "
                f"(micro batch {micro_batch_size} x {dp_world} ranks x {grad_accum} "
                "gradient accumulation steps); lower one of them or add data"
            )
        self.data = _torch_rows(dataset)
        self.micro_batch_size, self.dp_rank, self.dp_world = micro_batch_size, dp_rank, dp_world
        self.grad_accum, self.seed = grad_accum, seed
        self.steps_per_epoch = n // self.global_batch
        self.micro_steps_per_epoch = self.steps_per_epoch * grad_accum  # per rank
        self.epoch, self.micro_step = 0, 0
        self._perm: Optional[torch.Tensor] = None
        self._perm_key: Optional[tuple[int, int]] = None

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of all sample indices in an epoch (the same on every rank)."""
        if self._perm_key != (self.seed, epoch):
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(len(self.data), generator=g)
            self._perm_key = (self.seed, epoch)
        return self._perm

    def __iter__(self) -> "TrainBatches":
        return self

    def __next__(self) -> torch.Tensor:
        if self.micro_step >= self.micro_steps_per_epoch:
            self.epoch, self.micro_step = self.epoch + 1, 0
        step, accum = divmod(self.micro_step, self.grad_accum)
        # Chunk a*W + r: for any W, micro-step a covers the same samples of the global batch
        # (in rank order), so changing dp_world at fixed global batch keeps the data identical.
        chunk = accum * self.dp_world + self.dp_rank
        rows = range(chunk * self.micro_batch_size, (chunk + 1) * self.micro_batch_size)
        indices = self.sample_indices(self.epoch, step, rows)
        self.micro_step += 1
        return self.data[indices.tolist()]["input_ids"].long()

    def sample_indices(self, epoch: int, step: int, rows: range) -> torch.Tensor:
        """The samples rows `rows` of the global batch read at `step` of `epoch`: a shuffled
        epoch, cut into global batches."""
        return self.permutation(epoch)[step * self.global_batch + rows.start :][: len(rows)]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "micro_step": self.micro_step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue exactly where the stream that saved `state` stopped (its seed included)."""
        epoch, micro_step = int(state["epoch"]), int(state["micro_step"])
        if epoch < 0 or not 0 <= micro_step <= self.micro_steps_per_epoch:
            raise DataError(
                f"data state epoch={epoch} micro_step={micro_step} does not fit "
                f"{self.micro_steps_per_epoch} micro-batches per epoch; was the "
                "dataset, batch size or world size changed?"
            )
        self.epoch, self.micro_step, self.seed = epoch, micro_step, int(state["seed"])

    def resume_elsewhere(self, saved) -> None:
        """A checkpoint of another layout: stand where this rank reads after the saved step."""
        self.seek(saved.step)

    def seek(self, step: int) -> None:
        """Stand where this stream is after `step` optimizer steps from its start."""
        self.epoch, self.micro_step = divmod(step * self.grad_accum, self.micro_steps_per_epoch)


class ContiguousRowBatches(TrainBatches):
    """Training micro-batches whose rows are streams: row g of the global batch reads block
    (stream start + step) of its own contiguous stretch of the corpus, so row g of step k+1
    continues exactly where row g of step k ended (Transformer-XL's order), and a state carried
    from step to step sees the text before the block.

    The corpus is cut into global_batch streams of steps_per_epoch consecutive blocks; each epoch
    deals them to the rows in a seeded order. Consecutive packed blocks are consecutive text, up
    to the tail of each map batch of documents that packing drops.
    """

    def sample_indices(self, epoch: int, step: int, rows: range) -> torch.Tensor:
        streams = self.permutation_of_streams(epoch)[rows.start : rows.stop]
        return streams * self.steps_per_epoch + step

    def permutation_of_streams(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.global_batch, generator=g)


def _validation_count(
    dataset: Dataset, micro_batch_size: int, dp_world: int, max_samples: Optional[int]
) -> int:
    """The validation samples used; raises unless they fill a micro-batch on every rank."""
    if micro_batch_size < 1:
        raise DataError(f"micro_batch_size {micro_batch_size} is invalid; it must be >= 1")
    n = len(dataset) if max_samples is None else min(len(dataset), max_samples)
    if n < micro_batch_size * dp_world:
        raise DataError(
            f"the validation set has {n} samples, fewer than one evaluation micro-batch per rank "
            f"(--per_device_eval_batch_size {micro_batch_size} x {dp_world} ranks); lower "
            "--per_device_eval_batch_size or --block_size, or raise --validation_split_percentage"
        )
    return n


def eval_streams(
    dataset: Dataset,
    micro_batch_size: int,
    dp_rank: int,
    dp_world: int,
    max_samples: Optional[int] = None,
) -> list[torch.Tensor]:
    """This rank's validation blocks read as streams: the first max_samples blocks cut into
    micro_batch_size x dp_world contiguous streams; batch i holds block i of this rank's
    streams. The same number of batches on every rank."""
    n = _validation_count(dataset, micro_batch_size, dp_world, max_samples)
    length = n // (micro_batch_size * dp_world)
    data = _torch_rows(dataset)
    first = dp_rank * micro_batch_size
    starts = [(first + j) * length for j in range(micro_batch_size)]
    return [data[[s + i for s in starts]]["input_ids"].long() for i in range(length)]


def eval_batches(
    dataset: Dataset,
    micro_batch_size: int,
    dp_rank: int,
    dp_world: int,
    max_samples: Optional[int] = None,
) -> list[torch.Tensor]:
    """This rank's fixed validation micro-batches; every rank gets the same number of them."""
    n = _validation_count(dataset, micro_batch_size, dp_world, max_samples)
    num_batches = n // micro_batch_size
    mine = shard_indices(num_batches, dp_rank, dp_world)
    # Equal counts matter: under ZeRO-3 each forward is collective, so a rank with an extra
    # batch would wait forever for the others.
    per_rank = num_batches // dp_world
    data = _torch_rows(dataset)
    return [
        data[b * micro_batch_size : (b + 1) * micro_batch_size]["input_ids"].long()
        for b in mine[:per_rank]
    ]
