"""--dry_run's per-rank memory estimate against the peak a real 3-step run measures, side by side.

    python benchmarks/memory.py   (CPU: ~3 minutes)

A 3.3M-parameter BDH (n_embd 256, 4 heads, N = 1,024 per head, 2 layers) at block 256, micro
batch 8, the built-in corpus. The measured peak is the run's memory_peak_mib: on CPU, resident
memory above what the process held before the model was built (DeepSpeed's own buffers count).
"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from recipe_runs import REPO, run_recipe

MODEL = (
    "--n_layer 2 --n_embd 256 --n_head 4 --mlp_internal_dim_multiplier 16 --block_size 256 "
    "--per_device_train_batch_size 8 --max_steps 3 --logging_steps 1 --eval_steps 100 "
    "--save_steps 100 --max_eval_samples 16 --sample_max_new_tokens 0 --disable_tqdm"
).split()
ROWS = [("zero0.json", 1, []), ("zero2.json", 1, []), ("zero2.json", 2, []),
        ("zero3.json", 2, []), ("zero0.json", 1, ["--bf16"]), ("zero1.json", 2, ["--bf16"]),
        ("zero2.json", 2, ["--bf16"]), ("zero3.json", 2, ["--bf16"])]


def estimate(args: list[str], ranks: int) -> float:
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO), WORLD_SIZE=str(ranks))
    out = subprocess.run([sys.executable, "recipes/pretrain.py", *args, "--dry_run"], cwd=REPO,
                         env=env, capture_output=True, text=True, check=True).stdout
    return float(re.search(r"total: ([\d,.]+) MiB", out).group(1).replace(",", ""))


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="memory-"))
    print("| config | ranks | estimate | measured peak | estimate / measured |")
    print("|---|---|---|---|---|")
    for i, (config, ranks, extra) in enumerate(ROWS):
        args = ["--deepspeed", f"ds_configs/{config}", *MODEL, *extra]
        guess = estimate([*args, "--output_dir", str(root / f"dry{i}")], ranks)
        records = run_recipe(root / f"run{i}", ranks, args)
        peak = max(m["memory_peak_mib"] for m in records if "memory_peak_mib" in m)
        name = f"{config[:-5]}{' bf16' if extra else ''}"
        print(f"| {name} | {ranks} | {guess:,.0f} MiB | {peak:,.0f} MiB | {guess / peak:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
