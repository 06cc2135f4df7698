"""The data path alone, next to training: tokens/s of dragon's batches (byte and Hugging Face
tokenizers, --streaming and materialised), the training tokens/s of the same recipe run on each
path, and the resident memory of a process streaming a corpus of several GB.

    python benchmarks/data_speed.py            # about 10 minutes on 2 CPU cores
    python benchmarks/data_speed.py --big_gb 0 # without the memory run
    python benchmarks/data_speed.py --memory_only --memory_limit_gib 1  # as root: the memory run
        # in a memory cgroup of 1 GiB (page cache included), a third of the 3 GB corpus

Corpora are generated under a temporary directory (words of the standard library's sources in
random order, jsonl shards) and deleted at the end.
"""

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
import datasets  # noqa: E402

from recipe_runs import run_recipe  # noqa: E402
from dragon.data.batches import TrainBatches  # noqa: E402
from dragon.data.text import DataArguments, build_datasets  # noqa: E402
from dragon.data.streaming import StreamingBatches, build_streams  # noqa: E402

datasets.disable_progress_bars()
BLOCK, MICRO = 512, 8
TRAIN_TOKENS = 16 * 128  # tokens one step of the training runs predicts


def write_shards(root: Path, megabytes: float, shards: int = 4) -> Path:
    """jsonl shards of ~2 KB documents, `megabytes` in all."""
    root.mkdir(parents=True, exist_ok=True)
    words = Path(sysconfig.get_paths()["stdlib"], "typing.py").read_text().split()
    rng = random.Random(0)
    per_shard = int(megabytes * 1e6 / shards)
    for k in range(shards):
        with open(root / f"{k:05d}.jsonl", "w") as f:
            written = 0
            while written < per_shard:
                line = json.dumps({"text": " ".join(rng.choices(words, k=300))}) + "\n"
                written += f.write(line)
    return root


