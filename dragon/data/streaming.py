"""--streaming: documents read as a `datasets` IterableDataset, tokenized and packed into blocks
of block_size+1 ids as they are read, never materialised.

The packed stream is one global sequence of blocks. Its first --validation_blocks blocks are held
out for validation (the same on every run), unless --validation_file gives the validation text.
The rest passes through a shuffling buffer of --shuffle_buffer_blocks (none by default), and each
data-parallel rank (of every DiLoCo island) keeps every W-th block that comes out, as
`split_dataset_by_node(strategy="examples")` would; the buffer is the same on every rank (one
seed), so the blocks of a global batch are the same for any number of ranks. Each rank tokenizes
the whole stream to find its share. A rank that reaches the end of the stream starts it again
(the next epoch; the buffer carries over). The position, saved per rank with each checkpoint, is
the IterableDataset's state_dict with the buffer's blocks and random state: datasets' own
shuffling buffer starts empty on a resume, this one does not.
"""

from __future__ import annotations

import copy
import queue
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import datasets
import numpy as np
import torch
from datasets import Dataset, IterableDataset

from dragon.data.text import (
    PACK_BATCH_SIZE,
    DataArguments,
    builtin_corpus_files,
    DataError,
    check_data_args,
    pack_batch,
    open_texts,
    pack,
)
from dragon.data.sources import resolve_files
from dragon.data.tokenizer import load_tokenizer
from dragon.data.mixture import mixed_blocks
from dragon.data.stream_rows import StreamingRowBatches, head_blocks

STATE_FILE = "data_stream"  # <name>_<rank>.pt in each checkpoint: this rank's stream position
PREFETCH = 8  # micro-batches the reading thread keeps ready


def packed(texts: IterableDataset, tokenizer: Any, block_size: int) -> IterableDataset:
    """Blocks of block_size+1 ids (column "input_ids"), packed as `texts` is read (the
    materialised path's packing: each map batch's tail is dropped)."""
    return texts.map(
        pack_batch,
        batched=True,
        batch_size=PACK_BATCH_SIZE,
        fn_kwargs={"tokenizer": tokenizer, "block_size": block_size},
        remove_columns=["text"],
    )


def _validation(args: DataArguments, blocks: IterableDataset, tokenizer: Any) -> Dataset:
    """The validation blocks: --validation_file's, packed, or the head of the stream."""
    if args.validation_file is not None:
        texts = open_texts(DataArguments(train_file=args.validation_file, cache_dir=args.cache_dir,
                                         text_column_name=args.text_column_name))
        valid = pack(texts, tokenizer, args.block_size)
        if len(valid) == 0:
            raise DataError(f"validation_file {args.validation_file!r} holds no block of "
                            f"block_size+1={args.block_size + 1} tokens; lower --block_size")
        return valid
    head = [row["input_ids"] for row in blocks.select_columns(["input_ids"]).take(
        args.validation_blocks)]
    if len(head) < args.validation_blocks:
        raise DataError(
            f"the stream holds {len(head)} blocks of block_size+1={args.block_size + 1} tokens, "
            f"not more than the {args.validation_blocks} --validation_blocks held out; lower "
            "--validation_blocks or --block_size, add data, or give --validation_file"
        )
    return Dataset.from_dict({"input_ids": head})


def _blocks(args: DataArguments, tokenizer: Any, seed: int
            ) -> tuple[IterableDataset, Optional[IterableDataset]]:
    """(the global block stream, its documents): of --dataset_mixture's sources (no documents),
    or of the one source."""
    if args.dataset_mixture is not None:
        if args.train_file is not None or args.dataset_name is not None:
            given = args.train_file or args.dataset_name
            raise DataError(f"dataset_mixture {args.dataset_mixture!r} and {given!r} are both "
                            "given; put every source in the mixture")
        return mixed_blocks(args, tokenizer, seed), None
    texts = open_texts(args, streaming=True)
    if not any(row["text"] for row in texts):  # stops at the first document with text
        raise DataError(f"{args.train_file or args.dataset_name!r} streams no text")
    return packed(texts, tokenizer, args.block_size), texts


