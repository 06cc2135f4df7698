"""Data tokenized ahead: recipes/prepare_data.py packs a run's data into a directory once, on any
machine, and a run given --prepared_data opens it in seconds instead of tokenizing.

The directory holds `datasets` Arrow files, one per shard of --shard_documents documents, each
written by `Dataset.map` (the same packing as a run's own, shard boundaries on its batches, so
the blocks are the same), the tokenizer, and `dragon_prepared.json`, written last, which records
what it was made from. A preparation that was stopped is finished by running it again: the shards
already written are kept.
"""

from __future__ import annotations

import json
import math
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
import os
from typing import Any, Iterator, Optional

import datasets
from datasets import Dataset

from dragon.data.sources import DataError
from dragon.data.text import (PACK_BATCH_SIZE, DataArguments, check_blocks, check_data_args,
                              load_text, pack, split_blocks)
from dragon.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

MARKER = "dragon_prepared.json"  # written last: the directory is whole
STARTED = "dragon_preparing.json"  # what a preparation under way was asked for
FORMAT = 1
SOURCE = ("dataset_name", "dataset_config_name", "train_file", "text_column_name")
_WORK: dict[str, Any] = {}  # what the worker processes inherit (fork)


def recipe(args: DataArguments, shard_documents: int) -> dict:
    """What a directory is prepared from: the source, the tokenizer as named, the block size, the
    documents per shard (a rerun with another count would mix shards)."""
    return {"format": FORMAT, "source": {k: getattr(args, k) for k in SOURCE},
            "tokenizer": args.tokenizer_name, "block_size": args.block_size,
            "shard_documents": shard_documents}


def prepare(args: DataArguments, shard_documents: int, progress: bool = True) -> dict:
    """Tokenize and pack the data `args` names into args.prepared_data with
    args.preprocessing_num_workers processes; returns what dragon_prepared.json records."""
    check_data_args(args)
    if shard_documents < 1 or shard_documents % PACK_BATCH_SIZE:
        raise DataError(f"--shard_documents {shard_documents}: use a positive multiple of "
                        f"{PACK_BATCH_SIZE} (the documents packed together)")
    if args.streaming or args.dataset_mixture is not None:
        raise DataError("--prepared_data is a materialised dataset; prepare it without "
                        "--streaming (--streaming false after a config that streams) and "
                        "--dataset_mixture")
    out, wanted = args.prepared_data, recipe(args, shard_documents)
    done = _read(os.path.join(out, MARKER))
    if done is not None:
        _refuse_other(out, done, wanted)
        return done
    _refuse_other(out, _read(os.path.join(out, STARTED)), wanted)
    tokenizer = load_tokenizer(args.tokenizer_name)  # first: a bad name fails before the data
    texts = load_text(args)
    shards = os.path.join(out, "shards")
    os.makedirs(shards, exist_ok=True)
    _write(os.path.join(out, STARTED), wanted)
    count = math.ceil(len(texts) / shard_documents)
    names = [f"shard-{i:05d}-of-{count:05d}.arrow" for i in range(count)]
    for name in set(os.listdir(shards)) - set(names):  # a stopped map's temporary file
        os.remove(os.path.join(shards, name))
    todo = [i for i, name in enumerate(names) if not os.path.exists(os.path.join(shards, name))]
    print(f"prepare: {count - len(todo)} of {count} shards already written in {shards}")
    _WORK.update(texts=texts, tokenizer=tokenizer, block=args.block_size, size=shard_documents,
                 paths=[os.path.join(shards, name) for name in names])
    for _ in _progress(_pack_all(todo, args.preprocessing_num_workers or 1), len(todo),
                       progress):
        pass
    blocks = _concatenated(out, names)
    check_blocks(blocks, texts, tokenizer, args.block_size)
    if isinstance(tokenizer, HFTokenizer):  # the run loads it from here, not from the hub
        tokenizer.save_pretrained(os.path.join(out, "tokenizer"))
    done = dict(wanted, vocab_size=tokenizer.vocab_size, documents=len(texts), shards=names,
                blocks=len(blocks), tokens=len(blocks) * (args.block_size + 1))
    _write(os.path.join(out, MARKER), done)
    os.remove(os.path.join(out, STARTED))
    return done


