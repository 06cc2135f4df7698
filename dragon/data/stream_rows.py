"""--carry_state with --streaming: every row of a rank's step reads its own contiguous stretch of
the stream, as ContiguousRowBatches' rows read theirs of a materialised corpus.

A data rank reads its documents (its own shards, or one document in W of the whole stream, as
dragon.data.streaming.BlockStream splits blocks) and deals them in turn to its R rows (micro
batch x accumulation): row j gets documents j, R + j, 2R + j, ... of the rank's. Each row
concatenates its documents' tokens and is cut into consecutive blocks of block_size + 1 tokens,
one a step, so row j of step k + 1 continues where row j of step k ended. When the rank's stream
ends, it starts again and the rows read on. The position (the stream's state, the documents
dealt and every row's tokens not yet in a block) is saved at every step, so a resume continues
exactly. The held-out validation blocks are the first blocks of data rank 0's documents
(head_blocks); rank 0's rows skip those documents.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator, Optional

import numpy as np
import torch
from datasets import Dataset, IterableDataset

from dragon.data.sources import DataError


def head_blocks(texts: IterableDataset, tokenizer: Any, block_size: int, count: int
                ) -> tuple[Dataset, int]:
    """(the first `count` blocks of `texts`' documents concatenated, the documents they use)."""
    width, tokens, used = block_size + 1, [], 0
    for row in texts:
        if len(tokens) >= count * width:
            break
        tokens.extend(tokenizer.encode(row["text"]))
        used += 1
    if len(tokens) < count * width:
        raise DataError(f"the stream holds {len(tokens) // width} blocks of block_size+1={width} "
                        f"tokens, not more than the {count} --validation_blocks held out; lower "
                        "--validation_blocks or --block_size, or add data")
    rows = np.asarray(tokens[: count * width]).reshape(count, width).tolist()
    return Dataset.from_dict({"input_ids": rows}), used


class StreamingRowBatches:
    """Training micro-batches of one data rank whose rows are streams (the module's docstring).
    `texts`: this rank's documents (column "text"); `skip`: documents at their head that are
    held out; `stride`/`offset`: keep document i when i % stride == offset (one in W of a stream
    that is not split by shards)."""

    def __init__(self, texts: IterableDataset, tokenizer: Any, block_size: int,
                 micro_batch_size: int, grad_accum: int = 1, skip: int = 0, stride: int = 1,
                 offset: int = 0):
        self.texts, self.tokenizer, self.width = texts, tokenizer, block_size + 1
        self.micro_batch_size, self.grad_accum = micro_batch_size, grad_accum
        self.rows = micro_batch_size * grad_accum
        self.skip, self.stride, self.offset = skip, stride, offset
        self.steps_per_epoch: Optional[int] = None  # rows read on past the stream's end
        self.epoch, self.micro_step = 0, 0
        self._state = {"epoch": 0, "documents": 0, "kept": 0, "stream": None,
                       "pending": [[] for _ in range(self.rows)], "micro_step": 0}
        self._stream: Optional[IterableDataset] = None
        self._docs: Optional[Iterator[dict]] = None
        self._step_rows: Optional[torch.Tensor] = None

    def __iter__(self) -> "StreamingRowBatches":
        return self

    def __next__(self) -> torch.Tensor:
        slot = self.micro_step % self.grad_accum
        if slot == 0:
            self._step_rows = self._next_step()
        self.micro_step += 1
        self._state["micro_step"] = self.micro_step
        rows = slice(slot * self.micro_batch_size, (slot + 1) * self.micro_batch_size)
        return self._step_rows[rows]

    def _next_step(self) -> torch.Tensor:
        """One block from every row, reading documents until every row has one."""
        if self._docs is None:  # a new reader, or one resumed from a saved state
            self._open()
        pending = self._state["pending"]
        while min(len(p) for p in pending) < self.width:
            text = self._next_document()
            if text is not None:
                pending[self._state["kept"] % self.rows].extend(self.tokenizer.encode(text))
                self._state["kept"] += 1
        block = [p[: self.width] for p in pending]
        self._state["pending"] = [p[self.width:] for p in pending]
        self._state["stream"] = self._stream.state_dict()
        self.epoch = self._state["epoch"]
        return torch.tensor(block, dtype=torch.long)

    def _next_document(self) -> Optional[str]:
        """The next document of this rank, or None for one that is not its or held out."""
        try:
            row = next(self._docs)
        except StopIteration:  # the stream ended: begin it again
            if self._state["kept"] == self._kept_at_open:
                raise DataError("a data rank's share of the stream holds no document of its own "
                                "(its shards, less the held-out head); give more data or fewer "
                                "--validation_blocks") from None
            self._state["epoch"] += 1
            self._state["stream"] = None
            self._open()
            return None
        index = self._state["documents"]
        self._state["documents"] += 1
        if index % self.stride != self.offset or index < self.skip:  # held out in every pass
            return None
        return row["text"]

    def _open(self) -> None:
        self._stream = copy.deepcopy(self.texts)
        self._stream.set_epoch(self._state["epoch"])
        if self._state["stream"] is not None:
            self._stream.load_state_dict(self._state["stream"])
        else:
            self._state["documents"] = 0
        self._docs = iter(self._stream)
        self._kept_at_open = self._state["kept"]

    def state_dict(self) -> dict:
        if self.micro_step % self.grad_accum:
            raise RuntimeError("a row stream is saved between steps only")
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where the rows that saved `state` (on this rank) stopped."""
        if len(state["pending"]) != self.rows:
            raise DataError(f"the checkpoint's rows were {len(state['pending'])} streams, this "
                            f"run has {self.rows}; resume with the saved run's "
                            "--per_device_train_batch_size and --gradient_accumulation_steps")
        self._state = copy.deepcopy(state)
        self.epoch, self.micro_step = state["epoch"], state["micro_step"]
        self._docs = None

    def resume_elsewhere(self, saved) -> None:
        self.seek(saved.step)

    def seek(self, step: int) -> None:
        """Stand where these rows are after `step` optimizer steps, by reading up to there."""
        self.__init__(self.texts, self.tokenizer, self.width - 1, self.micro_batch_size,
                      self.grad_accum, self.skip, self.stride, self.offset)
        for _ in range(step * self.grad_accum):
            next(self)
