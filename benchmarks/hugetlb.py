"""glibc's transparent huge pages for malloc (GLIBC_TUNABLES=glibc.malloc.hugetlb=1) on CPU: the
same jobs with and without the setting, alternating, side by side.

    python benchmarks/hugetlb.py [--rounds 2]   (CPU: about 12 minutes)

Two jobs, each run --rounds times with the setting and as many without, in turn, so that a
machine busy with other work slows both alike:
- "quickstart": README command 1's training (recipes/pretrain.py, ZeRO-2 on 2 processes, the
  229k-parameter BDH, micro-batch 16 x 128 tokens) for 100 steps; wall seconds of the launch.
- "large step": one process, BDH n_layer 6, n_embd 256, n_head 4, multiplier 64 (N = 4,096 per
  head), T=2048 (chunked), torch's AdamW, 2 threads: 3 training steps after one not counted;
  seconds a step.
Each row gives the median and the minor page faults of the job's processes (getrusage of the
children).
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETTING = "glibc.malloc.hugetlb=1"
QUICKSTART = ("--deepspeed ds_configs/zero2.json --max_steps 100 --n_layer 2 --n_embd 64 "
              "--n_head 2 --mlp_internal_dim_multiplier 16 --block_size 128 "
              "--per_device_train_batch_size 16 --learning_rate 3e-3 --warmup_steps 10 "
              "--eval_steps 100 --save_steps 100 --sample_max_new_tokens 0 --disable_tqdm")
LARGE_STEP = """
import time, torch
from dragon.model.bdh import BDHConfig, BDHForCausalLM
torch.set_num_threads(2)
torch.manual_seed(0)
model = BDHForCausalLM(BDHConfig(n_layer=6, n_embd=256, n_head=4, mlp_internal_dim_multiplier=64,
                                 vocab_size=256)).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 256, (1, 2048))
times = []
for i in range(4):
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - start)
print(sum(times[1:]) / 3)
"""


def run(job: str, huge: bool, out: Path) -> tuple[float, int]:
    """One run of `job`: (its seconds, the minor page faults of its processes)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("GLIBC_TUNABLES", None)
    if huge:
        env["GLIBC_TUNABLES"] = SETTING
    faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
    start = time.perf_counter()
    if job == "quickstart":
        subprocess.run(["torchrun", "--standalone", "--nproc_per_node", "2",
                        "recipes/pretrain.py", "--output_dir", str(out), *QUICKSTART.split()],
                       cwd=REPO, env=env, check=True, capture_output=True)
        seconds = time.perf_counter() - start
    else:
        env.pop("OMP_NUM_THREADS")
        done = subprocess.run([sys.executable, "-c", LARGE_STEP], cwd=REPO, env=env, check=True,
                              capture_output=True, text=True)
        seconds = float(done.stdout.split()[-1])
    return seconds, resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - faults


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    cli = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hugetlb-"))
    print("| job | setting | seconds (median) | minor page faults (median) |")
    print("|---|---|---|---|")
    for job in ("quickstart", "large step"):
        got = {False: [], True: []}
        for k in range(cli.rounds):
            for huge in (False, True):
                got[huge].append(run(job, huge, root / f"{job}-{huge}-{k}".replace(" ", "_")))
        for huge in (False, True):
            seconds = statistics.median(s for s, _ in got[huge])
            faults = statistics.median(f for _, f in got[huge])
            print(f"| {job} | {SETTING if huge else 'default'} | {seconds:.2f} | {faults:,.0f} |")
        ratio = (statistics.median(s for s, _ in got[True])
                 / statistics.median(s for s, _ in got[False]))
        print(f"| {job} | ratio | {ratio:.2f}x | |", flush=True)


if __name__ == "__main__":
    main()