def open_prepared(args: DataArguments) -> tuple[Dataset, Dataset, Any]:
    """(train blocks, validation blocks, tokenizer) of args.prepared_data, split as a run splits
    its own; a DataError in one line when it is not whole or was prepared with another
    tokenizer, block size or source."""
    check_data_args(args)
    out = args.prepared_data
    done = _read(os.path.join(out, MARKER))
    if done is None:
        raise DataError(f"prepared_data {out!r} holds no finished preparation (no {MARKER}); "
                        "run recipes/prepare_data.py with the same data arguments first")
    if done.get("format") != FORMAT:
        raise DataError(f"prepared_data {out!r} has format {done.get('format')}, not {FORMAT}; "
                        "prepare it again with this version")
    if args.block_size != done["block_size"]:
        raise DataError(f"--block_size {args.block_size}: {out} was prepared with block_size "
                        f"{done['block_size']}; give that, or prepare the data again")
    if args.tokenizer_name != done["tokenizer"]:
        raise DataError(f"--tokenizer_name {args.tokenizer_name}: {out} was prepared with "
                        f"tokenizer {done['tokenizer'] or 'bytes (none)'}; give that, or "
                        "prepare the data again")
    for key, value in done["source"].items():
        given = getattr(args, key)
        named = args.dataset_name is not None or args.train_file is not None
        if named and given != value and key != "text_column_name":
            raise DataError(f"--{key} {given}: {out} was prepared from {key} {value}; give "
                            "the same source, or prepare the data again")
    if done["tokenizer"] is None:
        tokenizer: Any = ByteTokenizer()
    else:
        tokenizer = load_tokenizer(os.path.join(out, "tokenizer"))
        tokenizer.name = done["tokenizer"]
    return (*split_blocks(_concatenated(out, done["shards"]), args.validation_split_percentage),
            tokenizer)


def _pack_shard(i: int) -> int:
    """Pack shard i into its Arrow file (a worker's task); its blocks."""
    texts, size = _WORK["texts"], _WORK["size"]
    shard = texts.select(range(i * size, min(len(texts), (i + 1) * size)))
    return len(pack(shard, _WORK["tokenizer"], _WORK["block"], cache_file_name=_WORK["paths"][i]))


def _pack_all(todo: list[int], workers: int) -> Iterator[int]:
    """Each shard's blocks as it is written: here, or in `workers` forked processes."""
    datasets.disable_progress_bars()  # one bar, over the shards
    if workers == 1 or len(todo) < 2:
        yield from map(_pack_shard, todo)
        return
    context = multiprocessing.get_context("fork")  # the workers inherit the opened texts
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        try:
            for done in as_completed([pool.submit(_pack_shard, i) for i in todo]):
                yield done.result()
        except BrokenProcessPool:
            raise DataError("a preparing worker process died (killed, or out of memory); run "
                            "again to finish: the shards written stay") from None


def _progress(items: Iterator[int], total: int, show: bool) -> Iterator[int]:
    from tqdm import tqdm

    with tqdm(total=total, desc="prepare: shards", disable=not show) as bar:
        for blocks in items:
            bar.update(1)
            bar.set_postfix(blocks=blocks)
            yield blocks


def _concatenated(out: str, names: list[str]) -> Dataset:
    paths = [os.path.join(out, "shards", name) for name in names]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise DataError(f"prepared_data {out!r} lacks {len(missing)} of its shards "
                        f"({missing[0]}, ...); prepare it again")
    parts = [Dataset.from_file(p) for p in paths]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _refuse_other(out: str, found: Optional[dict], wanted: dict) -> None:
    """A directory prepared (or being prepared) from other arguments is refused, not mixed."""
    if found is None:
        return
    differ = [k for k in wanted if found.get(k) != wanted[k]]
    if differ:
        raise DataError(f"prepared_data {out!r} holds data prepared with other {', '.join(differ)}"
                        f" ({', '.join(f'{k} {found.get(k)}' for k in differ)}); give another "
                        "directory")


def _read(path: str) -> Optional[dict]:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _write(path: str, values: dict) -> None:
    """Write whole or not at all (a rename)."""
    with open(path + ".tmp", "w") as f:
        json.dump(values, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)

