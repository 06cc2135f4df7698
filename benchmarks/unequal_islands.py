"""Islands of unequal speed: how much of its own speed the fast island keeps, with every island
training every step (the default) and with --diloco_island_steps auto.

    python benchmarks/unequal_islands.py [--steps 300] [--inner_steps 10] [--quota 0.5]
        (as root, cgroup v1's cpu controller; CPU: ~6 minutes)

Two islands of one rank each, each a launch of its own, the model and data of
benchmarks/diloco.py. Island 0 runs on core 0; island 1 on core 1 in a cgroup whose
cpu.cfs_quota_us holds it to --quota of that core (a slower site). The baseline is island 0 as
a one-island DiLoCo on core 0 with nothing beside it, and island 1 alone the same way in its
cgroup. Prints, per run, island 0's seconds per step after the first window and their ratio to
the baseline's (the speed it keeps), the steps island 1 trained per window, the global rate (the
steps both islands trained a second) against the sum of the two islands' rates alone, island 0's
weight in the outer average, the final validation loss (island 0's weights after the last outer
step, the same on both islands), and island 0's wall seconds from the end of the second window
to the last step. A last row runs `auto` for as many steps as train the default's tokens (its
quality at equal tokens; the default is equal islands' arithmetic, which the throttle does not
change).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from diloco import MODEL
from recipe_runs import REPO

ENV = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
CGROUP = Path("/sys/fs/cgroup/cpu")


def records(out: Path, island: int, islands: int) -> list[dict]:
    path = out / (f"island{island}" if islands > 1 else "") / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def launch(out: Path, island: int, islands: int, core: int, args: list[str],
           group: Path = None) -> subprocess.Popen:
    """One island on `core` (in cgroup `group`: the shell joins it before torchrun starts)."""
    cmd = ["taskset", "-c", str(core), "torchrun", "--nproc_per_node", "1",
           "--master_port", str(29810 + island), "recipes/pretrain.py", "--output_dir", str(out),
           "--diloco_islands", str(islands), *args]
    if islands > 1:
        cmd += ["--diloco_island_index", str(island), "--diloco_store", "127.0.0.1:29800"]
    if group is not None:
        cmd = ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *cmd]
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def run(out: Path, args: list[str], islands: int, group: Path, core: int = 0
        ) -> list[list[dict]]:
    """The islands (one: on `core`, in `group` when that is core 1)."""
    procs = [launch(out, i, islands, i + core, args, group if i + core == 1 else None)
             for i in range(islands)]
    for proc in procs:
        if proc.wait() != 0:
            sys.exit(f"an island failed: {proc.stderr.read()[-2000:]}")
    return [records(out, i, islands) for i in range(islands)]


def seconds_per_step(metrics: list[dict], after: int) -> float:
    """Wall seconds per step between the logged steps from `after` on."""
    timed = [(m["step"], m["time"]) for m in metrics if "time" in m and m["step"] >= after]
    (s0, t0), (s1, t1) = timed[0], timed[-1]
    return (t1 - t0) / (s1 - s0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--inner_steps", type=int, default=10)
    parser.add_argument("--quota", type=float, default=0.5)
    cli = parser.parse_args()
    h = cli.inner_steps
    group = CGROUP / f"dragon_unequal_{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(int(cli.quota * 100000)))
        root = Path(tempfile.mkdtemp(prefix="unequal-"))
        def arguments(steps: int) -> list[str]:  # the warm-up stays that of --steps
            return [*MODEL, "--max_steps", str(steps), "--eval_steps", str(steps),
                    "--save_steps", str(steps), "--warmup_steps", str(cli.steps // 5),
                    "--diloco_inner_steps", str(h), "--logging_steps", str(h)]

        args, auto = arguments(cli.steps), ["--diloco_island_steps", "auto"]
        alone = run(root / "alone", args, 1, group)[0]
        slow_alone = run(root / "slow_alone", args, 1, group, core=1)[0]
        rows = {"every island every step": run(root / "equal", args, 2, group),
                "--diloco_island_steps auto": run(root / "auto", [*args, *auto], 2, group)}
        share = island_steps(rows["--diloco_island_steps auto"][1], h) / h
        longer = round(2 * cli.steps / (1 + share) / h) * h  # the default's tokens
        rows[f"auto, {longer} steps (equal tokens)"] = run(
            root / "auto_long", [*arguments(longer), *auto], 2, group)
    finally:
        group.rmdir()
    base, slow_base = seconds_per_step(alone, 2 * h), seconds_per_step(slow_alone, 2 * h)
    print(f"{cli.steps} steps, H={h}, island 1 held to {cli.quota:.0%} of its core; alone, "
          f"island 0: {base:.4f} s a step, island 1: {slow_base:.4f}\n")
    print("| run | island 0, s a step | speed it keeps | island 1's steps a window | global "
          "rate / sum alone | island 0's weight | val loss | wall s (island 0, after the first "
          "window) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (fast, slow) in rows.items():
        per_step = seconds_per_step(fast, 2 * h)
        steps = island_steps(slow, h)
        both = (1 + steps / h) / per_step / (1 / base + 1 / slow_base)
        weights = [m["outer_weight"] for m in fast if "outer_weight" in m and m["step"] > h]
        weight = f"{statistics.mean(weights):.2f}" if weights else "0.50"
        loss = [m["eval_loss"] for m in fast if "eval_loss" in m][-1]
        ends = [m["step"] for m in fast if "time" in m][-1]
        print(f"| {name} | {per_step:.4f} | {base / per_step:.2f} | {steps:.1f} | {both:.2f} | "
              f"{weight} | {loss:.4f} | {per_step * (ends - 2 * h):.1f} |")


def island_steps(metrics: list[dict], h: int) -> float:
    """The mean steps an island trained per window after the first."""
    windows = [m for m in metrics if "outer_step" in m and m["step"] > h]
    return statistics.mean(m.get("island_steps", h) for m in windows)


if __name__ == "__main__":
    main()
