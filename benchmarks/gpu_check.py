"""The GPU acceptance check: each named config (recipes/configs/) for about 30 steps on the GPUs
present, in bf16, through its own recipe. It prints tokens/s, MFU against the bf16 dense peak,
peak memory against the dry run's estimate, and the time the config's whole plan takes at that
speed on the devices its header names.

    python benchmarks/gpu_check.py                      # the GPUs here: a few minutes
    python benchmarks/gpu_check.py --device cpu --small # checks the script on a CPU (CI)

A config whose layout needs more devices than are here runs one device's share of it: its
neuron share (N/K neurons per head, K = 1), one pipeline stage's layers in the ZeRO recipe, one
island, data parallel over the devices here. The data is the built-in corpus (the configs'
hub data needs the network); every run is its own run directory under a temporary one.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipe_runs import REPO, run_recipe  # noqa: E402

HUB = ("dataset_name", "dataset_config_name", "streaming")
SMALL = dict(n_layer=2, n_embd=32, n_head=2, mlp_internal_dim_multiplier=8, block_size=64,
             per_device_train_batch_size=2, gradient_accumulation_steps=2, bf16=False)


def shrunk(config: Path, devices: int, small: bool) -> tuple[str, dict, list[str], int]:
    """(recipe, the config's values for a run here, what was changed, processes)."""
    header = config.read_text()
    values = yaml.safe_load(header)
    world = int(re.search(r"WORLD_SIZE=(\d+)", header).group(1))  # one island's, or the run's
    recipe = re.search(r"(recipes/pretrain\w*\.py)", header).group(1)
    changed = ["the built-in corpus"] if any([values.pop(k, None) for k in HUB]) else []
    islands = values.get("diloco_islands", 1)
    for key in [k for k in values if k.startswith("diloco_")]:
        values.pop(key)
    if islands > 1:
        changed.append(f"one island of {islands}")
    if world > devices:  # one device's share of the layout
        k = values.get("neuron_parallel", 1)
        if k > 1:  # one share: N/K neurons of every head
            values["mlp_internal_dim_multiplier"] //= k
            values["neuron_parallel"] = 1
            changed.append(f"one neuron share of {k} (multiplier / {k})")
        if recipe.endswith("pipeline.py"):  # one stage's layers, in the ZeRO recipe
            stages = values.pop("pipeline_stages", 2)
            values["n_layer"] //= stages
            recipe, values["deepspeed"] = "recipes/pretrain.py", "ds_configs/zero1.json"
            changed.append(f"one stage of {stages} ({values['n_layer']} layers, ZeRO-1)")
        changed.append(f"data parallel over {devices}")
    if small:
        values.update(SMALL)
        changed.append("--small")
    return recipe, values, changed, min(world, devices)


def measure(config: Path, devices: int, small: bool, steps: int, root: Path, cuda: bool
            ) -> dict:
    recipe, values, changed, procs = shrunk(config, devices, small)
    values.pop("output_dir", None)  # each run writes under the temporary directory
    values.update(max_steps=steps, logging_steps=1, eval_steps=10**6, save_steps=10**6,
                  sample_max_new_tokens=0, disable_tqdm=True, max_data_epochs=1e9)
    flags = [w for key, value in values.items() for w in (f"--{key}", str(value))]
    out = root / config.stem
    plan = subprocess.run([sys.executable, recipe, *flags, "--output_dir", str(root / "plan"),
                           "--dry_run"], cwd=REPO, capture_output=True,
                          text=True, env=dict(os.environ, WORLD_SIZE=str(procs), RANK="0",
                                              LOCAL_RANK="0"))
    estimate = re.search(r"^  total: ([\d,.]+) MiB$", plan.stdout, re.M)
    records = run_recipe(out, procs, flags, script=recipe,
                         env={"DS_ACCELERATOR": "cuda"} if cuda else None)
    late = [r for r in records if r["step"] > min(5, steps // 2)]
    tokens_per_s = statistics.median(r["tokens_per_second"] for r in late)
    return {"config": config.stem, "devices": procs, "changed": ", ".join(changed) or "as it is",
            "tokens_per_s": tokens_per_s, "mfu": statistics.median(r["mfu"] for r in late),
            "peak_mib": max(r["memory_peak_mib"] for r in records),
            "estimate_mib": float(estimate.group(1).replace(",", "")) if estimate else None,
            "plan_hours": plan_hours(config, tokens_per_s / procs)}


def plan_hours(config: Path, per_device: float) -> float:
    """The config's whole plan (its max_steps x its tokens per step) on the devices its header
    names, each at `per_device` tokens/s."""
    header = config.read_text()
    values = yaml.safe_load(header)
    tokens = int(re.search(r"# Tokens per step: ([\d,]+)", header).group(1).replace(",", ""))
    world = int(re.search(r"WORLD_SIZE=(\d+)", header).group(1))
    world *= values.get("diloco_islands", 1)
    return values["max_steps"] * tokens / (per_device * world) / 3600


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="tiny sizes: checks the script")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--configs", nargs="*", help="config names (default: every GPU config)")
    parser.add_argument("--json", help="also write the rows to this file")
    opts = parser.parse_args()
    import torch

    devices = torch.cuda.device_count() if opts.device == "cuda" else 1
    if devices < 1:
        sys.exit("error: --device cuda: no GPU here; use --device cpu --small to check the script")
    configs = sorted((REPO / "recipes" / "configs").glob("*.yaml"))
    configs = [c for c in configs if c.stem != "quickstart_cpu"
               and (not opts.configs or c.stem in opts.configs)]
    root = Path(tempfile.mkdtemp(prefix="dragon_gpu_check_"))
    rows = []
    try:
        print("| config | devices | run as | tokens/s | MFU | peak memory / estimate | "
              "whole plan at this speed |")
        print("|---|---|---|---|---|---|---|")
        for config in configs:
            row = measure(config, devices, opts.small, opts.steps, root, opts.device == "cuda")
            rows.append(row)
            ratio = (f"{row['peak_mib']:,.0f} / {row['estimate_mib']:,.0f} MiB "
                     f"({row['peak_mib'] / row['estimate_mib']:.2f})" if row["estimate_mib"]
                     else f"{row['peak_mib']:,.0f} MiB / none")
            print(f"| {row['config']} | {row['devices']} | {row['changed']} | "
                  f"{row['tokens_per_s']:,.0f} | {row['mfu']:.3f} | {ratio} | "
                  f"{row['plan_hours']:,.1f} h |", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
