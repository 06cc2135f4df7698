"""Data pipeline for BDH training: text in, packed token blocks out, deterministic batches.

Text comes from local files (dragon.data.sources), a hub dataset, or (by default) the running
interpreter's standard library. Documents are tokenized (raw UTF-8 bytes unless --tokenizer_name
names a tokenizer: dragon.data.tokenizer), concatenated, and cut into samples of block_size+1
ids, so input = ids[:-1] and target = ids[1:]. The last blocks are held out for validation,
contiguously, as the reference's 90/10 split of one byte stream does. dragon.data.streaming reads
the same sources as a stream instead (--streaming).
"""

from __future__ import annotations

import math
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import datasets
import numpy as np
from datasets import Dataset

from dragon.data.sources import DataError, builder_groups, one_line, resolve_files
from dragon.data.tokenizer import load_tokenizer

PACK_BATCH_SIZE = 1000  # documents per map batch; only each batch's tail is dropped
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
__all__ = ["DataError"]  # raised by every dragon data module; defined in dragon.data.sources


@dataclass
class DataArguments:
    dataset_name: Optional[str] = field(
        default=None, metadata={"help": "Hub dataset to load (load_dataset(name, config))."}
    )
    dataset_config_name: Optional[str] = field(
        default=None, metadata={"help": "Configuration name of --dataset_name."}
    )
    train_file: Optional[str] = field(
        default=None,
        metadata={
            "help": "Local .txt, .json, .jsonl or .parquet files: comma-separated files, globs "
            "(quoted) and directories."
        },
    )
    text_column_name: str = field(
        default="text", metadata={"help": "Column holding the text (json/parquet/hub data)."}
    )
    tokenizer_name: Optional[str] = field(
        default=None, metadata={"help": "A tokenizer as AutoTokenizer.from_pretrained takes it (a "
                                  "hub id or a local directory); default: UTF-8 bytes."}
    )
    block_size: int = field(
        default=512, metadata={"help": "Tokens predicted per sample (samples hold block_size+1)."}
    )
    validation_split_percentage: float = field(
        default=10.0, metadata={"help": "Percent of packed blocks held out (the last ones)."}
    )
    preprocessing_num_workers: Optional[int] = field(
        default=None, metadata={"help": "Processes for tokenization/packing."}
    )
    dataset_mixture: Optional[str] = field(
        default=None,
        metadata={"help": "--streaming: weighted sources, \"SOURCE=WEIGHT,...\" (each a file, "
                  "glob, directory or hub name[:config]; dragon.data.mixture)."},
    )
    streaming: bool = field(
        default=False,
        metadata={"help": "Read, tokenize and pack the data as training reads it "
                          "(dragon.data.streaming)."},
    )
    validation_file: Optional[str] = field(
        default=None,
        metadata={"help": "--streaming: validation text files (as --train_file); default: the "
                  "stream's first --validation_blocks blocks, held out."},
    )
    validation_blocks: int = field(
        default=256, metadata={"help": "--streaming: blocks at the stream's head held out."}
    )
    shuffle_buffer_blocks: int = field(
        default=0, metadata={"help": "--streaming: blocks of a shuffling buffer over the stream "
                             "(0: in order); it is saved and resumed with the checkpoint."}
    )
    cache_dir: Optional[str] = field(
        default=None, metadata={"help": "datasets cache directory (default: datasets' own)."}
    )
    prepared_data: Optional[str] = field(
        default=None,
        metadata={"help": "A directory recipes/prepare_data.py wrote from these same data "
                  "arguments (it writes there): the run opens its blocks without tokenizing."},
    )


# ---------------------------------------------------------------- raw text


