"""Stateful training and the learning-rate floor, at equal tokens, on the built-in corpus.

    python benchmarks/stateful.py [--steps 600] [--part carry|schedules|both]   (CPU: ~2 minutes
    per row)

A 229k-parameter BDH, the ZeRO recipe on 2 ranks (ZeRO-1), AdamW lr 3e-3, beta2 0.95, 2,048
predicted tokens per step in every row. Part "carry": shuffled independent blocks of 128 and of
512 (4 rows a step) against rows read as streams: with the state zeroed every step (the streams'
data order alone), and carried with resets every 4 and 16 steps and only at the wrap. Every row
reports eval_loss (independent validation blocks) and eval_loss_carried (the validation split
read as streams, the state carried). Part "schedules": block 128 without carried state, warm-up then
cosine to zero, cosine down to a floor of a tenth of the peak (the default), and a constant
learning rate.
"""

import argparse
import tempfile
import time
from pathlib import Path

from recipe_runs import run_recipe
MODEL = (
    "--n_layer 2 --n_embd 64 --n_head 2 --mlp_internal_dim_multiplier 16 --learning_rate 3e-3 "
    "--adam_beta2 0.95 --dropout 0.0 --sample_max_new_tokens 0 --disable_tqdm --logging_steps 10 "
    "--max_eval_samples 512 --per_device_eval_batch_size 8 --eval_carried "
    "--deepspeed ds_configs/zero1.json"
).split()
TOKENS_PER_STEP = 2048


def run(out: Path, steps: int, block: int, extra: list[str]) -> dict:
    """One recipe run on 2 ranks: its final metrics, median tokens/s and wall time."""
    every = ["--max_steps", "--eval_steps", "--save_steps"]
    args = [a for flag in every for a in (flag, str(steps))]
    args += ["--warmup_steps", str(steps // 10), "--block_size", str(block)]
    args += ["--per_device_train_batch_size", str(TOKENS_PER_STEP // block // 2), *MODEL, *extra]
    start = time.perf_counter()
    metrics = run_recipe(out, 2, args)
    seconds = time.perf_counter() - start
    speeds = sorted(m["tokens_per_second"] for m in metrics if "tokens_per_second" in m)
    return {**metrics[-1], "tokens_per_second": speeds[len(speeds) // 2], "wall": seconds}


def row(name: str, m: dict) -> str:
    return (
        f"| {name} | {m['eval_loss']:.4f} | {m['eval_loss_carried']:.4f} | "
        f"{m['tokens_per_second']:,.0f} | {m['wall']:.0f} s |"
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--part", choices=("carry", "schedules", "both"), default="both")
    cli = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="stateful-"))
    header = (
        "| run | final eval_loss | final eval_loss_carried | tokens/s (median) | wall |\n"
        "|---|---|---|---|---|"
    )
    print(f"{cli.steps} steps x {TOKENS_PER_STEP:,} predicted tokens, 2 ranks\n")
    if cli.part in ("carry", "both"):
        print(header)
        carry = ["--carry_state", "--state_reset_steps"]
        for name, block, extra in (
            ("block 128, shuffled blocks", 128, []),
            ("block 512, shuffled blocks", 512, []),
            ("block 128, streams, state reset every step", 128, [*carry, "1"]),
            ("block 128, streams, carried, reset every 4 steps", 128, [*carry, "4"]),
            ("block 128, streams, carried, reset every 16 steps", 128, [*carry, "16"]),
            ("block 128, streams, carried, reset at the wrap only", 128, [*carry, "0"]),
        ):
            metrics = run(root / name.replace(" ", "_").replace(",", ""), cli.steps, block, extra)
            print(row(name, metrics), flush=True)
    if cli.part in ("schedules", "both"):
        print("\n" + header)
        for name, extra in (
            ("cosine to zero", ["--lr_scheduler_type", "cosine"]),
            ("cosine to 0.1 x peak (default)", ["--lr_scheduler_type", "cosine_with_min_lr"]),
            ("constant after warm-up", ["--lr_scheduler_type", "constant_with_warmup"]),
        ):
            out = root / name.split(" (")[0].replace(" ", "_")
            print(row(name, run(out, cli.steps, 128, extra)), flush=True)


if __name__ == "__main__":
    main()
