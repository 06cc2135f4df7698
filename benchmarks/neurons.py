"""Neuron parallelism per rank, side by side: K = 1, 2, 4 ranks split a BDH with a large N.

    python benchmarks/neurons.py [--lengths 512,2048] [--ks 1,2,4] [--layers 2]   (CPU: ~6 min)

K processes (one thread each) join a real gloo group; each builds the same model (n_embd 256,
4 heads, multiplier 64: N = 4096 neurons per head), keeps its share of the neurons
(dragon.parallel.neurons.split_neurons) and trains a micro-batch of one sequence of T tokens
with AdamW. Per rank it reports:
- the bytes of the N-wide weights with their gradients and Adam moments (4 + 4 + 8 a value);
- the activations autograd keeps for backward, counted tensor by tensor (saved_tensors_hooks)
  during the first step's forward;
- the process's peak resident memory over the first step (VmHWM, reset before it), above what
  it held before it;
- the bytes it wrote to the wire in a step (/proc/self/io: the all-reduces of the layers);
- tokens/s over the timed steps (the slowest rank; K ranks share the machine's two cores).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CONFIG = dict(n_embd=256, n_head=4, mlp_internal_dim_multiplier=64, vocab_size=256)


def written() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar")).split()[1])


def resident() -> int:
    """Resident bytes now; and the peak since here starts afresh (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_resident() -> int:
    """The peak resident bytes since resident() (VmHWM)."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM")).split()[1]) * 1024


def rank_run(rank: int, k: int, port: int, T: int, layers: int, steps: int, out: str) -> None:
    import torch.distributed as dist

    from dragon.model.bdh import BDHConfig, BDHForCausalLM
    from dragon.parallel.neurons import SHARDED, split_neurons

    torch.set_num_threads(1)
    if k > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=k, timeout=timedelta(seconds=600))
    torch.manual_seed(0)
    model = BDHForCausalLM(BDHConfig(n_layer=layers, **CONFIG))
    if k > 1:
        split_neurons(model, dist.group.WORLD, rank, k)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = dict(model.named_parameters())
    wide = sum(params[name].numel() for name in SHARDED) * (4 + 4 + 8)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, T), generator=torch.Generator().manual_seed(1))
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        saved[id(base)] = base.numel() * base.element_size()
        return t

    before, wire = resident(), written()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    peak = peak_resident() - before
    wire = written() - wire
    if k > 1:
        dist.barrier()
    began = time.perf_counter()
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    seconds = (time.perf_counter() - began) / steps
    torch.save({"wide": wide, "activations": sum(saved.values()), "peak": peak, "wire": wire,
                "seconds": seconds}, out)
    if k > 1:
        dist.barrier()
        dist.destroy_process_group()


def measure(k: int, T: int, layers: int, steps: int) -> dict:
    """The ranks' figures: the largest of each (time: the slowest rank's)."""
    with tempfile.TemporaryDirectory() as tmp:
        port = 29000 + os.getpid() % 1000
        outs = [os.path.join(tmp, f"{r}.pt") for r in range(k)]
        # Large blocks are mapped and unmapped, never kept in the heap: resident memory then
        # follows the live tensors (glibc's adaptive threshold would keep freed blocks resident).
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
                   MALLOC_MMAP_THRESHOLD_="65536")
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--k", str(k),
                                   "--port", str(port), "--T", str(T), "--layers", str(layers),
                                   "--steps", str(steps), "--out", outs[r]], env=env)
                 for r in range(k)]
        if any(p.wait() for p in procs):
            sys.exit(f"K={k}, T={T}: a rank failed")
        rows = [torch.load(o) for o in outs]
    return {key: max(r[key] for r in rows) for key in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--ks", default="1,2,4")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--k", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--T", type=int)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.rank is not None:
        return rank_run(args.rank, args.k, args.port, args.T, args.layers, args.steps, args.out)
    mib = 2**20
    print("| T | K | N-wide weights + grads + Adam per rank | saved activations per rank | "
          "peak memory growth per rank | bytes sent per rank per step | tokens/s |")
    print("|---" * 7 + "|")
    for T in [int(t) for t in args.lengths.split(",")]:
        base = None
        for k in [int(k) for k in args.ks.split(",")]:
            r = measure(k, T, args.layers, args.steps)
            base = base or r
            ratio = lambda key: f"{r[key] / mib:,.0f} MiB ({r[key] / base[key]:.2f}x)"  # noqa: E731
            speed, base_speed = T / r["seconds"], T / base["seconds"]
            print(f"| {T} | {k} | {ratio('wide')} | {ratio('activations')} | {ratio('peak')} | "
                  f"{r['wire'] / mib:,.1f} MiB | {speed:,.0f} ({speed / base_speed:.2f}x) |",
                  flush=True)


if __name__ == "__main__":
    main()