def builtin_corpus_files() -> list[str]:
    """The interpreter's standard library .py files, without site-packages and test dirs, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place: site-packages alone can be far larger than the stdlib to walk.
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    # Sort by relative path so the order (and thus the packed blocks) is the same everywhere.
    return [str(p) for p in sorted(files, key=lambda p: p.relative_to(root).parts)]


def _load(source: str, *args: Any, streaming: bool = False, **kwargs: Any) -> Any:
    """datasets.load_dataset(*args, split="train"), a DataError naming `source` if it fails."""
    try:
        return datasets.load_dataset(*args, split="train", streaming=streaming, **kwargs)
    except Exception as e:  # decoding/parsing errors arrive wrapped in DatasetGenerationError
        raise DataError(f"{source} could not be loaded: {one_line(e.__cause__ or e)}") from e


def text_only(ds: Any, column: str, source: str) -> Any:
    """`ds` (a Dataset or an IterableDataset) reduced to its string column `column`, renamed
    "text"; a DataError naming `source` when there is no such string column."""
    names = ds.column_names
    if names is None:  # a stream whose features are not known until read (json)
        names = list(next(iter(ds), {}))
    if column not in names:
        raise DataError(
            f"text column {column!r} not found in {source}; "
            f"available columns: {names} (set --text_column_name)"
        )
    feature = ds.features[column] if ds.features else None
    string = isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")
    if feature is not None and not string:
        raise DataError(f"text column {column!r} of {source} has type {feature}, not string")
    ds = ds.select_columns([column])
    return ds.rename_column(column, "text") if column != "text" else ds


def _file_texts(spec: str, column: str, cache_dir: Optional[str], streaming: bool) -> Any:
    """The documents of every file `spec` (--train_file) names, in order; a .txt file is one
    document (its text column is "text"), so its byte stream stays contiguous like the
    reference's."""
    parts = []
    for builder, files in builder_groups(resolve_files(spec)):
        name = files[0] if len(files) == 1 else f"{files[0]} (or one of {len(files)} files)"
        source = f"train_file {name!r}"
        kwargs = {"sample_by": "document"} if builder == "text" else {}
        ds = _load(f"{source} as {builder}", builder, data_files=files, cache_dir=cache_dir,
                   streaming=streaming, **kwargs)
        parts.append(text_only(ds, "text" if builder == "text" else column, source))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def open_texts(args: DataArguments, streaming: bool = False) -> Any:
    """The raw documents, column "text": a Dataset, or with `streaming` an IterableDataset read
    as it is iterated."""
    if args.dataset_name is not None and args.train_file is not None:
        raise DataError(
            f"both dataset_name {args.dataset_name!r} and train_file "
            f"{args.train_file!r} are given; give at most one"
        )
    column, cache = args.text_column_name, args.cache_dir
    if args.train_file is not None:
        return _file_texts(args.train_file, column, cache, streaming)
    if args.dataset_name is not None:
        source = f"dataset {args.dataset_name!r}"
        ds = _load(source, args.dataset_name, args.dataset_config_name, cache_dir=cache,
                   streaming=streaming)
        return text_only(ds, column, source)
    return _load("the builtin corpus", "text", data_files=builtin_corpus_files(),
                 sample_by="document", cache_dir=cache, streaming=streaming)


def _source(args: DataArguments) -> str:
    if args.train_file is not None:
        return f"train_file {args.train_file!r}"
    return f"dataset {args.dataset_name!r}" if args.dataset_name else "the builtin corpus"


def load_text(args: DataArguments) -> Dataset:
    """The raw documents as a Dataset with the single string column "text"."""
    ds = open_texts(args)
    # Stops at the first non-empty batch, so this is cheap for real data.
    if not any(any(batch["text"]) for batch in ds.iter(batch_size=PACK_BATCH_SIZE)):
        raise DataError(f"{_source(args)} is empty: {len(ds)} rows and no text")
    return ds


# ---------------------------------------------------------------- packing


def pack_batch(batch: dict[str, list], tokenizer: Any, block_size: int) -> dict[str, Any]:
    """Tokenize a batch of documents, concatenate them, cut into rows of block_size+1 ids."""
    stream = tokenizer.encode_concatenated(batch["text"]).astype(np.int64)
    width = block_size + 1
    rows = len(stream) // width
    return {"input_ids": stream[: rows * width].reshape(rows, width)}


