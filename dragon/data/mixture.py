"""--dataset_mixture "SOURCE=WEIGHT,...": streamed sources drawn block by block with the given
weights (`interleave_datasets(probabilities=..., seed=...)`), each block tagged with its source
so the metrics count the tokens taken from each.

A SOURCE is a local file, glob or directory (as --train_file takes them, one per entry) or a hub
dataset, `name` or `name:config`. Each source is packed on its own, so a block never mixes two
sources and the weights are shares of blocks, that is of tokens. Every source is read to its end
at least once per pass (stopping_strategy="all_exhausted"): a small source with a large weight is
repeated within the pass.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
from typing import Any

import numpy as np
from datasets import IterableDataset, interleave_datasets

from dragon.data.text import PACK_BATCH_SIZE, DataArguments, DataError, pack_batch, open_texts
from dragon.data.sources import EXTENSION_BUILDERS

_EXAMPLE = '"code/*.jsonl=0.7,prose.txt=0.3"'


def parse_mixture(spec: str) -> list[tuple[str, float]]:
    """[(source, weight)] of a --dataset_mixture, zero weights dropped."""
    pairs = []
    for entry in (e.strip() for e in spec.split(",")):
        source, sep, weight = entry.rpartition("=")
        if not sep or not source.strip():
            raise DataError(f"dataset_mixture entry {entry!r} is not SOURCE=WEIGHT; give e.g. "
                            f"{_EXAMPLE}")
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:
            raise DataError(f"dataset_mixture weight {weight!r} of {source.strip()!r} is not a "
                            "number >= 0")
        pairs.append((source.strip(), value))
    if sum(w for _, w in pairs) <= 0:
        raise DataError(f"dataset_mixture {spec!r}: the weights sum to 0; give at least one "
                        "positive weight")
    return [(s, w) for s, w in pairs if w > 0]


def _is_local(source: str) -> bool:
    ext = os.path.splitext(source)[1].lower()
    return glob.has_magic(source) or os.path.exists(source) or ext in EXTENSION_BUILDERS


def source_args(args: DataArguments, source: str) -> DataArguments:
    """The DataArguments that stream `source` alone."""
    if _is_local(source):
        return dataclasses.replace(args, train_file=source, dataset_name=None,
                                   dataset_mixture=None)
    name, _, config = source.partition(":")
    return dataclasses.replace(args, train_file=None, dataset_name=name,
                               dataset_config_name=config or None, dataset_mixture=None)


def _pack_tagged(batch: dict, tokenizer: Any, block_size: int, source: int) -> dict:
    out = pack_batch(batch, tokenizer, block_size)
    out["source"] = np.full(len(out["input_ids"]), source, dtype=np.int64)
    return out


def mixed_blocks(args: DataArguments, tokenizer: Any, seed: int) -> IterableDataset:
    """The blocks of every source of args.dataset_mixture, drawn with its weights, each with
    column "source" (the source's index)."""
    pairs = parse_mixture(args.dataset_mixture)
    streams = []
    for index, (source, _) in enumerate(pairs):
        texts = open_texts(source_args(args, source), streaming=True)
        if not any(row["text"] for row in texts):  # stops at the first document with text
            raise DataError(f"dataset_mixture source {source!r} streams no text")
        streams.append(texts.map(
            _pack_tagged, batched=True, batch_size=PACK_BATCH_SIZE, remove_columns=["text"],
            fn_kwargs={"tokenizer": tokenizer, "block_size": args.block_size, "source": index},
        ))
    total = sum(w for _, w in pairs)
    return interleave_datasets(streams, probabilities=[w / total for _, w in pairs], seed=seed,
                               stopping_strategy="all_exhausted")


def source_names(args: DataArguments) -> list[str]:
    """The sources of args.dataset_mixture by index (those with a positive weight)."""
    return [s for s, _ in parse_mixture(args.dataset_mixture)] if args.dataset_mixture else []
