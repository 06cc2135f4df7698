"""Training over a slow link: two nodes (network namespaces, tests/netns.py) joined by a veth
pair shaped with tbf, one rank per node. The ZeRO-2 recipe as one data-parallel job across both
nodes (the deepspeed launcher, --no_ssh, a launch per node) against two DiLoCo islands (one per
node, a torchrun launch each, H inner steps, sync or delayed; fp32, bf16, int8 or int4
pseudo-gradients, the whole model or 4 fragments in turn, landing with --diloco_fragment_delay
auto in delayed mode), on the same model, data and global batch (2 x micro-batch 4 x 256
tokens).

    flock /tmp/dragon-cpu.lock python benchmarks/wan.py [--rates none,100mbit,50mbit,10mbit]
        [--configs dp,dp-1node,diloco-int4,...] [--steps 40] [--dp_shaped_steps 10]

Needs root. Prints, per config and rate, global training tokens/s (tokens of steps 2..N over
the time between step 1's record and step N's; the run goes on to step N + 1, whose record
also holds the final evaluation and checkpoint, so start-up and the end are left out and
DiLoCo's outer steps at H and 2H are inside), the fraction of the config's own unshaped figure, and
the bytes each node sent per step (its interface's tx_bytes over the whole launch / steps), and in
delayed mode the inner steps from an exchange's start to its landing and the seconds island 0's
training thread waited for exchanges (outer_wait_seconds, steps 1..N), and whether the window's
bytes fit in the window's compute time at the link rate the run measured (its one-line warning
when they do not: the seconds the exchange needs against the window's).
Data parallel on a shaped link runs --dp_shaped_steps steps: every step costs the same there
(the gradient exchange dominates), and 40 steps at 10 Mbit/s would take ~10 minutes.
"""

import argparse
import json
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from netns import Cluster, wait_all  # noqa: E402

MODEL = ("--n_layer 2 --n_embd 256 --n_head 4 --mlp_internal_dim_multiplier 16 --block_size 256"
         " --per_device_train_batch_size 4 --learning_rate 1e-3 --warmup_steps 4 --dropout 0.0"
         " --logging_steps 1 --eval_steps 100000 --save_steps 100000 --sample_max_new_tokens 0"
         " --disable_tqdm").split()
TOKENS_PER_STEP = 2 * 4 * 256  # global: 2 nodes (ranks or islands) x micro-batch x block
# config -> (--diloco_compress, --diloco_mode, --diloco_fragments); None: data parallel across
# the two nodes, and "dp-1node" the same job as 2 ranks on node 0 alone (what two nodes are
# compared with)
CONFIGS = {"dp": None, "dp-1node": None, "diloco-fp32": ("none", "sync", 1),
           "diloco-bf16": ("bf16", "sync", 1), "diloco-int8": ("int8", "sync", 1),
           "diloco-int4": ("int4", "sync", 1), "diloco-fp32-delayed": ("none", "delayed", 1),
           "diloco-int8-delayed": ("int8", "delayed", 1),
           "diloco-int4-delayed": ("int4", "delayed", 1), "diloco-int4-f4": ("int4", "sync", 4),
           "diloco-int4-f4-delayed": ("int4", "delayed", 4)}  # delayed F=4: delay auto


