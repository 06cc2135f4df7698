"""--streaming (dragon.data.streaming) on real files and the real `datasets` streaming, and through
real
2-rank DeepSpeed jobs: the streamed blocks are the materialised ones, 2 ranks read what 1 rank
reads at the same global batch, a resumed stream reads what the uninterrupted one reads."""

import json
from collections import Counter
import os
import subprocess

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before datasets is imported: no hub access
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import (  # noqa: E402
    CARRY,
    LOSS_ATOL,
    REPO,
    STEPS,
    TINY,
    bad_input_base,
    job_env,
    launch,
    launch_command,
    losses,
    read_jsonl,
    run_recipe_in_process,
)
from datasets import Dataset  # noqa: E402
from test_checkpoints import finish, kill_when, logged_steps  # noqa: E402
from test_data import make_hf_tokenizer  # noqa: E402

from dragon.data.text import DataArguments, DataError, load_text, pack  # noqa: E402
from dragon.data.streaming import StreamingBatches, build_streams  # noqa: E402

datasets.disable_progress_bars()


@pytest.fixture
def shards(tmp_path):
    """Three kinds of shard: .txt (one document each), .jsonl rows and a .parquet file."""
    root = tmp_path / "shards"
    root.mkdir()
    for k in range(2):
        (root / f"{k}.txt").write_text(f"plain text shard {k}, " * 40)
    rows = [{"text": f"json row {i} " * (1 + i % 5), "id": i} for i in range(60)]
    (root / "2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts = [f"parquet row {i} " * (1 + i % 3) for i in range(40)]
    Dataset.from_dict({"text": texts}).to_parquet(str(root / "3.parquet"))
    return root


def streams(tmp_path, spec, **kw):
    args = DataArguments(train_file=str(spec), streaming=True, block_size=7,
                         validation_blocks=5, cache_dir=str(tmp_path / "cache"), **kw)
    return build_streams(args)


def ids(rows) -> list[list[int]]:
    return [list(map(int, r)) for r in rows]


@pytest.mark.parametrize("hf", [False, True], ids=["bytes", "hf_tokenizer"])
def test_streamed_blocks_are_the_materialised_blocks(tmp_path, shards, hf):
    """txt, jsonl and parquet shards streamed: the held-out head then the training stream are
    the materialised path's blocks in order (the same packing of the same documents), on every
    build; read through StreamingBatches' thread too (the tokenizer copied with the dataset)."""
    tokenizer = make_hf_tokenizer(tmp_path / "tok") if hf else None
    train, valid, tok = streams(tmp_path, shards, tokenizer_name=tokenizer)
    texts = load_text(DataArguments(train_file=str(shards), cache_dir=str(tmp_path / "cache")))
    expected = ids(pack(texts, tok, 7)["input_ids"])
    streamed = ids(valid["input_ids"]) + ids(row["input_ids"] for row in train)
    assert streamed == expected and len(valid) == 5 and len(expected) > 100
    again, _, _ = streams(tmp_path, shards, tokenizer_name=tokenizer)
    assert ids(row["input_ids"] for row in again) == expected[5:]
    assert ids(next(StreamingBatches(again, 4, 0, 1))) == expected[5:9]


def read(batches, n) -> list[torch.Tensor]:
    return [next(batches) for _ in range(n)]


def test_two_ranks_read_what_one_rank_reads_at_the_same_global_batch(tmp_path, shards):
    """Micro-batch 2 on each of 2 ranks (or 2 DiLoCo islands of 1 rank: the same data shards)
    holds the rows of micro-batch 4 on 1 rank, and of 2 accumulated micro-batches of 2, at every
    step, past the end of the stream (the ranks are disjoint; the next pass follows the last)."""
    train, _, _ = streams(tmp_path, shards)
    n = sum(1 for _ in train)
    steps = n // 4 + 3  # beyond one pass of the stream
    one = read(StreamingBatches(train, 4, 0, 1), steps)
    accum = read(StreamingBatches(train, 2, 0, 1, grad_accum=2), 2 * steps)
    ranks = [read(StreamingBatches(train, 2, r, 2), steps) for r in (0, 1)]
    blocks = torch.tensor(ids(row["input_ids"] for row in train))
    blocks = torch.cat([blocks, blocks])  # the global order over two passes
    for s in range(steps):
        assert torch.equal(one[s], blocks[4 * s : 4 * s + 4])
        assert torch.equal(torch.cat(accum[2 * s : 2 * s + 2]), one[s])
        for r in (0, 1):  # blocks 4s+r and 4s+r+2: disjoint, together the global batch
            assert torch.equal(ranks[r][s], blocks[4 * s + r : 4 * s + 4 : 2])


@pytest.mark.parametrize("consumed", [0, 7, 101, 150])
def test_resume_reads_the_same_next_batches(tmp_path, shards, consumed):
    """A stream rebuilt from a saved state (through torch.save, as in a checkpoint) returns what
    the uninterrupted stream returns next: inside the first pass, at its end (rank 1 reads 101
    micro-batches of 3 of the 607 blocks in a pass) and in the second pass."""
    train, _, _ = streams(tmp_path, shards)
    assert sum(1 for _ in train) == 607
    full = read(StreamingBatches(train, 3, 1, 2), consumed + 12)
    first = StreamingBatches(train, 3, 1, 2)
    read(first, consumed)
    torch.save(first.state_dict(), tmp_path / "state.pt")
    resumed = StreamingBatches(train, 3, 1, 2)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=False))
    assert all(torch.equal(a, b) for a, b in zip(read(resumed, 12), full[consumed:]))
    seeked = StreamingBatches(train, 3, 1, 2, grad_accum=1)
    seeked.seek(consumed)
    assert torch.equal(next(seeked), full[consumed])


