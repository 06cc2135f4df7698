"""Tests for dragon.data.text on real files and the real `datasets` library (nothing mocked)."""

import json
import math
import os
import sysconfig
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before datasets is imported: no hub access
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

from dragon.data.batches import TrainBatches, eval_batches, shard_indices  # noqa: E402
from dragon.data.text import (  # noqa: E402
    DataArguments,
    DataError,
    build_datasets,
    builtin_corpus_files,
    load_text,
    pack,
    split_blocks,
)
from dragon.data.tokenizer import ByteTokenizer, load_tokenizer  # noqa: E402

datasets.disable_progress_bars()

DOCS = [
    "héllo wörld\n",
    "second document, a bit longer than the first one.\n",
    "x",
    "",
    "λ≈∂ unicode ünd emoji 🐉\n",
    "last document " * 5,
]


def write_text(tmp_path, text, name="corpus.txt"):
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    return str(path)


def write_jsonl(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def args_for(tmp_path, **kw):
    return DataArguments(cache_dir=str(tmp_path / "cache"), **kw)


def indexed_blocks(n, width=3):
    """n samples whose ids all equal the sample index, so batches reveal which samples they hold."""
    return Dataset.from_dict({"input_ids": [[i] * width for i in range(n)]})


def sample_ids(batch):
    return batch[:, 0].tolist()


def assert_one_line_error(excinfo, *needles):
    message = str(excinfo.value)
    assert "\n" not in message, message
    for needle in needles:
        assert str(needle) in message, (needle, message)


def test_data_arguments_parse_from_command_line():
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(DataArguments).parse_args_into_dataclasses(
        ["--train_file", "x.txt", "--block_size", "64", "--validation_split_percentage", "5"]
    )
    assert (args.train_file, args.block_size, args.validation_split_percentage) == ("x.txt", 64, 5)
    assert args.dataset_name is None and args.text_column_name == "text"


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    text = "plain ASCII, ünïcödé, 漢字, 🐉"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert tok.decode([0xFF]) == "\ufffd"  # invalid UTF-8 is replaced, not raised


def make_hf_tokenizer(path):
    """A tiny byte-level BPE tokenizer trained offline and saved like a hub tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(DOCS * 5, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(path))
    return str(path)


def test_hf_tokenizer_from_local_path(tmp_path):
    tok = load_tokenizer(make_hf_tokenizer(tmp_path / "tok"))
    assert tok.vocab_size > 256
    ids = tok.encode(DOCS[0])
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == DOCS[0] and tok.decode(torch.tensor(ids)) == DOCS[0]


# ---------------------------------------------------------------- raw text


def test_builtin_corpus_files():
    files = builtin_corpus_files()
    assert files and files == builtin_corpus_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [Path(f).relative_to(root).parts for f in files]
    assert rel == sorted(rel)
    for parts in rel:
        assert not {"site-packages", "dist-packages", "test", "tests", "idle_test"} & set(parts)
    assert 5e6 < sum(os.path.getsize(f) for f in files) < 40e6


def test_load_text_txt_is_one_document(tmp_path):
    text = "".join(DOCS)
    ds = load_text(args_for(tmp_path, train_file=write_text(tmp_path, text)))
    assert ds.column_names == ["text"] and ds["text"][:] == [text]


def test_load_text_jsonl_and_json(tmp_path):
    rows = [{"id": i, "body": d} for i, d in enumerate(DOCS)]
    ds = load_text(
        args_for(tmp_path, train_file=write_jsonl(tmp_path, rows), text_column_name="body")
    )
    assert ds.column_names == ["text"] and ds["text"][:] == DOCS
    path = tmp_path / "array.json"
    path.write_text(json.dumps([{"text": d} for d in DOCS]), encoding="utf-8")
    assert load_text(args_for(tmp_path, train_file=str(path)))["text"][:] == DOCS


def test_load_text_parquet(tmp_path):
    path = str(tmp_path / "data.parquet")
    Dataset.from_dict({"text": DOCS, "n": list(range(len(DOCS)))}).to_parquet(path)
    ds = load_text(args_for(tmp_path, train_file=path))
    assert ds.column_names == ["text"] and ds["text"][:] == DOCS


def test_a_dataset_name_that_is_a_local_dataset_directory(tmp_path):
    """--dataset_name DIR loads a dataset repository on disk (its data files, as the hub's
    layout holds them) through load_dataset, as a hub id would be: the same text, and the same
    blocks as --train_file of its file."""
    repo = tmp_path / "my_dataset"
    (repo / "data").mkdir(parents=True)
    rows = [{"text": d, "url": f"u{i}"} for i, d in enumerate(DOCS * 3)]
    write_jsonl(repo / "data", rows, name="train-00000.jsonl")
    named = args_for(tmp_path, dataset_name=str(repo), block_size=8)
    assert load_text(named)["text"][:] == DOCS * 3
    by_file = args_for(tmp_path / "file", train_file=str(repo / "data" / "train-00000.jsonl"),
                       block_size=8)
    for a, b in zip(build_datasets(named)[:2], build_datasets(by_file)[:2]):
        assert a["input_ids"][:] == b["input_ids"][:]


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("builtin_cache"))


def test_load_text_builtin_corpus(builtin_cache):
    ds = load_text(DataArguments(cache_dir=builtin_cache))
    files = builtin_corpus_files()
    assert ds.column_names == ["text"] and len(ds) == len(files)
    for i in (0, len(files) // 2, len(files) - 1):  # one row per file, in file order
        assert ds[i]["text"] == Path(files[i]).read_text(encoding="utf-8")


def test_build_datasets_builtin_default(builtin_cache):
    train, val, tok = build_datasets(DataArguments(cache_dir=builtin_cache))
    assert isinstance(tok, ByteTokenizer)
    assert len(train) > 15_000 and len(val) == -(-(len(train) + len(val)) // 10)
    row = train.with_format("torch")[0]["input_ids"]
    assert row.shape == (513,) and torch.equal(row.long(), row.long().clamp(0, 255))
    assert tok.decode(row).startswith(Path(builtin_corpus_files()[0]).read_text()[:100])


# ---------------------------------------------------------------- packing


def check_packed(blocks, docs, tok, block_size):
    """Every block has block_size+1 ids and blocks are a prefix of the concatenated stream."""
    rows = blocks["input_ids"][:]
    assert all(len(r) == block_size + 1 for r in rows)
    stream = [i for d in docs for i in tok.encode(d)]
    flat = [i for r in rows for i in r]
    assert flat == stream[: len(flat)]
    assert len(stream) - len(flat) < block_size + 1  # only the tail is dropped
    return flat


def test_pack_concatenates_documents(tmp_path):
    path = write_jsonl(tmp_path, [{"text": d} for d in DOCS])
    ds = load_text(args_for(tmp_path, train_file=path))
    tok = ByteTokenizer()
    blocks = pack(ds, tok, block_size=7)
    assert blocks.column_names == ["input_ids"]
    assert check_packed(blocks, DOCS, tok, 7)
    rows = blocks.with_format("torch")[:]["input_ids"]
    assert rows.shape == (len(blocks), 8) and rows.long().dtype == torch.int64
    # With 2 documents per map batch, each batch is packed on its own and loses its own tail.
    small = pack(ds, tok, block_size=7, batch_size=2)
    flat = [i for r in small["input_ids"][:] for i in r]
    expected = []
    for b in range(0, len(DOCS), 2):
        stream = [i for d in DOCS[b : b + 2] for i in tok.encode(d)]
        expected += stream[: len(stream) // 8 * 8]
    assert flat == expected and len(small) < len(blocks)


def test_pack_is_cached(tmp_path):
    args = args_for(tmp_path, train_file=write_text(tmp_path, "".join(DOCS) * 50))
    first = pack(load_text(args), ByteTokenizer(), 16)
    second = pack(load_text(args), ByteTokenizer(), 16)
    assert first.cache_files and first.cache_files == second.cache_files
    assert first._fingerprint == second._fingerprint


def test_pack_hf_tokenizer(tmp_path):
    args = args_for(
        tmp_path,
        train_file=write_jsonl(tmp_path, [{"text": d} for d in DOCS * 4]),
        tokenizer_name=make_hf_tokenizer(tmp_path / "tok"),
        block_size=5,
        validation_split_percentage=20,
    )
    train, val, tok = build_datasets(args)
    blocks = datasets.concatenate_datasets([train, val])
    check_packed(blocks, DOCS * 4, tok, 5)
    assert len(val) == -(-len(blocks) // 5)


# ---------------------------------------------------------------- splitting


def test_split_blocks_contiguous_and_deterministic():
    blocks = indexed_blocks(30)
    train, val = split_blocks(blocks, 10)
    assert sample_ids(train.with_format("torch")[:]["input_ids"]) == list(range(27))
    assert sample_ids(val.with_format("torch")[:]["input_ids"]) == [27, 28, 29]
    assert split_blocks(blocks, 10)[1]["input_ids"] == val["input_ids"]
    assert [len(s) for s in split_blocks(indexed_blocks(31), 10)] == [27, 4]  # ceil
    assert [len(s) for s in split_blocks(blocks, 0)] == [30, 0]
    assert [len(s) for s in split_blocks(indexed_blocks(2), 50)] == [1, 1]


@pytest.mark.parametrize("pct", [-1, 100, 150])
def test_split_blocks_bad_percentage(pct):
    with pytest.raises(DataError) as e:
        split_blocks(indexed_blocks(10), pct)
    assert_one_line_error(e, pct)


def test_split_blocks_too_few_blocks():
    with pytest.raises(DataError) as e:
        split_blocks(indexed_blocks(1), 10)
    assert_one_line_error(e, "1 blocks")


# ---------------------------------------------------------------- training batches


def take(stream, k):
    return [sample_ids(next(stream)) for _ in range(k)]


def test_train_batches_cover_epoch_disjointly():
    n, m, world, accum = 50, 2, 3, 2
    data = indexed_blocks(n)
    streams = [TrainBatches(data, m, r, world, accum, seed=7) for r in range(world)]
    G = m * world * accum
    steps = n // G
    assert streams[0].steps_per_epoch == steps
    for epoch in range(2):
        seen = []
        for _ in range(steps):
            global_batch = [s for st in streams for s in sum(take(st, accum), [])]
            assert len(set(global_batch)) == G  # disjoint across ranks and micro-steps
            seen += global_batch
        perm = streams[0].permutation(epoch)[: steps * G].tolist()
        assert sorted(seen) == sorted(perm)
    batch = next(streams[0])
    assert batch.dtype == torch.int64 and batch.shape == (m, 3)


def test_train_batches_two_ranks_equal_one_rank_with_double_micro_batch():
    data = indexed_blocks(41)
    one = TrainBatches(data, 4, 0, 1, grad_accum=3, seed=3)
    two = [TrainBatches(data, 2, r, 2, grad_accum=3, seed=3) for r in range(2)]
    for _ in range(2 * one.micro_steps_per_epoch + 1):  # crosses two epoch boundaries
        assert sample_ids(next(one)) == sample_ids(next(two[0])) + sample_ids(next(two[1]))


def test_train_batches_seeds_and_epochs_differ():
    data = indexed_blocks(64)
    a, b = TrainBatches(data, 4, 0, 1, seed=0), TrainBatches(data, 4, 0, 1, seed=1)
    assert take(a, 16) != take(b, 16)
    assert take(a, 16) != take(TrainBatches(data, 4, 0, 1, seed=0), 16)  # epoch 1 != epoch 0
    again = [take(TrainBatches(data, 4, 0, 1, seed=1), 16) for _ in range(2)]
    assert again[0] == again[1]


@pytest.mark.parametrize("consumed", [0, 3, 5, 7, 12])
def test_train_batches_resume(consumed):
    data = indexed_blocks(27)  # G = 2*2*2 = 8 -> 3 steps, 6 micro-batches per rank per epoch
    make = lambda: TrainBatches(data, 2, 1, 2, grad_accum=2, seed=11)  # noqa: E731
    reference = make()
    expected = take(reference, consumed + 8)[consumed:]
    interrupted = make()
    take(interrupted, consumed)
    state = json.loads(json.dumps(interrupted.state_dict()))  # survives a checkpoint round trip
    assert set(state) == {"epoch", "micro_step", "seed"}
    resumed = make()
    resumed.load_state_dict(state)
    assert take(resumed, 8) == expected


@pytest.mark.parametrize("steps", [0, 2, 3, 7])
def test_train_batches_seek_stands_where_a_stream_that_read_all_along_would(steps):
    """An elastic joiner without a checkpoint seeks to the step it joins at (past epoch ends)."""
    data = indexed_blocks(27)  # 3 steps of 2 micro-batches per rank per epoch
    make = lambda: TrainBatches(data, 2, 1, 2, grad_accum=2, seed=11)  # noqa: E731
    expected = take(make(), steps * 2 + 8)[steps * 2 :]
    sought = make()
    sought.seek(steps)
    assert take(sought, 8) == expected


def test_train_batches_too_few_samples():
    with pytest.raises(DataError) as e:
        TrainBatches(indexed_blocks(3), 2, 0, 2)
    assert_one_line_error(e, "3 samples", "only 1 micro-batches of 2", "2 data-parallel ranks")
    with pytest.raises(DataError) as e:
        TrainBatches(indexed_blocks(5), 2, 0, 2, grad_accum=2)
    assert_one_line_error(e, "5 samples", "global batch of 8")


# ---------------------------------------------------------------- sharding and evaluation


@pytest.mark.parametrize("n", [0, 1, 3, 10, 17])
@pytest.mark.parametrize("world", [1, 2, 4, 5])
def test_shard_indices(n, world):
    shards = [list(shard_indices(n, r, world)) for r in range(world)]
    flat = [i for s in shards for i in s]
    assert sorted(flat) == list(range(n)) and len(set(flat)) == n
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_eval_batches_equal_counts_per_rank():
    data = indexed_blocks(23)
    per_rank = [eval_batches(data, 2, r, 3) for r in range(3)]  # 11 batches -> 3 per rank
    assert [len(b) for b in per_rank] == [3, 3, 3]
    used = [s for batches in per_rank for b in batches for s in sample_ids(b)]
    assert len(set(used)) == 18 and all(b.dtype == torch.int64 for b in per_rank[0])
    assert per_rank[1] == [] or sample_ids(per_rank[1][0]) == [2, 3]
    assert [len(eval_batches(data, 2, r, 3, max_samples=12)) for r in range(3)] == [2, 2, 2]


def test_eval_batches_too_few():
    with pytest.raises(DataError) as e:
        eval_batches(indexed_blocks(5), 2, 0, 3)
    assert_one_line_error(e, "5 samples", "2 x 3")


# ---------------------------------------------------------------- bad input


def expect_error(args, *needles):
    with pytest.raises(DataError) as e:
        build_datasets(args)
    assert_one_line_error(e, *needles)


def test_error_missing_file(tmp_path):
    expect_error(args_for(tmp_path, train_file=str(tmp_path / "nope.txt")), "nope.txt", "not exist")


def test_error_unknown_extension(tmp_path):
    path = write_text(tmp_path, "abc", name="data.csv")
    expect_error(args_for(tmp_path, train_file=path), "'.csv'", ".txt", ".jsonl", ".parquet")


def test_error_missing_text_column(tmp_path):
    path = write_jsonl(tmp_path, [{"body": "a", "id": 1}])
    expect_error(args_for(tmp_path, train_file=path), "'text'", "['body', 'id']")


@pytest.mark.parametrize("rows", [[], [{"text": ""}, {"text": ""}]])
def test_error_empty_jsonl(tmp_path, rows):
    expect_error(args_for(tmp_path, train_file=write_jsonl(tmp_path, rows)), "data.jsonl", "empty")


def test_error_empty_txt(tmp_path):
    expect_error(args_for(tmp_path, train_file=write_text(tmp_path, "")), "corpus.txt", "empty")


def test_error_shorter_than_one_block(tmp_path):
    args = args_for(tmp_path, train_file=write_text(tmp_path, "0123456789"), block_size=512)
    expect_error(args, "data has 10 tokens", "block_size+1=513")


def test_error_both_sources(tmp_path):
    args = args_for(tmp_path, train_file=write_text(tmp_path, "abc"), dataset_name="some/data")
    expect_error(args, "some/data", "corpus.txt", "at most one")


def test_error_unknown_hub_dataset(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # datasets reads the environment once at import; patch its config so this test never
    # waits on network retries even when the module was imported without the variables.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    expect_error(
        args_for(tmp_path, dataset_name="no-such-org/no-such-dataset"),
        "dataset 'no-such-org/no-such-dataset' could not be loaded",
    )


@pytest.mark.parametrize("block_size", [0, -3])
def test_error_bad_block_size(tmp_path, block_size):
    expect_error(args_for(tmp_path, block_size=block_size), f"block_size {block_size}")


def test_error_bad_tokenizer_path(tmp_path):
    expect_error(
        args_for(
            tmp_path,
            train_file=write_text(tmp_path, "abc" * 100),
            tokenizer_name=str(tmp_path / "missing_tok"),
        ),
        "missing_tok",
    )


def test_bits_per_byte_factor_against_a_count_by_hand(tmp_path):
    """eval_bpb = eval_loss x bits_per_byte_factor: predicted tokens / (their UTF-8 bytes x ln 2).
    Bytes: every token is one byte, multi-byte characters included (exactly 1 / ln 2). A BPE
    tokenizer: rows that each encode a whole document; a row predicts all but its first token,
    so its bytes are the document's less the first token's."""
    from dragon.run.data import bits_per_byte_factor

    text = "".join(DOCS).encode("utf-8")
    rows = torch.tensor(list(text[: 6 * 16])).view(3, 2, 16)  # 3 batches of 2 rows of 16
    assert bits_per_byte_factor(list(rows), ByteTokenizer()) == pytest.approx(1 / math.log(2))

    tok = load_tokenizer(make_hf_tokenizer(tmp_path / "tok"))
    docs = [DOCS[1], DOCS[4], DOCS[5]]
    batches = [torch.tensor([tok.encode(doc)]) for doc in docs]
    tokens = sum(len(tok.encode(doc)) - 1 for doc in docs)
    first = [len(tok.tokenizer.convert_ids_to_tokens(int(b[0, 0]))) for b in batches]
    text_bytes = sum(len(doc.encode("utf-8")) - n for doc, n in zip(docs, first))
    assert tokens < text_bytes  # BPE: fewer tokens than bytes
    assert bits_per_byte_factor(batches, tok) == pytest.approx(tokens / (text_bytes * math.log(2)))