@dataclass
class BlockStream:
    """The training blocks of a stream, for `world` data-parallel ranks (every island's): the
    block stream less its `held_out` head. With at least `world` shards (files) each rank reads
    its own shards, as datasets' split_dataset_by_node does, and the held-out head is data rank
    0's; else every rank reads the whole stream and keeps every world-th block. Iterated, it is
    the training order of one rank alone."""

    blocks: IterableDataset
    held_out: int = 0
    world: int = 1
    shardable: bool = True  # a mixture's interleaved sources are not
    texts: Optional[IterableDataset] = None  # the documents, for --carry_state's row streams
    held_out_documents: int = 0  # with --carry_state: the documents of the held-out head

    @property
    def by_shards(self) -> bool:
        return self.shardable and self.world > 1 and self.blocks.n_shards >= self.world

    def head(self, stream: Optional[IterableDataset] = None) -> IterableDataset:
        """Where the held-out head is read from (of the blocks, or of `stream`: their documents):
        the whole stream, or data rank 0's shards."""
        return self._share(self.blocks if stream is None else stream, 0)

    def for_rank(self, rank: int, world: int) -> tuple[IterableDataset, int]:
        """(what data rank `rank` of `world` reads, every how many blocks it keeps one)."""
        self._check_world(world)
        if not self.by_shards:
            return self.blocks.skip(self.held_out), world
        mine = self._share(self.blocks, rank)
        return (mine.skip(self.held_out) if rank == 0 else mine), 1

    def rows_for_rank(self, rank: int, world: int, tokenizer: Any, block_size: int,
                      micro_batch_size: int, grad_accum: int) -> StreamingRowBatches:
        """--carry_state's micro-batches of data rank `rank`: its documents (its shards, or one
        in `world`) dealt to its rows (dragon.data.stream_rows)."""
        self._check_world(world)
        texts, skip = self._share(self.texts, rank), self.held_out_documents
        if self.by_shards:
            return StreamingRowBatches(texts, tokenizer, block_size, micro_batch_size,
                                       grad_accum, skip if rank == 0 else 0)
        return StreamingRowBatches(texts, tokenizer, block_size, micro_batch_size, grad_accum,
                                   skip, world, rank)

    def _share(self, stream: IterableDataset, rank: int) -> IterableDataset:
        """Data rank `rank`'s shards of `stream` when split by shards, else all of it."""
        return stream.shard(self.world, rank, contiguous=True) if self.by_shards else stream

    def _check_world(self, world: int) -> None:
        if self.world > 1 and world != self.world:
            raise RuntimeError(f"a stream split for {self.world} data ranks read by {world}")

    def describe(self) -> str:
        n = self.blocks.n_shards
        if self.by_shards:
            return f"streaming: {n} shards split among {self.world} data-parallel ranks"
        return (f"streaming: {n} shard(s) for {self.world} data-parallel ranks: every rank reads "
                f"the whole stream and keeps one block in {self.world} (give at least "
                f"{self.world} files, or a dataset of as many shards, to split by shards)")

    def take(self, n: int) -> IterableDataset:
        return self.blocks.skip(self.held_out).take(n)

    def __iter__(self):
        return iter(self.blocks.skip(self.held_out))


def build_streams(args: DataArguments, seed: int = 0, world: int = 1, carry: bool = False
                  ) -> tuple[BlockStream, Dataset, Any]:
    """(the training stream for `world` data ranks, validation blocks: a Dataset, tokenizer);
    `seed` draws a mixture's sources; `carry`: --carry_state's rows read documents, and the
    held-out head is the first blocks of data rank 0's documents (dragon.data.stream_rows)."""
    check_data_args(args)
    if args.validation_blocks < 1 and args.validation_file is None:
        raise DataError(f"validation_blocks {args.validation_blocks} is invalid; use >= 1 or give "
                        "--validation_file")
    tokenizer = load_tokenizer(args.tokenizer_name)
    held_out = 0 if args.validation_file is not None else args.validation_blocks
    blocks, texts = _blocks(args, tokenizer, seed)
    train = BlockStream(blocks, held_out, world, args.dataset_mixture is None, texts)
    if carry and held_out:
        valid, train.held_out_documents = head_blocks(train.head(texts), tokenizer,
                                                      args.block_size, held_out)
        return train, valid, tokenizer
    valid = _validation(args, train.head(), tokenizer)
    return train, valid, tokenizer