@pytest.mark.parametrize("consumed", [0, 5, 160])
def test_a_shuffled_stream_resumes_with_its_buffer(tmp_path, shards, consumed):
    """A shuffling buffer of 64 blocks: the blocks come out in another order, each block of a pass
    once and none more than 64 places early; another seed draws another order; 2 ranks read the
    rows of 1 rank's global batches; and a stream rebuilt from a saved state (the buffer's blocks
    and random state through torch.save) returns what the uninterrupted one returns next, inside
    the first pass (also while the buffer fills: 5 micro-batches of 3 on 2 ranks are 30 blocks)
    and in the second (160)."""
    train, _, _ = streams(tmp_path, shards)
    stream = [tuple(row) for row in ids(row["input_ids"] for row in train)]  # 607 blocks
    shuffled = StreamingBatches(train, 1, 0, 1, shuffle_blocks=64, seed=1)
    out = [tuple(b[0].tolist()) for b in read(shuffled, 500)]
    assert out != stream[:500]
    for k in range(0, 500, 50):  # out's first k blocks are among the stream's first k + 64
        assert not Counter(out[:k]) - Counter(stream[:k + 64])
    other = read(StreamingBatches(train, 1, 0, 1, shuffle_blocks=64, seed=2), 100)
    assert [tuple(b[0].tolist()) for b in other] != out[:100]
    one = read(StreamingBatches(train, 4, 0, 1, shuffle_blocks=64), 20)
    ranks = [read(StreamingBatches(train, 2, r, 2, shuffle_blocks=64), 20) for r in (0, 1)]
    assert all(torch.equal(ranks[r][s], one[s][r::2]) for s in range(20) for r in (0, 1))
    full = read(StreamingBatches(train, 3, 1, 2, shuffle_blocks=64), consumed + 12)
    first = StreamingBatches(train, 3, 1, 2, shuffle_blocks=64)
    read(first, consumed)
    torch.save(first.state_dict(), tmp_path / "state.pt")
    resumed = StreamingBatches(train, 3, 1, 2, shuffle_blocks=64)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=False))
    assert all(torch.equal(a, b) for a, b in zip(read(resumed, 12), full[consumed:]))


def test_validation_file_is_the_validation_set(tmp_path, shards):
    train, valid, _ = streams(tmp_path, shards / "2.jsonl", validation_file=str(shards / "0.txt"))
    assert bytes(valid[0]["input_ids"]) == b"plain te"
    assert bytes(ids([next(iter(train))["input_ids"]])[0]) == b"json row"


@pytest.mark.parametrize(
    "make,needles",
    [
        (lambda d: d / "missing.jsonl", ["missing.jsonl", "does not exist"]),
        (lambda d: d / "empty.jsonl", ["streams no text"]),
        (lambda d: d / "short.txt", ["holds 2 blocks", "--validation_blocks"]),
        (lambda d: d / "body.jsonl", ["text column 'text' not found", "['body']"]),
    ],
)
def test_one_line_errors(tmp_path, make, needles):
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    (tmp_path / "short.txt").write_text("x" * 17)
    (tmp_path / "body.jsonl").write_text('{"body": "abc"}\n')
    with pytest.raises(DataError) as e:
        streams(tmp_path, make(tmp_path))
    message = str(e.value)
    assert "\n" not in message and all(n in message for n in needles), message


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--streaming", "--carry_state", "--shuffle_buffer_blocks", "8"],
         "--carry_state with --shuffle_buffer_blocks 8: a row reads its text in order; use 0"),
        (["--streaming", "--carry_state", "--dataset_mixture", "x.txt=1"],
         "--carry_state with --dataset_mixture"),
        (["--validation_file", "x.txt"], "--validation_file x.txt: it is read with --streaming"),
        (["--dataset_mixture", "x.txt=1"], "--dataset_mixture x.txt=1: mixtures are streamed"),
    ],
)
def test_preflight_refuses(tmp_path, monkeypatch, text_file, extra, needle):
    argv = bad_input_base("zero2.json", tmp_path / "out", text_file) + extra
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    assert needle in run_recipe_in_process(monkeypatch, "recipes/pretrain.py", argv, env)


