"""--gradient_checkpointing's saving and cost: the peak memory and time of a training step with
every layer recomputed in the backward against the same step keeping every layer's activations,
side by side, beside the dry run's estimate of each.

    python benchmarks/gradient_checkpointing.py   (CPU: about 11 minutes)

BDH with n_layer 6, n_embd 256, n_head 4 and multiplier 64 (N = 4,096 per head, 12,713,984
parameters), fp32, batch 1 x T=2048, the attention form "auto" (chunked at this length),
dropout 0.1, torch's AdamW, 2 threads. Memory: each setting in a process of its own takes
one step; "step peak" is the highest resident memory above what the process held before it
(the activations, the gradients and AdamW's moments, the backward's working room), "process
peak" the whole process's. Time: one more process times the two settings on one model in turn,
--rounds steps of each after one of each that is not counted, so that a machine busy with other
work slows both alike. The estimate is dragon.run.memory's activations at this size (what
--dry_run prints)."""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MIB = 2**20
SIZE = dict(n_layer=6, n_embd=256, n_head=4, mlp_internal_dim_multiplier=64, dropout=0.1,
            vocab_size=256)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def built(checkpointing: bool, threads: int):
    """The model in training mode, its AdamW, and a batch of T ids."""
    import torch

    from dragon.model.bdh import BDHConfig, BDHForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = BDHForCausalLM(BDHConfig(**SIZE)).train()
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model, optimizer, ids) -> tuple[float, float]:
    """(seconds, loss) of forward, backward and the optimizer step."""
    start = time.perf_counter()
    loss = model(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # the gradients stay allocated, as in a run
    return time.perf_counter() - start, loss.item()


def batch(block: int):
    import torch

    return torch.randint(0, 256, (1, block), generator=torch.Generator().manual_seed(1))


def memory_worker(checkpointing: bool, block: int, threads: int) -> dict:
    """One setting's peaks over its first step: what the step adds to the process (activations,
    gradients, AdamW's moments, the backward's working room), and the process's whole peak."""
    model, optimizer = built(checkpointing, threads)
    ids = batch(block)
    before = resident_bytes()
    loss = train_step(model, optimizer, ids)[1]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"step_peak_mib": (peak - before) / MIB, "process_peak_mib": peak / MIB,
            "losses": [loss]}


def time_worker(block: int, threads: int, rounds: int) -> dict:
    """Seconds per step of both settings on one model, alternating (a busy machine slows both
    alike), after a step of each that is not counted."""
    model, optimizer = built(False, threads)
    ids = batch(block)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for i in range(rounds + 1):
        for on in (True, False):
            if on:
                model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                model.activation_checkpointing_disable()
            taken = train_step(model, optimizer, ids)[0]
            if i:
                seconds[on].append(taken)
    return {str(on): statistics.median(s) for on, s in seconds.items()}


def estimate_mib(checkpointing: bool, block: int) -> float:
    from dragon.model.bdh import BDHConfig
    from dragon.run.memory import saved_activations

    saved = saved_activations(BDHConfig(**SIZE), 1, block)
    return saved.held(recompute_every=int(checkpointing)) / MIB


def in_a_fresh_process(worker: str, args, *flags: str) -> dict:
    """A worker's figures, from a process of its own: neither setting inherits the other's peak."""
    cmd = [sys.executable, __file__, "--worker", worker, "--block", str(args.block), "--rounds",
           str(args.rounds), "--threads", str(args.threads), *flags]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, default=2048, help="positions T per step")
    parser.add_argument("--rounds", type=int, default=2, help="timed steps of each setting")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", choices=["memory", "time"], help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "memory":
        print(json.dumps(memory_worker(args.checkpointing, args.block, args.threads)))
        return
    if args.worker == "time":
        print(json.dumps(time_worker(args.block, args.threads, args.rounds)))
        return
    off, on = (in_a_fresh_process("memory", args, *flags) for flags in ([], ["--checkpointing"]))
    seconds = in_a_fresh_process("time", args)
    off["step_s"], on["step_s"] = seconds["False"], seconds["True"]
    off["estimate_mib"], on["estimate_mib"] = (estimate_mib(c, args.block) for c in (False, True))
    print(f"BDH {SIZE}, T={args.block}, batch 1, fp32, {args.threads} threads")
    print("| | layers' activations kept | every layer recomputed | recomputed / kept |")
    print("|---|---|---|---|")
    for name, key, unit in (("step peak (above the process before it)", "step_peak_mib", "MiB"),
                            ("process peak", "process_peak_mib", "MiB"),
                            ("dry-run estimate of activations", "estimate_mib", "MiB"),
                            (f"s/step (median of {args.rounds}, alternating)", "step_s", "s")):
        fmt = ",.0f" if unit == "MiB" else ".1f"
        print(f"| {name} | {off[key]:{fmt}} {unit} | {on[key]:{fmt}} {unit} | "
              f"{on[key] / off[key]:.2f}x |")
    same = max(abs(a - b) for a, b in zip(off["losses"], on["losses"]))
    print(f"largest difference between the two settings' losses: {same:.1e}")


if __name__ == "__main__":
    main()
