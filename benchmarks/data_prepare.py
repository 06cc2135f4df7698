"""Tokenizing ahead (recipes/prepare_data.py) against tokenizing in the job: the preparation's
tokens/s per worker process, for UTF-8 bytes and a BPE tokenizer, with 1 and 2 workers; and the
seconds from a recipe's launch to its first training step on a corpus of --big_mb, tokenized in
the job (a fresh datasets cache) against opened prepared.

    python benchmarks/data_prepare.py                 # about 10 minutes on 2 CPU cores
    python benchmarks/data_prepare.py --corpus_mb 20 --big_mb 50 --repeats 1  # a quick look

Corpora are generated under a temporary directory (data_speed.py's jsonl shards of words of the
standard library) and deleted at the end.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets  # noqa: E402

from data_speed import train_tokenizer, write_shards  # noqa: E402
from dragon.data.prepared import prepare  # noqa: E402
from dragon.data.text import DataArguments  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BLOCK = 512
SHARD_DOCUMENTS = 10_000  # ~20 MB of the generated documents a shard


def preparation(corpus: Path, tokenizer, workers: int, tmp: Path) -> dict:
    """Tokens/s of recipes/prepare_data.py's work on `corpus`, from a fresh cache and directory."""
    out, cache = tmp / f"prepared_{workers}", tmp / f"cache_{workers}"
    args = DataArguments(train_file=str(corpus), tokenizer_name=tokenizer, block_size=BLOCK,
                         prepared_data=str(out), preprocessing_num_workers=workers,
                         cache_dir=str(cache))
    began = time.perf_counter()
    done = prepare(args, SHARD_DOCUMENTS, progress=False)
    seconds = time.perf_counter() - began
    shutil.rmtree(out)
    shutil.rmtree(cache)
    return {"tokenizer": "bytes" if tokenizer is None else "BPE 4,096", "workers": workers,
            "seconds": round(seconds, 1), "tokens_per_s": done["tokens"] / seconds,
            "tokens_per_s_per_worker": done["tokens"] / seconds / workers}


def first_step_seconds(data_flags: list[str], out: Path) -> float:
    """Seconds from a 1-rank ZeRO-0 recipe's launch to its first metrics line (step 1)."""
    shutil.rmtree(out, ignore_errors=True)
    args = ["--deepspeed", "ds_configs/zero0.json", "--output_dir", str(out), "--max_steps", "50",
            "--n_layer", "2", "--n_embd", "64", "--n_head", "2", "--mlp_internal_dim_multiplier",
            "16", "--block_size", str(BLOCK), "--per_device_train_batch_size", "4",
            "--logging_steps", "1", "--eval_steps", "1000", "--save_steps", "1000",
            "--max_eval_samples", "16", "--sample_max_new_tokens", "0", "--disable_tqdm",
            *data_flags]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    metrics = out / "metrics.jsonl"
    began = time.perf_counter()
    proc = subprocess.Popen(["torchrun", "--nproc_per_node", "1", "--master_port", "29611",
                             "recipes/pretrain.py", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not (metrics.exists() and metrics.read_text().strip()):
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended first: {proc.stderr.read()[-2000:]}")
            time.sleep(0.1)
        return time.perf_counter() - began
    finally:
        proc.kill()
        proc.wait()


def first_steps(big: Path, tokenizer, tmp: Path, repeats: int) -> dict:
    """Prepare `big` (2 workers), then the median seconds to the first step tokenized in the job
    (a fresh cache each time) and prepared, the two alternating."""
    flags = ["--train_file", str(big), "--block_size", str(BLOCK)]
    flags += ["--tokenizer_name", tokenizer] if tokenizer else []
    prepared = tmp / "big_prepared"
    began = time.perf_counter()
    subprocess.run([sys.executable, "recipes/prepare_data.py", *flags, "--prepared_data",
                    str(prepared), "--shard_documents", str(SHARD_DOCUMENTS),
                    "--preprocessing_num_workers", "2", "--cache_dir", str(tmp / "prep_cache"),
                    "--disable_tqdm"], cwd=REPO, check=True, capture_output=True)
    prepare_s = time.perf_counter() - began
    in_job, opened = [], []
    for k in range(repeats):
        in_job.append(first_step_seconds([*flags, "--cache_dir", str(tmp / f"job_cache{k}")],
                                         tmp / f"in_job{k}"))
        shutil.rmtree(tmp / f"job_cache{k}")
        opened.append(first_step_seconds([*flags, "--prepared_data", str(prepared)],
                                         tmp / f"prepared{k}"))
    shutil.rmtree(prepared)
    return {"prepare_s (2 workers)": round(prepare_s, 1),
            "first_step_s tokenized in the job": round(statistics.median(in_job), 1),
            "first_step_s prepared": round(statistics.median(opened), 1),
            "all in the job": [round(x, 1) for x in in_job],
            "all prepared": [round(x, 1) for x in opened]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus_mb", type=float, default=100)
    parser.add_argument("--big_mb", type=float, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip_preparation_rates", action="store_true")
    opts = parser.parse_args()
    datasets.disable_progress_bars()
    tmp = Path(tempfile.mkdtemp(prefix="dragon_data_prepare_"))
    try:
        corpus = write_shards(tmp / "corpus", opts.corpus_mb)
        bpe = train_tokenizer(corpus, tmp / "bpe")
        for tokenizer in (None, bpe) if not opts.skip_preparation_rates else ():
            for workers in (1, 2):
                print(json.dumps(preparation(corpus, tokenizer, workers, tmp)), flush=True)
        big = write_shards(tmp / "big", opts.big_mb)
        size = sum(p.stat().st_size for p in big.glob("*.jsonl")) / 1e6
        for name, tokenizer in (("bytes", None), ("BPE 4,096", bpe)):
            print(json.dumps({"corpus_mb": round(size), "tokenizer": name,
                              **first_steps(big, tokenizer, tmp, opts.repeats)}), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