STREAM = ["--streaming", "--validation_blocks", "64", "--shuffle_buffer_blocks", "32"]


def test_pipeline_on_two_stages_equals_zero_on_two_ranks(runs):
    """The pipeline recipe (2 stages x 1 data rank, 2 micro-batches of 4) and the ZeRO recipe (2
    data ranks x 4) read the same streamed global batches: the same losses within rounding."""
    _, zero, _ = runs("stream_zero2", extra=STREAM)
    _, pipe, _ = runs(
        "stream_pipe", config="pipeline_zero0.json", script="recipes/pretrain_pipeline.py",
        extra=[*STREAM, "--pipeline_stages", "2", "--gradient_accumulation_steps", "2"],
    )
    assert len(zero) == len(pipe) == 8
    assert losses(pipe) == pytest.approx(losses(zero), abs=LOSS_ATOL)
    assert losses(pipe, "eval_loss") == pytest.approx(losses(zero, "eval_loss"), abs=LOSS_ATOL)


def start_streamed(out, data, flags=tuple(STREAM), extra=()):
    """In the background, the 2-rank ZeRO-2 run that runs("stream_zero2") makes (of `data`)."""
    args = ["--deepspeed", str(REPO / "ds_configs/zero2.json"), "--output_dir", str(out),
            "--train_file", str(data), "--max_steps", str(STEPS),
            "--per_device_train_batch_size", "4", *TINY, *flags, *extra]
    return subprocess.Popen(launch_command("torchrun", 2, "recipes/pretrain.py", args), cwd=REPO,
                            env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


CARRIED_STREAM = ["--streaming", "--validation_blocks", "64", *CARRY]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["one file", "4 shards", "4 shards carried"])
def test_sigkill_then_resume_replays_the_uninterrupted_losses(runs, tmp_path, text_file,
                                                              four_shards, kind):
    """2 ranks, ZeRO-2, --streaming through a shuffling buffer, of one file (each rank keeps
    every other block) or of 4 shards (each rank reads its own 2), or of 4 shards with
    --carry_state (each row a stretch of its rank's documents, its state carried): killed between
    the saves of steps 4 and 8, resumed from step 4 (each rank's stream position, buffer or rows
    and states from its own files), the losses are the uninterrupted run's (bit-equal)."""
    data = text_file if kind == "one file" else four_shards
    flags = CARRIED_STREAM if "carried" in kind else STREAM
    name = {"one file": "stream_zero2", "4 shards": "stream_zero2_shards",
            "4 shards carried": "stream_zero2_shards_carried"}[kind]
    # one file: the session's corpus, which runs() trains on unless told another file
    other = [] if kind == "one file" else ["--train_file", str(data)]
    _, expected, proc = runs(name, extra=[*flags, *other])
    split = ("1 shard(s) for 2 data-parallel ranks: every rank reads the whole stream"
             if kind == "one file" else "4 shards split among 2")
    assert f"streaming: {split}" in proc.stderr
    out = tmp_path / "killed"
    metrics = out / "metrics.jsonl"
    proc = start_streamed(out, data, flags)
    kill_when(proc, lambda: max(logged_steps(metrics), default=0) >= 5)
    assert max(logged_steps(metrics)) < STEPS, "killed too late"
    assert (out / "checkpoints" / "step4" / "data_stream_1.pt").exists()
    finish(start_streamed(out, data, flags, ["--resume_from_checkpoint", "latest"]))
    resumed = [m for m in read_jsonl(metrics) if m["step"] > 4][-(STEPS - 4) :]
    assert [m["step"] for m in resumed] == list(range(5, STEPS + 1))
    assert [m["loss"] for m in resumed] == losses(expected)[4:]
    if "carried" in kind:
        assert [m["eval_loss_carried"] for m in resumed if "eval_loss_carried" in m] == \
            losses(expected, "eval_loss_carried")[-1:]