class StreamingBatches:
    """Training micro-batches of one data-parallel rank read from the global block stream, with a
    thread reading ahead; `state_dict()` is the position after the last micro-batch returned."""

    def __init__(
        self,
        blocks: BlockStream,
        micro_batch_size: int,
        dp_rank: int,
        dp_world: int,
        grad_accum: int = 1,
        prefetch: int = PREFETCH,
        shuffle_blocks: int = 0,
        seed: int = 0,
    ):
        if not 0 <= dp_rank < dp_world:
            raise DataError(f"dp_rank {dp_rank} is not in [0, dp_world={dp_world})")
        self.blocks, self.stride = blocks.for_rank(dp_rank, dp_world)
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.micro_batch_size, self.grad_accum = micro_batch_size, grad_accum
        self.prefetch, self.shuffle_blocks, self.seed = prefetch, shuffle_blocks, seed
        self.epoch, self.micro_step = 0, 0  # micro-batches returned, over all epochs
        self._state: dict = {"epoch": 0, "micro_step": 0, "stream": None, "taken": {}}
        self._queue: Optional[queue.Queue] = None

    def _read(self, stream: IterableDataset, state: dict) -> Iterator[tuple[torch.Tensor, dict]]:
        """(micro-batch, position after it) of the global `stream` (this reader's own copy) from
        `state` on, epoch after epoch."""
        epoch, micro_step, taken = state["epoch"], state["micro_step"], dict(state["taken"])
        seen = state.get("seen", 0)  # blocks out of the buffer, over all epochs and ranks
        buffer = ShuffleBuffer(self.shuffle_blocks, self.seed, state.get("shuffle"))
        stream.set_epoch(epoch)
        if state["stream"] is not None:
            stream.load_state_dict(state["stream"])
        rows, sources = [], []
        while True:
            for row in stream:
                for ids, source in buffer.swap(row):
                    seen += 1
                    if (seen - 1) % self.stride != self.dp_rank % self.stride:
                        continue
                    rows.append(ids)
                    sources.append(source)
                    if len(rows) < self.micro_batch_size:
                        continue
                    micro_step += 1
                    batch = torch.from_numpy(np.stack(rows)).long()
                    for source in sources:  # a mixture's blocks name their source
                        if source is not None:
                            taken[int(source)] = taken.get(int(source), 0) + batch.shape[1] - 1
                    rows, sources = [], []
                    yield batch, {"epoch": epoch, "micro_step": micro_step,
                                  "stream": stream.state_dict(), "taken": dict(taken),
                                  "seen": seen, "shuffle": buffer.state_dict()}
            epoch += 1  # the stream ended: begin it again (rows and the buffer carry over)
            stream.set_epoch(epoch)

    def _fill(self, out: queue.Queue, blocks: IterableDataset, state: dict) -> None:
        try:
            for item in self._read(blocks, state):
                out.put(item)
        except BaseException as e:  # re-raised by __next__ in the training thread
            out.put(e)

    def __iter__(self) -> "StreamingBatches":
        return self

    def __next__(self) -> torch.Tensor:
        if self._queue is None:
            self._queue = queue.Queue(maxsize=self.prefetch)
            # Iterating keeps its position on the dataset's own iterables: a private copy, made
            # here before the thread starts, keeps this reader apart from any other reader of
            # the same dataset (the validation head, another StreamingBatches).
            args = (self._queue, copy.deepcopy(self.blocks), dict(self._state))
            threading.Thread(target=self._fill, args=args, daemon=True).start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise DataError(f"reading the training stream failed: {item}") from item
        batch, self._state = item
        self.epoch, self.micro_step = self._state["epoch"], self._state["micro_step"]
        return batch

    def state_dict(self) -> dict:
        return dict(self._state)

    def tokens_taken(self, sources: int) -> list[int]:
        """Tokens (predicted ones, block_size per block) this rank took from each of a mixture's
        `sources` so far."""
        return [self._state["taken"].get(i, 0) for i in range(sources)]

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where the stream that saved `state` (on this rank) stopped."""
        if self._queue is not None:
            raise RuntimeError("load_state_dict after reading began")
        self._state = dict(state)
        self.epoch, self.micro_step = state["epoch"], state["micro_step"]

    def resume_elsewhere(self, saved) -> None:
        """A checkpoint without this rank's position (another layout's): read on from the saved
        step's place in the global stream."""
        self.seek(saved.step)

    def seek(self, step: int) -> None:
        """Stand where this rank's stream is after `step` optimizer steps from its start (of any
        launch layout: the global order does not depend on it), by reading up to there."""
        self.load_state_dict({"epoch": 0, "micro_step": 0, "stream": None, "taken": {}})
        for _ in range(step * self.grad_accum):
            next(self)