def train_tokenizer(corpus: Path, path: Path) -> str:
    """A byte-level BPE of 4,096 tokens trained on the corpus, saved like a hub tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = (json.loads(line)["text"] for line in open(next(corpus.glob("*.jsonl"))))
    tok.train_from_iterator(lines, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(path))
    return str(path)


def rate(batches, tokens: int) -> float:
    """Tokens/s of reading `tokens` tokens of micro-batches, after the first one."""
    next(batches)
    began, n = time.perf_counter(), 0
    while n < tokens:
        n += next(batches).numel()
    return n / (time.perf_counter() - began)


def data_path(corpus: Path, tokenizer, streamed: bool, tokens: int, cache: str,
              shuffle: int = 0) -> dict:
    args = DataArguments(train_file=str(corpus), tokenizer_name=tokenizer, block_size=BLOCK,
                         streaming=streamed, validation_blocks=16, cache_dir=cache)
    began = time.perf_counter()
    if streamed:
        train, _, _ = build_streams(args)
        batches = StreamingBatches(train, MICRO, 0, 1, shuffle_blocks=shuffle)
        return {"start_s": time.perf_counter() - began, "tokens_per_s": rate(batches, tokens)}
    train, _, _ = build_datasets(args)  # tokenizes and packs the whole corpus first
    packed = time.perf_counter() - began
    batches = TrainBatches(train, MICRO, 0, 1)
    read = rate(batches, tokens)
    whole = len(train) * (BLOCK + 1)
    return {"start_s": packed, "pack_tokens_per_s": whole / packed, "tokens_per_s": read}


def training(corpus: Path, streamed: bool, out: Path, steps: int) -> float:
    """Median training tokens/s of a 1-process CPU recipe run (steps after the 5th)."""
    args = ["--deepspeed", "ds_configs/zero0.json", "--train_file", str(corpus),
            "--max_steps", str(steps), "--n_layer", "2", "--n_embd", "64", "--n_head", "2",
            "--mlp_internal_dim_multiplier", "16", "--block_size", "128",
            "--per_device_train_batch_size", "16", "--logging_steps", "1",
            "--eval_steps", str(steps), "--save_steps", str(steps), "--max_eval_samples", "16",
            "--sample_max_new_tokens", "0", "--disable_tqdm", "--overwrite_output_dir"]
    args += ["--streaming", "--validation_blocks", "64"] if streamed else []
    shutil.rmtree(out, ignore_errors=True)
    records = run_recipe(out, 1, args)
    return statistics.median(r["tokens_per_second"] for r in records if r["step"] > 5)


def join_memory_cgroup(gib: float) -> Path:
    """Move this process into a new cgroup (v1 memory controller, or v2) limited to `gib` of
    memory, page cache included; over it the kernel reclaims cache, then kills the process."""
    v1 = Path("/sys/fs/cgroup/memory")
    group = (v1 if v1.is_dir() else Path("/sys/fs/cgroup")) / f"dragon_data_speed_{os.getpid()}"
    group.mkdir()
    limit = str(int(gib * 2**30))
    (group / ("memory.limit_in_bytes" if v1.is_dir() else "memory.max")).write_text(limit)
    (group / "cgroup.procs").write_text(str(os.getpid()))
    return group


def cgroup_peak_mib(group: Path) -> float:
    for name in ("memory.max_usage_in_bytes", "memory.peak"):
        if (group / name).exists():
            return int((group / name).read_text()) / 2**20
    return float("nan")


def big_corpus(root: Path, gigabytes: float) -> Path:
    """A generated corpus of `gigabytes`: one 100 MB shard, copied."""
    shard = write_shards(root / "seed", 100, shards=1) / "00000.jsonl"
    for k in range(max(1, round(gigabytes * 10))):
        shutil.copyfile(shard, root / f"{k:05d}.jsonl")
    shutil.rmtree(root / "seed")
    return root


def peak_rss_streaming(root: Path) -> dict:
    """Stream the corpus under `root` through the byte path, sampling this process's resident
    memory."""
    size = sum(p.stat().st_size for p in root.glob("*.jsonl"))
    proc, peak, samples = psutil.Process(), [0], []
    before = proc.memory_info().rss
    args = DataArguments(train_file=str(root), block_size=BLOCK, streaming=True,
                         validation_blocks=16)
    train, _, _ = build_streams(args)
    batches = StreamingBatches(train, MICRO, 0, 1)
    done = threading.Event()

    def sample():
        while not done.wait(0.05):
            peak[0] = max(peak[0], proc.memory_info().rss)

    threading.Thread(target=sample, daemon=True).start()
    began, n = time.perf_counter(), 0
    while batches.epoch == 0:
        n += next(batches).numel()
        if len(samples) < n // 100_000_000:  # the resident memory after every 100 M tokens
            samples.append(proc.memory_info().rss)
    done.set()
    seconds = time.perf_counter() - began
    return {"corpus_gb": size / 1e9, "tokens": n, "seconds": seconds,
            "rss_before_mib": before / 2**20, "rss_first_mib": samples[0] / 2**20,
            "rss_last_mib": samples[-1] / 2**20,
            "peak_rss_mib": peak[0] / 2**20, "ram_gib": psutil.virtual_memory().total / 2**30}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus_mb", type=float, default=100)
    parser.add_argument("--big_gb", type=float, default=3)
    parser.add_argument("--train_steps", type=int, default=100)
    parser.add_argument("--train_repeats", type=int, default=3)
    parser.add_argument("--memory_limit_gib", type=float, default=0,
                        help="run the memory run in a memory cgroup of this size (root)")
    parser.add_argument("--memory_only", action="store_true")
    opts = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dragon_data_speed_"))
    try:
        if opts.big_gb > 0:  # first, in a process that has read nothing else yet
            big = big_corpus(tmp / "big", opts.big_gb)  # written before any limit applies
            group = None
            if opts.memory_limit_gib:
                os.sync()  # and drop the cache: the pages are read again inside the limit
                Path("/proc/sys/vm/drop_caches").write_text("3")
                group = join_memory_cgroup(opts.memory_limit_gib)
            result = peak_rss_streaming(big)
            if group is not None:
                result.update(cgroup_limit_gib=opts.memory_limit_gib,
                              cgroup_peak_mib=cgroup_peak_mib(group))
                (group.parent / "cgroup.procs").write_text(str(os.getpid()))  # leave, remove it
                group.rmdir()
            print(json.dumps(result), flush=True)
            shutil.rmtree(big)
        if opts.memory_only:
            return
        corpus = write_shards(tmp / "corpus", opts.corpus_mb)
        small = write_shards(tmp / "small", opts.corpus_mb / 10)  # BPE packs ~100x slower
        hf = train_tokenizer(small, tmp / "bpe4096")
        print(f"corpus: {opts.corpus_mb:.0f} MB of jsonl for bytes, {opts.corpus_mb / 10:.0f} MB "
              f"for BPE; block {BLOCK}, micro-batch {MICRO}, one process")
        print("| path | tokenizer | start (s) | data path tokens/s |")
        print("|---|---|---|---|")
        runs = (("bytes", None, corpus, 50_000_000), ("BPE 4096", hf, small, 5_000_000))
        for name, tok, data, tokens in runs:
            for streamed, shuffle in ((True, 0), (True, 1024), (False, 0)):
                if shuffle and tok is not None:
                    continue
                cache = str(tmp / f"cache_{name}_{streamed}")
                r = data_path(data, tok, streamed, tokens, cache, shuffle)
                if streamed and tok is None and not shuffle:
                    byte_stream_rate = r["tokens_per_s"]
                path = "--streaming" if streamed else "materialised"
                path += f" --shuffle_buffer_blocks {shuffle}" if shuffle else ""
                extra = ("" if streamed else
                         f" (packing {r['pack_tokens_per_s'] / 1e6:.2f} M tokens/s)")
                print(f"| {path} | {name} | {r['start_s']:.1f}{extra} | "
                      f"{r['tokens_per_s'] / 1e6:.2f} M |", flush=True)
        rates = {True: [], False: []}
        for _ in range(opts.train_repeats):  # alternated: drift on a shared machine hits both
            for streamed in (False, True):
                rates[streamed].append(training(small, streamed, tmp / "run", opts.train_steps))
        ratio = statistics.median(rates[True]) / statistics.median(rates[False])
        shown = {k: [round(r) for r in v] for k, v in rates.items()}
        print(f"training tokens/s (1 process, n_embd 64, block 128, micro-batch 16): "
              f"materialised {shown[False]}, --streaming {shown[True]}; median ratio "
              f"streamed / materialised {ratio:.3f}")
        step_s = TRAIN_TOKENS / statistics.median(rates[True])
        data_s = 16 * 129 / byte_stream_rate  # the ids read: block_size + 1 per sample
        print(f"the byte stream's work per training step: {data_s * 1e3:.2f} ms of a "
              f"{step_s * 1e3:.0f} ms step ({data_s / step_s:.2%}), if none of it overlapped")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
