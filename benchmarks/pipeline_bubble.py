"""Step time of the 2-stage BDH pipeline against one process on the same global batch.

    python benchmarks/pipeline_bubble.py            (CPU: one core per stage, ~5 minutes)

Every rank gets one thread, so the single process computes the whole model on one core and the
pipeline spreads it over two. Without a bubble (and with free communication) the pipeline step
would take half the single step; the fraction lost is 1 - (single / P) / pipeline, printed next
to the theoretical bubble (P - 1) / (m + P - 1) for m micro-batches.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = [
    "--n_layer",
    "4",
    "--n_embd",
    "64",
    "--n_head",
    "2",
    "--mlp_internal_dim_multiplier",
    "16",
    "--block_size",
    "128",
    "--dropout",
    "0.0",
    "--sample_max_new_tokens",
    "0",
    "--disable_tqdm",
    "--eval_steps",
    "1000",
    "--save_steps",
    "1000",
    "--logging_steps",
    "5",
    "--max_steps",
    "40",
]
STAGES, MICRO = 2, 4


def step_seconds(cmd: list[str], out: Path, tokens_per_step: int) -> float:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    subprocess.run(
        cmd + ["--output_dir", str(out), *MODEL], cwd=REPO, env=env, check=True, capture_output=True
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tps = sorted(r["tokens_per_second"] for r in records[1:])  # the first interval includes warm-up
    return tokens_per_step / tps[len(tps) // 2]  # median: robust to a noisy neighbour


def main():
    root = Path(tempfile.mkdtemp(prefix="bubble-"))
    print(
        "| micro-batches m | single process s/step | 2-stage pipeline s/step | speed-up | "
        "time lost (measured) | bubble (P-1)/(m+P-1) |"
    )
    print("|---|---|---|---|---|---|")
    for m in (1, 2, 4, 8):
        tokens = MICRO * m * 128
        common = [
            "--per_device_train_batch_size",
            str(MICRO),
            "--gradient_accumulation_steps",
            str(m),
        ]
        single = step_seconds(
            [
                sys.executable,
                "recipes/pretrain.py",
                "--deepspeed",
                "ds_configs/zero0.json",
                *common,
            ],
            root / f"single{m}",
            tokens,
        )
        pipe = step_seconds(
            [
                "torchrun",
                "--nproc_per_node",
                str(STAGES),
                "--master_port",
                str(29700 + m),
                "recipes/pretrain_pipeline.py",
                "--pipeline_stages",
                str(STAGES),
                "--deepspeed",
                "ds_configs/pipeline_zero0.json",
                *common,
            ],
            root / f"pipe{m}",
            tokens,
        )
        lost = 1 - (single / STAGES) / pipe
        bubble = (STAGES - 1) / (m + STAGES - 1)
        print(
            f"| {m} | {single:.3f} | {pipe:.3f} | {single / pipe:.2f}x | {lost:.0%} | "
            f"{bubble:.0%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
