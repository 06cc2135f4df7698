"""Elastic DiLoCo: an uninterrupted 2-island run against one whose island 1 dies at 1/3 of the
run and rejoins (--diloco_join, from its own last checkpoint) at 2/3, same arguments otherwise.

    python benchmarks/elastic.py [--steps 600] [--inner_steps 20] [--mode sync]   (CPU: ~8 min)

Islands of one rank each (ZeRO-1), launched separately around `python -m
dragon.diloco.island_store`,
the model and data of benchmarks/diloco.py. Prints island 0's validation loss at every
evaluation of both runs and the quorum of the outer steps in between.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from diloco import MODEL
from recipe_runs import REPO

ENV = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def records(out: Path, island: int) -> list[dict]:
    path = out / f"island{island}" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_step(out: Path, island: int) -> int:
    return max((m["step"] for m in records(out, island)), default=0)


def launch(out: Path, island: int, store: str, port: int, args: list[str]) -> subprocess.Popen:
    cmd = ["torchrun", "--nproc_per_node", "1", "--master_port", str(port), "recipes/pretrain.py"]
    cmd += ["--output_dir", str(out), "--diloco_island_index", str(island), *args]
    cmd += ["--diloco_store", store, "--diloco_store_external"]
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def wait_for(proc: subprocess.Popen, out: Path, island: int, step: int) -> None:
    while last_step(out, island) < step:
        if proc.poll() is not None:
            sys.exit(f"island {island} ended early: {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)


def run(out: Path, store: str, args: list[str], steps: int, interrupted: bool) -> None:
    islands = [launch(out, i, store, 29610 + i, args) for i in (0, 1)]
    if interrupted:
        wait_for(islands[1], out, 1, steps // 3)
        # the rank and its launcher, as a lost machine
        subprocess.run(["pkill", "-9", "-f", f"{out} --diloco_island_index 1"], check=False)
        islands[1].wait()
        wait_for(islands[0], out, 0, 2 * steps // 3)
        rejoin = ["--diloco_join", "--resume_from_checkpoint", "latest"]
        islands[1] = launch(out, 1, store, 29612, [*args, *rejoin])
    for proc in islands:
        if proc.wait() != 0:
            sys.exit(f"an island failed: {proc.stderr.read()[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--inner_steps", type=int, default=20)
    parser.add_argument("--eval_every", type=int, default=60)
    parser.add_argument("--mode", default="sync", choices=["sync", "delayed"])
    cli = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="elastic-"))
    store = subprocess.Popen([sys.executable, "-m", "dragon.diloco.island_store",
                              "--port", "29600"],
                             cwd=REPO, env=ENV, stdout=subprocess.PIPE, text=True)
    assert "listening" in store.stdout.readline()
    args = [*MODEL, "--max_steps", str(cli.steps), "--eval_steps", str(cli.eval_every)]
    args += ["--save_steps", str(cli.eval_every), "--warmup_steps", str(cli.steps // 5)]
    args += ["--diloco_islands", "2", "--diloco_inner_steps", str(cli.inner_steps)]
    args += ["--diloco_mode", cli.mode, "--diloco_elastic", "--diloco_quorum_timeout", "10"]
    args += ["--diloco_outer_lr", "1", "--diloco_outer_momentum", "0.3"]  # delayed's best
    try:
        # the store's keys are per outer step: each run has islands of its own indices
        run(root / "uninterrupted", "127.0.0.1:29600", args, cli.steps, False)
        store.send_signal(signal.SIGTERM)
        store.wait()
        store = subprocess.Popen([sys.executable, "-m", "dragon.diloco.island_store",
                                  "--port", "29601"],
                                 cwd=REPO, env=ENV, stdout=subprocess.PIPE, text=True)
        assert "listening" in store.stdout.readline()
        run(root / "elastic", "127.0.0.1:29601", args, cli.steps, True)
    finally:
        store.send_signal(signal.SIGTERM)
    base, elastic = records(root / "uninterrupted", 0), records(root / "elastic", 0)
    print(f"{cli.steps} steps, H={cli.inner_steps}, {cli.mode}; island 1 killed at step "
          f"{cli.steps // 3}, rejoined from its last checkpoint once island 0 passed step "
          f"{2 * cli.steps // 3}\n")
    print("| step | val loss, uninterrupted | val loss, die and rejoin | gap | quorum since last |")
    print("|---|---|---|---|---|")
    evals = {m["step"]: m["eval_loss"] for m in base if "eval_loss" in m}
    previous = 0
    for m in (m for m in elastic if "eval_loss" in m):
        quorum = sorted({q["outer_quorum"] for q in elastic
                         if "outer_quorum" in q and previous < q["step"] <= m["step"]})
        a, b = evals[m["step"]], m["eval_loss"]
        print(f"| {m['step']} | {a:.4f} | {b:.4f} | {b / a - 1:+.2%} | "
              f"{'/'.join(map(str, quorum))} |")
        previous = m["step"]


if __name__ == "__main__":
    main()