def corpus(root: Path) -> Path:
    """~400 KB of the standard library (tests' corpus): packs in a second, enough for 40 steps."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = ("argparse.py", "dataclasses.py", "functools.py", "typing.py")
    path = root / "corpus.txt"
    path.write_text("\n".join((stdlib / n).read_text() for n in names))
    return path


def env(cluster: Cluster, node: int) -> dict:
    base = cluster.env(node, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
                       HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        base.pop(key, None)
    return base


def commands(config: str, cluster: Cluster, out: Path, data: Path, steps: int, h: int
             ) -> list[list]:
    # one step more than measured: the last step's record also holds the run's final evaluation
    # and checkpoint (~9 s here), which are no part of training speed
    args = ["--output_dir", out, "--train_file", data, "--max_steps", steps + 1, *MODEL]
    recipe = REPO / "recipes/pretrain.py"
    if config == "dp-1node":  # node 1 idles
        return [["torchrun", "--nproc_per_node", 2, "--master_port", 29500, recipe,
                 "--deepspeed", REPO / "ds_configs/zero2.json", *args], ["true"]]
    if CONFIGS[config] is None:  # one job over both nodes
        hostfile = out.parent / "hostfile"
        hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
        return [["deepspeed", "--hostfile", hostfile, "--no_ssh", "--node_rank", node,
                 "--master_addr", cluster.address(0), "--master_port", 29500, recipe,
                 "--deepspeed", REPO / "ds_configs/zero2.json", *args] for node in (0, 1)]
    diloco = ["--deepspeed", REPO / "ds_configs/zero2.json", "--diloco_islands", 2,
              "--diloco_inner_steps", h, "--diloco_compress", CONFIGS[config][0],
              "--diloco_mode", CONFIGS[config][1], "--diloco_fragments", CONFIGS[config][2],
              "--diloco_store", f"{cluster.address(0)}:29600"]
    return [["torchrun", "--nproc_per_node", 1, "--master_port", 29500, recipe, *args, *diloco,
             "--diloco_island_index", node] for node in (0, 1)]


def measure(config: str, rate: str | None, root: Path, data: Path, steps: int, h: int) -> dict:
    out = root / f"{config}-{rate or 'none'}" / "run"
    out.parent.mkdir(parents=True)
    with Cluster(2, rate=rate) as cluster:
        cmds = commands(config, cluster, out, data, steps, h)
        sent = [cluster.tx_bytes(node) for node in (0, 1)]
        procs = []
        for node, cmd in enumerate(cmds):
            with open(out.parent / f"node{node}.log", "w") as log:
                procs.append(cluster.popen(node, cmd, cwd=REPO, env=env(cluster, node),
                                           stdout=log, stderr=subprocess.STDOUT))
        start = time.monotonic()
        codes = wait_all(procs, 3600)
        wall = time.monotonic() - start
        sent = [cluster.tx_bytes(node) - sent[node] for node in (0, 1)]
    for node, code in enumerate(codes):
        if code:
            log = (out.parent / f"node{node}.log").read_text()[-3000:]
            sys.exit(f"{config} at {rate}: node {node} exited {code}\n{log}")
    path = out / "metrics.jsonl"
    if not path.exists():
        path = out / "island0" / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    times = {m["step"]: m["time"] for m in records if "loss" in m}
    span = times[steps] - times[1]
    return dict(config=config, rate=rate or "unshaped", steps=steps, wall=wall,
                tokens_per_s=TOKENS_PER_STEP * (steps - 1) / span,
                mb_per_step=[s / (steps + 1) / 1e6 for s in sent],
                loss=[m["loss"] for m in records if "loss" in m][-1],
                landing=landing(config, records, steps, h), fits=fits(out.parent),
                waited=sum(m.get("outer_wait_seconds", 0.0) for m in records
                           if m["step"] <= steps))


def landing(config: str, records: list[dict], steps: int, h: int) -> str:
    """Inner steps from an exchange's start to its landing, up to step `steps`: fragments'
    outer_landed_after (mean, range); whole-model delayed mode applies it H steps later."""
    if CONFIGS.get(config) is None or CONFIGS[config][1] != "delayed":
        return "-"
    if CONFIGS[config][2] == 1:
        return f"{h} (next outer step)"
    after = [m["outer_landed_after"] for m in records
             if "outer_landed_after" in m and m["step"] <= steps]
    return f"{sum(after) / len(after):.1f} ({min(after)}-{max(after)})" if after else "-"


def fits(logs: Path) -> str:
    """"yes", or the seconds a window's exchange needs against the window's from the run's
    one-line warning that the link is slower than the window."""
    for log in sorted(logs.glob("node*.log")):
        text = log.read_text()
        if "the link is slower than the window" not in text:
            continue
        found = re.search(r"take ([\d.]+) s, the window's \d+ inner steps ([\d.]+) s", text)
        return f"no ({found[1]} s of {found[2]} s)" if found else "no"
    return "yes"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="none,100mbit,50mbit,10mbit")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dp_shaped_steps", type=int, default=10)
    parser.add_argument("--inner_steps", type=int, default=20)
    cli = parser.parse_args()
    rates = [None if r == "none" else r for r in cli.rates.split(",")]
    root = Path(tempfile.mkdtemp(prefix="wan-"))
    data = corpus(root)
    print("| config | link | steps | global tokens/s | of unshaped | landing after (steps) | "
          "waited s | window's bytes fit | MB sent per step (node 0 / node 1) | last loss | "
          "wall s |\n|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for config in cli.configs.split(","):
        base = None
        for rate in rates:
            steps = cli.dp_shaped_steps if config == "dp" and rate else cli.steps
            r = measure(config, rate, root, data, steps, cli.inner_steps)
            base = r["tokens_per_s"] if rate is None else base
            frac = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
            print(f"| {config} | {r['rate']} | {steps} | {r['tokens_per_s']:,.0f} | {frac} | "
                  f"{r['landing']} | {r['waited']:.1f} | {r['fits']} | "
                  f"{r['mb_per_step'][0]:.2f} / {r['mb_per_step'][1]:.2f} | {r['loss']:.4f} | "
                  f"{r['wall']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
