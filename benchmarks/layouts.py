"""One BDH on 8 ranks under four layouts: memory per rank (the dry run's estimate and the measured
peak), tokens/s and bytes per step; and the largest N per head each layout fits in 24 GiB.

    python benchmarks/layouts.py   (CPU, 8 ranks on this machine's cores: ~25 minutes)

The model: 4 heads x N = 8,192 neurons (n_embd 256, the reference's 25M parameters), 2 layers,
block 128, micro-batch 2, 3 steps, fp32. Measured peak: the run's memory_peak_mib (on CPU,
resident memory above what the process held before the model was built, the most of any rank).
Each layout runs twice: with glibc's mmap threshold fixed at 1 MiB (MALLOC_MMAP_THRESHOLD_), so
every large tensor is its own mapping, returned when freed, and resident memory counts what the
run holds, as an accelerator's allocator peak does (what the estimate models); and with glibc's
default, whose threshold rises to the size of a freed tensor (up to 32 MiB), after which such
tensors come from the heap, and the heap keeps freed memory resident.
Bytes per step are a model, per rank: a ring all-reduce of P bytes sends 2 (n - 1) / n P; ZeRO-2's
reduce-scatter and all-gather together send the same; the neuron split sends two all-reduces of
(B, T, D) per layer forward and two backward; a stage sends its (B, T, D) activations forward and
their gradient back, per micro-batch; DiLoCo islands send the data-parallel traffic of their own
ranks, plus their outer step's logged bytes once every H steps.
"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from recipe_runs import REPO, run_recipe

RANKS, GIB = 8, 2**30
BLOCK, MICRO, D, LAYERS, HEADS = 128, 2, 256, 2, 4
MODEL = (f"--n_layer {LAYERS} --n_embd {D} --n_head {HEADS} --block_size {BLOCK} "
         f"--per_device_train_batch_size {MICRO} --max_steps 3 --logging_steps 1 "
         "--eval_steps 100 --save_steps 100 --max_eval_samples 16 --per_device_eval_batch_size 1 "
         "--sample_max_new_tokens 0 "
         "--disable_tqdm --dropout 0").split()
H = 3
HOLDS = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}  # resident memory = what the run holds
PARAMETERS = 25_296_896  # the reference's BDH at these sizes (depth adds no parameters)
LAYOUTS = {  # name: (recipe, DeepSpeed JSON, flags, islands, stages, K)
    "8 x data parallel": ("pretrain.py", "zero2.json", [], 1, 1, 1),
    "K=2 x 4": ("pretrain.py", "zero2.json", ["--neuron_parallel", "2"], 1, 1, 2),
    "2 stages x K=2 x 2": ("pretrain_pipeline.py", "pipeline_zero1.json",
                           ["--pipeline_stages", "2", "--neuron_parallel", "2",
                            "--gradient_accumulation_steps", "2"], 1, 2, 2),
    "2 islands x K=2 x 2": ("pretrain.py", "zero2.json",
                            ["--neuron_parallel", "2", "--diloco_islands", "2",
                             "--diloco_inner_steps", str(H), "--save_steps", str(H)], 2, 1, 2),
}


def dry_run(recipe: str, args: list[str]) -> float:
    """The dry run's per-rank total, MiB."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO), WORLD_SIZE=str(RANKS),
               RANK="0", LOCAL_RANK="0")
    job = subprocess.run([sys.executable, f"recipes/{recipe}", *args, "--dry_run"], cwd=REPO,
                         env=env, capture_output=True, text=True)
    if job.returncode:
        raise SystemExit(f"{recipe} {' '.join(args)} --dry_run: {job.stderr.strip()[-500:]}")
    return float(re.search(r"total: ([\d,.]+) MiB", job.stdout).group(1).replace(",", ""))


def modelled_bytes(layout: tuple, parameters: int, records: list[dict]) -> float:
    """Bytes one rank sends per step (the model in the docstring)."""
    _, _, flags, islands, stages, k = layout
    dp = RANKS // (islands * stages * k)
    accum = 2 if stages > 1 else 1
    ring = lambda n, size: 2 * (n - 1) / n * size  # noqa: E731
    held = 4 * parameters / k / stages  # this rank's share of the weights, fp32
    sent = ring(dp, held)
    activations = 4 * MICRO * BLOCK * D
    sent += accum * LAYERS / stages * 4 * ring(k, activations)
    if stages > 1:
        sent += accum * 2 * activations
    outer = [m["outer_bytes_sent"] for m in records if "outer_bytes_sent" in m]
    return sent + (outer[0] / H if outer else 0)


def largest_neurons(recipe: str, args: list[str], root: Path) -> int:
    """The largest N per head (a multiple of 1,024) whose estimate fits in 24 GiB per rank."""
    def fits(n: int) -> bool:
        mult = n * HEADS // D
        return dry_run(recipe, [*args, "--mlp_internal_dim_multiplier", str(mult),
                                "--output_dir", str(root / f"fit{n}")]) * 2**20 <= 24 * GIB
    low, high = 1024, 2048
    while fits(high):
        low, high = high, high * 2
    while high - low > 1024:
        middle = (low + high) // 2048 * 1024
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="layouts-"))
    print("| layout | estimate | measured peak | estimate / measured | measured peak, glibc's "
          "default | tokens/s | bytes sent per step per rank (model) | largest N per head in "
          "24 GiB (estimate) |")
    print("|---|---|---|---|---|---|---|---|")
    for i, (name, layout) in enumerate(LAYOUTS.items()):
        recipe, config, flags = layout[:3]
        args = ["--deepspeed", f"ds_configs/{config}", *MODEL, *flags]
        guess = dry_run(recipe, [*args, "--mlp_internal_dim_multiplier", "128",
                                 "--output_dir", str(root / f"dry{i}")])
        run_args = [*args, "--mlp_internal_dim_multiplier", "128"]
        metrics_dir = "island0" if layout[3] > 1 else ""
        default = run_recipe(root / f"default{i}", RANKS, run_args, metrics_dir,
                             script=f"recipes/{recipe}")
        records = run_recipe(root / f"run{i}", RANKS, run_args, metrics_dir,
                             script=f"recipes/{recipe}", env=HOLDS)
        peak, glibc = (max(m["memory_peak_mib"] for m in rows if "memory_peak_mib" in m)
                       for rows in (records, default))
        speed = [m["tokens_per_second"] for m in records if "tokens_per_second" in m][-1]
        speed *= layout[3]  # each island logs its own tokens
        sent = modelled_bytes(layout, PARAMETERS, records)
        largest = largest_neurons(recipe, args, root / f"fit{i}")
        print(f"| {name} | {guess:,.0f} MiB | {peak:,.0f} MiB | {guess / peak:.2f} | "
              f"{glibc:,.0f} MiB | {speed:,.0f} | {sent / 2**20:,.1f} MiB | {largest:,} |",
              flush=True)


if __name__ == "__main__":
    main()
