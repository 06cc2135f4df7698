"""DiLoCo (2 islands x 2 ranks) against synchronous data parallel over as many ranks, same tokens.

    python benchmarks/diloco.py [--steps 600] [--seed 42] [--island_ranks 2]
        [--rows 10:sync:none,50:delayed:int4:4,50:sync:topk0.02,50:sync:sparseloco0.01,...]
        [--outer_lrs 1,1.5] [--island_steps 50,25] [--no_data_parallel]
        (CPU: ~6 minutes per row and outer lr)

Built-in corpus, a 229k-parameter BDH, ZeRO-1, 2 islands of --island_ranks ranks (data parallel
over as many) x micro-batch 8 x 128 tokens per step in every row, AdamW (beta2 --adam_beta2)
with --warmup_steps of linear warm-up, then cosine. Prints the final validation loss (the
islands' weights after the last outer step), the bytes each rank sends (in all, and per H steps)
and the most it sent in one step: DiLoCo's cross-island bytes are measured (metrics.jsonl,
outer_bytes_sent); data parallel's gradient traffic is the ring model 2(n-1)/n x fp32 size per
step (ZeRO-1: reduce-scatter of gradients plus all-gather of parameters).
"""

import argparse
import tempfile
from pathlib import Path
from typing import Optional

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


def run(name: str, root: Path, cli, extra: list[str]) -> list[dict]:
    every = ["--max_steps", "--eval_steps", "--save_steps"]
    args = [a for flag in every for a in (flag, str(cli.steps))]
    args += ["--warmup_steps", str(cli.warmup_steps), "--adam_beta2", str(cli.adam_beta2),
             "--seed", str(cli.seed), *MODEL, *extra]
    island0 = "island0" if "--diloco_islands" in extra else ""
    return run_recipe(root / name, 2 * cli.island_ranks, args, island0)


def row_arguments(h: str, mode: str, codec: str, fragments: str, outer_lr: str,
                  cli) -> list[str]:
    """A row H:mode:codec[:F] at one outer lr as the recipe's arguments; codec topkX sends the
    fraction X, sparselocoX is SparseLoCo at density X (its default without X)."""
    if codec.startswith("topk"):
        wire = ["--diloco_topk", codec[4:]]
    elif codec.startswith("sparseloco"):
        wire = ["--diloco_compress", "sparseloco", "--diloco_topk", codec[10:] or "0"]
    else:
        wire = ["--diloco_compress", codec]
    # fragments in delayed mode land one step after their sync, as the README's figures did
    # (auto lands them when the link has carried them: not the same run twice)
    delay = ["--diloco_fragment_delay", "1"] if mode == "delayed" and fragments != "1" else []
    plan = ["--diloco_island_steps", cli.island_steps] if cli.island_steps else []
    return ["--diloco_islands", "2", "--diloco_inner_steps", h, "--diloco_mode", mode, *wire,
            *plan, "--diloco_fragments", fragments, *delay, "--diloco_outer_lr", outer_lr,
            "--diloco_outer_momentum", str(cli.outer_momentum)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--warmup_steps", type=int, default=120)
    parser.add_argument("--adam_beta2", type=float, default=0.95)
    parser.add_argument("--outer_lrs", default="1.0",
                        help="outer SGD learning rates, comma-separated: each row runs at each")
    parser.add_argument("--outer_momentum", type=float, default=0.0)
    parser.add_argument("--no_data_parallel", dest="data_parallel", action="store_false",
                        help="leave out the data-parallel row (its loss is deterministic)")
    parser.add_argument("--island_steps", default="",
                        help="unequal islands: each island's steps per window in every row, as "
                        "--diloco_island_steps takes them (default: every island every step)")
    parser.add_argument("--seed", type=int, default=42, help="the recipe's --seed, for every run")
    parser.add_argument("--island_ranks", type=int, default=2, help="ranks per island (2 islands)")
    parser.add_argument(
        "--rows",
        default="10:sync:none,50:sync:none,10:delayed:none,50:delayed:none,"
        "10:sync:int8,50:sync:int8",
        help="DiLoCo rows as H:mode:codec[:fragments], comma-separated; codec none, bf16, int8, "
        "int4, topkX (top-k of the fraction X) or sparselocoX (SparseLoCo at density X)",
    )
    cli = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="diloco-"))
    ranks = 2 * cli.island_ranks
    dp_loss = run("dp", root, cli, [])[-1]["eval_loss"] if cli.data_parallel else None
    # ZeRO-1's reduce-scatter of gradients and all-gather of parameters, ring model, per step
    dp_bytes = cli.steps * 2 * (ranks - 1) / ranks * PARAMS * 4
    print(
        f"{cli.steps} steps x {ranks * 8 * 128:,} tokens, AdamW beta2 {cli.adam_beta2}, "
        f"{cli.warmup_steps} warm-up steps then cosine; "
        f"outer SGD, Nesterov momentum {cli.outer_momentum}\n"
    )
    print("| run | outer lr | final val loss | vs DP | bytes sent per rank | vs DP "
          "| bytes per H steps | peak bytes in a step |")
    print("|---|---|---|---|---|---|---|---|")
    if dp_loss is not None:
        print(f"| data parallel, {ranks} ranks | - | {dp_loss:.4f} | - | {dp_bytes / 1e6:.1f} MB "
              f"(ring model) | 1 | - | {dp_bytes / cli.steps / 1e6:.3f} MB |")
    for row in cli.rows.split(","):
        h, mode, codec, fragments = (row.split(":") + ["1"])[:4]
        for outer_lr in cli.outer_lrs.split(","):
            metrics = run(f"{row.replace(':', '-')}-lr{outer_lr}", root, cli,
                          row_arguments(h, mode, codec, fragments, outer_lr, cli))
            print_row(metrics, h, mode, codec, fragments, outer_lr, dp_loss, dp_bytes, cli)


def print_row(metrics: list[dict], h: str, mode: str, codec: str, fragments: str,
              outer_lr: str, dp_loss: Optional[float], dp_bytes: float, cli) -> None:
    loss = metrics[-1]["eval_loss"]
    versus = "-" if dp_loss is None else f"{loss / dp_loss - 1:+.1%}"
    sent = sum(m.get("outer_bytes_sent", 0) for m in metrics)
    peak = max(m.get("outer_peak_bytes", 0) for m in metrics)
    hidden = sum(m.get("outer_comm_hidden_seconds", 0) for m in metrics)
    comm = sum(m.get("outer_comm_seconds", 0) for m in metrics)
    note = f", {hidden:.2f} of {comm:.2f} s comm hidden" if mode == "delayed" else ""
    print(
        f"| DiLoCo 2x{cli.island_ranks}, H={h}, {mode}, {codec}, F={fragments}{note} | "
        f"{outer_lr} | {loss:.4f} | {versus} | {sent / 1e6:.3f} MB | "
        f"1/{dp_bytes / max(sent, 1):.0f} | {sent / (cli.steps // int(h)) / 1e6:.3f} MB | "
        f"{peak / 1e6:.3f} MB |",
        flush=True,
    )

if __name__ == "__main__":
    main()