def pack(
    texts: Dataset,
    tokenizer: Any,
    block_size: int,
    num_proc: Optional[int] = None,
    batch_size: int = PACK_BATCH_SIZE,
    cache_file_name: Optional[str] = None,
) -> Dataset:
    """Token blocks of exactly block_size+1 ids in column "input_ids" (cached datasets.map; in
    `cache_file_name` when given)."""
    # int16 halves int32 storage for byte-level and small vocabularies; formatted torch rows
    # are converted with .long() by the batch readers below.
    dtype = "int16" if tokenizer.vocab_size <= 2**15 else "int32"
    return texts.map(
        pack_batch,
        batched=True,
        batch_size=batch_size,
        fn_kwargs={"tokenizer": tokenizer, "block_size": block_size},
        remove_columns=texts.column_names,
        features=datasets.Features({"input_ids": datasets.List(datasets.Value(dtype))}),
        num_proc=num_proc,
        cache_file_name=cache_file_name,
        desc=f"Packing into blocks of {block_size + 1} tokens",
    )


def split_blocks(blocks: Dataset, validation_percentage: float) -> tuple[Dataset, Dataset]:
    """(train, validation): validation is the last ceil(n * pct / 100) blocks, train the rest."""
    pct = validation_percentage
    if not 0 <= pct < 100:
        raise DataError(f"validation_split_percentage {pct} is outside [0, 100)")
    n = len(blocks)
    # round() first so that e.g. 10% of 30 is 3, not ceil(3.0000000000000004) = 4.
    n_val = math.ceil(round(n * pct / 100, 9))
    if pct > 0 and (n_val == 0 or n_val == n):
        raise DataError(
            f"validation_split_percentage {pct} of {n} blocks leaves {n - n_val} "
            f"train and {n_val} validation blocks; lower --block_size or add data"
        )
    # datasets rejects select(range(n, n)) (IndexError), so an empty split is range(0).
    validation = blocks.select(range(n - n_val, n) if n_val else range(0))
    return blocks.select(range(n - n_val)), validation


def check_data_args(args: DataArguments) -> None:
    if not isinstance(args.block_size, int) or args.block_size < 1:
        raise DataError(f"block_size {args.block_size!r} is invalid; it must be an integer >= 1")
    pct = args.validation_split_percentage
    if not 0 <= pct < 100:
        raise DataError(f"validation_split_percentage {pct} is outside [0, 100)")
    if not isinstance(args.shuffle_buffer_blocks, int) or args.shuffle_buffer_blocks < 0:
        raise DataError(f"shuffle_buffer_blocks {args.shuffle_buffer_blocks!r} is invalid; use "
                        "0 (in order) or a number of blocks")
    workers = args.preprocessing_num_workers
    if workers is not None and workers < 1:
        raise DataError(f"preprocessing_num_workers {workers} is invalid; use >= 1 or omit it")


def build_datasets(args: DataArguments) -> tuple[Dataset, Dataset, Any]:
    """(train blocks, validation blocks, tokenizer) from DataArguments, tokenized and packed
    here (dragon.data.prepared opens what was packed ahead)."""
    check_data_args(args)
    tokenizer = load_tokenizer(args.tokenizer_name)  # first: fails before slow loading
    texts = load_text(args)
    blocks = pack(texts, tokenizer, args.block_size, args.preprocessing_num_workers)
    check_blocks(blocks, texts, tokenizer, args.block_size)
    train, validation = split_blocks(blocks, args.validation_split_percentage)
    return train, validation, tokenizer


def check_blocks(blocks: Dataset, texts: Dataset, tokenizer: Any, block_size: int) -> None:
    """Raise when packing `texts` gave no block."""
    if len(blocks) > 0:
        return
    # Error path only, so re-tokenizing to count is acceptable.
    n_tokens = sum(len(tokenizer.encode(t)) for t in texts["text"])
    width = block_size + 1
    if n_tokens >= width:  # long enough overall, but no map batch of documents was
        raise DataError(
            f"data has {n_tokens} tokens but no batch of {PACK_BATCH_SIZE} "
            f"documents reaches block_size+1={width} tokens; lower --block_size"
        )
    raise DataError(
        f"data has {n_tokens} tokens, shorter than one block of "
        f"block_size+1={width} tokens; lower --block_size or add data"
    )