@pytest.fixture
def two_sources(tmp_path):
    """Source "a" (jsonl) holds only the letter a, source "b" (txt) only b: a block's bytes say
    which source it came from."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.txt"
    a.write_text("".join(json.dumps({"text": "a" * 70}) + "\n" for _ in range(400)))
    b.write_text("b" * 20_000)
    return a, b


def mixture(tmp_path, spec, seed=0):
    args = DataArguments(dataset_mixture=spec, streaming=True, block_size=7, validation_blocks=5,
                         cache_dir=str(tmp_path / "cache"))
    return build_streams(args, seed)


def test_mixture_takes_tokens_by_the_weights(tmp_path, two_sources):
    """a=0.7, b=0.3: over 2000 blocks a's share is 0.7 within 0.031 (3 standard deviations of a
    binomial share); every block is tagged with its own source; a seed fixes the draw."""
    a, b = two_sources
    train, _, _ = mixture(tmp_path, f"{a}=0.7,{b}=0.3")
    batches = StreamingBatches(train, 8, 0, 1)
    rows = torch.cat(read(batches, 250))
    from_a = (rows == ord("a")).all(dim=1)
    assert bool((from_a | (rows == ord("b")).all(dim=1)).all())  # no block mixes sources
    assert abs(from_a.float().mean().item() - 0.7) < 0.031
    assert batches.tokens_taken(2) == [int(from_a.sum()) * 7, int((~from_a).sum()) * 7]
    for seed, same in ((0, True), (1, False)):
        draw = StreamingBatches(mixture(tmp_path, f"{a}=0.7,{b}=0.3", seed)[0], 8, 0, 1)
        assert torch.equal(torch.cat(read(draw, 250)), rows) == same


def test_mixture_resumes_exactly(tmp_path, two_sources):
    """The draw's random state is part of the saved position: a resumed mixture reads on as the
    uninterrupted one, its token counts included."""
    a, b = two_sources
    train, _, _ = mixture(tmp_path, f"{a}=1,{b}=1")
    full = StreamingBatches(train, 4, 1, 2)
    expected = read(full, 60)
    first = StreamingBatches(train, 4, 1, 2)
    read(first, 37)
    resumed = StreamingBatches(train, 4, 1, 2)
    resumed.load_state_dict(first.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(read(resumed, 23), expected[37:]))
    assert resumed.tokens_taken(2) == full.tokens_taken(2)


@pytest.mark.parametrize(
    "spec,needles",
    [
        ("{a}", ["entry", "is not SOURCE=WEIGHT"]),
        ("{a}=0.5,{b}=heavy", ["weight 'heavy'", "b.txt", "number >= 0"]),
        ("{a}=-1,{b}=2", ["weight '-1'"]),
        ("{a}=0,{b}=0", ["sum to 0"]),
        ("{a}=1,{body}=1", ["text column 'text' not found", "body.jsonl", "['body']"]),
        ("{a}=1,{empty}=1", ["source", "empty.jsonl", "streams no text"]),
        ("{a}=1,{missing}=1", ["missing.txt", "does not exist"]),
    ],
)
def test_mixture_one_line_errors(tmp_path, two_sources, spec, needles):
    (tmp_path / "body.jsonl").write_text('{"body": "abc"}\n')
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n')
    names = {k: tmp_path / f for k, f in
             [("body", "body.jsonl"), ("empty", "empty.jsonl"), ("missing", "missing.txt")]}
    with pytest.raises(DataError) as e:
        mixture(tmp_path, spec.format(a=two_sources[0], b=two_sources[1], **names))
    message = str(e.value)
    assert "\n" not in message and all(n in message for n in needles), message


def test_a_mixture_run_logs_the_tokens_taken_from_each_source(tmp_path, text_file):
    """2 ranks, a mixture of two files (one of them a glob): metrics.jsonl counts the tokens of
    both ranks from each source, which add up to the run's tokens at every logged step."""
    (tmp_path / "prose").mkdir()
    data = text_file.read_bytes()
    (tmp_path / "code.txt").write_bytes(data[: len(data) // 2])
    (tmp_path / "prose" / "p.txt").write_bytes(data[len(data) // 2 :])
    mix = f"{tmp_path}/code.txt=0.7,{tmp_path}/prose/*.txt=0.3"
    out = tmp_path / "run"
    args = ["--deepspeed", str(REPO / "ds_configs/zero2.json"), "--output_dir", str(out),
            "--dataset_mixture", mix, "--max_steps", "4", "--per_device_train_batch_size", "4",
            *TINY, *STREAM]
    proc = launch("torchrun", 2, "recipes/pretrain.py", args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(out / "metrics.jsonl")
    keys = [f"tokens[{tmp_path}/code.txt]", f"tokens[{tmp_path}/prose/*.txt]"]
    assert [m["step"] for m in records if "loss" in m] == [1, 2, 3, 4]
    for m in records:
        if "loss" in m:
            assert m[keys[0]] + m[keys[1]] == m["tokens"] == m["step"] * 8 * 64
    assert records[-1][keys[0]] > records[-1][keys[1]] > 0
