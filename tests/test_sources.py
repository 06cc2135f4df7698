"""--train_file as several files, globs and directories, on real files (dragon.data.sources)."""

import json
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before datasets is imported: no hub access
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets  # noqa: E402
import pytest  # noqa: E402
from datasets import Dataset  # noqa: E402

from dragon.data.text import DataArguments, DataError, build_datasets, load_text  # noqa: E402
from dragon.data.sources import resolve_files  # noqa: E402

datasets.disable_progress_bars()


@pytest.fixture
def shards(tmp_path):
    """A folder of plays: two .txt files, a .jsonl and a .parquet one level down, and files that
    are not data (a README, an empty shard)."""
    root = tmp_path / "plays"
    (root / "more").mkdir(parents=True)
    (root / "b.txt").write_text("the second play\n")
    (root / "a.txt").write_text("the first play\n")
    rows = [{"text": f"jsonl row {i}", "id": i} for i in range(3)]
    (root / "more" / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    Dataset.from_dict({"text": ["parquet row"], "n": [0]}).to_parquet(str(root / "more/d.parquet"))
    (root / "README.md").write_text("not data")
    (root / "empty.txt").write_text("")
    return root


def texts(tmp_path, spec):
    return load_text(DataArguments(train_file=spec, cache_dir=str(tmp_path / "cache")))["text"]


def test_directory_glob_and_list(tmp_path, shards):
    """A directory reads every data file below it in sorted order (other files and empty shards
    skipped); a glob its matches, sorted; a list in the order given, each file once."""
    assert [os.path.relpath(f, shards) for f in resolve_files(str(shards))] == [
        "a.txt", "b.txt", "more/c.jsonl", "more/d.parquet"
    ]
    assert texts(tmp_path, str(shards)) == [
        "the first play\n", "the second play\n", "jsonl row 0", "jsonl row 1", "jsonl row 2",
        "parquet row",
    ]
    assert texts(tmp_path, str(shards / "*.txt")) == ["the first play\n", "the second play\n"]
    listed = f"{shards}/b.txt, {shards}/more/d.parquet,{shards}/b.txt,{shards}/a.txt"
    assert texts(tmp_path, listed) == ["the second play\n", "parquet row", "the first play\n"]


def test_many_files_pack_into_blocks(tmp_path, shards):
    train, valid, _ = build_datasets(
        DataArguments(train_file=f"{shards}/**/*.jsonl,{shards}/a.txt", block_size=3,
                      validation_split_percentage=20, cache_dir=str(tmp_path / "cache"))
    )
    ids = [i for row in [*train["input_ids"], *valid["input_ids"]] for i in row]
    stream = "".join(f"jsonl row {i}" for i in range(3)) + "the first play\n"
    assert bytes(ids) == stream.encode()[: len(ids)] and len(ids) == len(stream) // 4 * 4


@pytest.mark.parametrize(
    "entry,needle",
    [
        ("nope.txt", "does not exist"),
        ("*.csv", "matches no file"),
        ("empty_dir", "a directory without data files"),
        ("plays/empty.txt", "is empty"),
        ("plays/README.md", "extension '.md'"),
        ("plays/a.txt,,plays/b.txt", "has an empty entry"),
    ],
)
def test_one_line_errors(tmp_path, shards, entry, needle):
    """Each bad entry of a list is named, with what would be valid."""
    (tmp_path / "empty_dir").mkdir()
    spec = f"{shards}/a.txt,{tmp_path}/{entry}"
    with pytest.raises(DataError) as e:
        build_datasets(DataArguments(train_file=spec, cache_dir=str(tmp_path / "cache")))
    message = str(e.value)
    assert "\n" not in message and needle in message, message
    assert entry.split(",")[0] in message or "empty entry" in message, message
    assert ".txt, .json, .jsonl, .parquet" in message or needle.startswith("is empty"), message
