"""DiLoCo (2 islands x 2 ranks) against synchronous data parallel over 4 ranks, same tokens.

    python benchmarks/diloco.py [--steps 600] [--seed 42] [--rows 10:sync:none,...]   (CPU: ~6
    minutes per row)

Built-in corpus, a 229k-parameter BDH, ZeRO-1, 4 ranks x micro-batch 8 x 128 tokens per step in
every row, AdamW (beta2 --adam_beta2) with --warmup_steps of linear warm-up, then cosine. Prints
the final validation loss (the islands' theta_outer after the last outer step) and the bytes
each rank sends: DiLoCo's cross-island bytes are measured (metrics.jsonl,
outer_bytes_sent); data parallel's gradient traffic is the ring model 2(n-1)/n x fp32 size per
step (ZeRO-1: reduce-scatter of gradients plus all-gather of parameters).
"""

import argparse
import tempfile
from pathlib import Path

from recipe_runs import run_recipe
MODEL = [
    "--n_layer",
    "2",
    "--n_embd",
    "64",
    "--n_head",
    "2",
    "--mlp_internal_dim_multiplier",
    "16",
    "--block_size",
    "128",
    "--per_device_train_batch_size",
    "8",
    "--learning_rate",
    "3e-3",
    "--dropout",
    "0.0",
    "--sample_max_new_tokens",
    "0",
    "--disable_tqdm",
    "--logging_steps",
    "10",
    "--max_eval_samples",
    "512",
    "--deepspeed",
    "ds_configs/zero1.json",
    "--lr_scheduler_type",
    "cosine",
]
PARAMS = 229_376


def run(
    name: str, root: Path, steps: int, warmup: int, beta2: float, extra: list[str]
) -> list[dict]:
    every = ["--max_steps", "--eval_steps", "--save_steps"]
    args = [a for flag in every for a in (flag, str(steps))]
    args += ["--warmup_steps", str(warmup), "--adam_beta2", str(beta2), *MODEL, *extra]
    island0 = "island0" if "--diloco_islands" in extra else ""
    return run_recipe(root / name, 4, args, island0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--warmup_steps", type=int, default=120)
    parser.add_argument("--adam_beta2", type=float, default=0.95)
    parser.add_argument("--outer_lr", type=float, default=1.0)
    parser.add_argument("--outer_momentum", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=42, help="the recipe's --seed, for every run")
    parser.add_argument(
        "--rows",
        default="10:sync:none,50:sync:none,10:delayed:none,50:delayed:none,"
        "10:sync:int8,50:sync:int8",
        help="DiLoCo rows as H:mode:compression, comma-separated",
    )
    cli = parser.parse_args()
    steps, warmup, beta2 = cli.steps, cli.warmup_steps, cli.adam_beta2
    root = Path(tempfile.mkdtemp(prefix="diloco-"))
    seed = ["--seed", str(cli.seed)]
    dp = run("dp", root, steps, warmup, beta2, seed)
    dp_loss = dp[-1]["eval_loss"]
    dp_bytes = steps * 2 * 3 / 4 * PARAMS * 4
    print(
        f"{steps} steps x {4 * 8 * 128:,} tokens, AdamW beta2 {beta2}, {warmup} warm-up steps "
        "then cosine; "
        f"outer SGD lr {cli.outer_lr}, Nesterov momentum {cli.outer_momentum}\n"
    )
    print("| run | final val loss | vs DP | bytes sent per rank | vs DP |")
    print("|---|---|---|---|---|")
    print(
        f"| data parallel, 4 ranks | {dp_loss:.4f} | - | {dp_bytes / 1e6:.1f} MB (ring model) | 1 |"
    )
    rows = [row.split(":") for row in cli.rows.split(",")]
    for h, mode, compress in rows:
        metrics = run(
            f"h{h}-{mode}-{compress}",
            root,
            steps,
            warmup,
            beta2,
            [
                "--diloco_islands",
                "2",
                "--diloco_inner_steps",
                str(h),
                "--diloco_mode",
                mode,
                "--diloco_compress",
                compress,
                "--diloco_outer_lr",
                str(cli.outer_lr),
                "--diloco_outer_momentum",
                str(cli.outer_momentum),
                *seed,
            ],
        )
        loss = metrics[-1]["eval_loss"]
        sent = sum(m.get("outer_bytes_sent", 0) for m in metrics)
        hidden = sum(m.get("outer_comm_hidden_seconds", 0) for m in metrics)
        comm = sum(m.get("outer_comm_seconds", 0) for m in metrics)
        note = f", {hidden:.2f} of {comm:.2f} s comm hidden" if mode == "delayed" else ""
        print(
            f"| DiLoCo 2x2, H={h}, {mode}, {compress}{note} | {loss:.4f} | "
            f"{loss / dp_loss - 1:+.1%} | "
            f"{sent / 1e6:.3f} MB | 1/{dp_bytes / max(sent, 1):.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