class ShuffleBuffer:
    """A shuffling buffer of `size` blocks (0: none) whose blocks and random state are part of
    the stream's position, so a resumed stream draws what the uninterrupted one would."""

    def __init__(self, size: int, seed: int, state: Optional[dict] = None):
        self.size, self.rng, self.blocks = size, np.random.default_rng(seed), []
        if state is not None:
            self.blocks = list(state["blocks"])
            self.rng.bit_generator.state = state["rng"]

    def swap(self, row: dict) -> list[tuple[Any, Optional[int]]]:
        """Put `row` in; what comes out for it, as (ids, source): nothing while the buffer fills,
        then one block drawn at random (the one `row` replaces)."""
        if not self.size:
            return [(row["input_ids"], row.get("source"))]
        block = (np.asarray(row["input_ids"], dtype=np.int32), row.get("source"))
        if len(self.blocks) < self.size:
            self.blocks.append(block)
            return []
        i = int(self.rng.integers(self.size))
        out, self.blocks[i] = self.blocks[i], block
        return [out]

    def state_dict(self) -> Optional[dict]:
        if not self.size:
            return None
        return {"blocks": list(self.blocks), "rng": self.rng.bit_generator.state}


def check_stream(blocks: BlockStream, global_batch: int, block_size: int) -> None:
    """Raise unless the training stream fills one global batch."""
    got = sum(1 for _ in blocks.take(global_batch))
    if got < global_batch:
        raise DataError(
            f"the training stream holds {got} blocks of block_size+1={block_size + 1} tokens, "
            f"fewer than one global batch of {global_batch}; lower --block_size or the batch "
            "size, or add data"
        )


def stream_text_bytes(args: DataArguments) -> Optional[int]:
    """About how many bytes a stream reads in one pass: its files' sizes (JSON's keys count, and
    compressed Parquet holds more text than its size), or the size the hub dataset's metadata
    gives; None when not known (a mixture, a dataset without metadata, the hub out of reach).
    Every rank asks, so that every rank's checks agree before any process group exists."""
    if args.dataset_mixture is not None:
        return None
    if args.dataset_name is None:
        files = resolve_files(args.train_file) if args.train_file else builtin_corpus_files()
        return sum(os.path.getsize(f) for f in files)
    try:
        info = datasets.load_dataset_builder(args.dataset_name, args.dataset_config_name).info
    except Exception:  # noqa: BLE001 - offline, gated, a script dataset: the size is unknown
        return None
    split = (info.splits or {}).get("train")
    return (split.num_bytes if split is not None else None) or info.dataset_size or None
