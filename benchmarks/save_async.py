"""The training time a save costs, synchronous against --save_async
(dragon.checkpoint.background_saves), and --save_async with --checkpoint_copy_to
(dragon.checkpoint.store_copy).

    python benchmarks/save_async.py [--mult 512] [--n_layer 1] [--steps 10] [--repeats 6]

One process, a real DeepSpeed ZeRO-2 engine (fp32, torch's AdamW) of a BDH at the reference's sizes
but four times its neurons (--mult 512: 100.8M parameters, ~1.5 GB a checkpoint with the
optimizer, so that a synchronous save takes seconds here), saved through dragon's Checkpointer and
retention hook as the recipes save. The asynchronous saves' writer process is started with the
engine, as a recipe starts it with its Checkpointer, and one untimed save of each kind comes first
(the writer's shared buffer is allocated at the first save). Windows of --steps training steps
are then timed four ways, --repeats times, each mode first in turn: no save, a synchronous save
at the window's start, an asynchronous save at its start (polled after every step, and waited for
at the window's end, so that a write that outlasts the window is counted), and an asynchronous
save copied to a store once it completes (a directory on the same disk, standing in for a shared
file system: the copy's thread, waited for at the window's end, is what it costs training). Each
window starts on a settled machine (os.sync(), then --settle seconds idle). A save's cost is its
median window less the median no-save window: a synchronous save's own time varies from save to
save (the page cache it fills comes from memory the machine may have handed back), and the
fastest windows would pick its cheapest save against the luckiest no-save window; that estimate
is printed too. The asynchronous costs are also given as ratios of the synchronous one, with how
long the save call itself held the step (median) and the load average around the run.
"""

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                   ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29561")):
    os.environ.setdefault(key, value)

import deepspeed  # noqa: E402
import torch  # noqa: E402

from dragon.checkpoint.background_saves import BackgroundSaves  # noqa: E402
from dragon.checkpoint.checkpointer import Checkpointer  # noqa: E402
from dragon.checkpoint.retention import RetentionPolicy  # noqa: E402
from dragon.checkpoint.save_hook import attach_retention  # noqa: E402
from dragon.checkpoint.store_copy import StoreCopy  # noqa: E402
from dragon.model.bdh import BDHConfig, BDHForCausalLM  # noqa: E402

CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "gradient_clipping": 1.0, "steps_per_print": 10**9,
          "zero_optimization": {"stage": 2}}


def engine_of(n_layer: int, mult: int, block: int):
    model = BDHForCausalLM(BDHConfig(n_layer=n_layer, mlp_internal_dim_multiplier=mult,
                                     dropout=0.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=CONFIG)
    batch = torch.randint(0, model.config.vocab_size, (1, block))
    return engine, batch


def train_step(engine, batch) -> None:
    engine.backward(engine(input_ids=batch, labels=batch).loss)
    engine.step()


def window(engine, batch, checkpointer, steps: int, mode: str, background: BackgroundSaves,
           copy: StoreCopy, settle: float = 0.0) -> tuple[float, float, float]:
    """(seconds of the window, seconds the save call itself took, seconds waited at its end for
    the write and the copy still in flight)."""
    # the same engine and Checkpointer save every way (Checkpointer(save_async=...) and
    # attach_retention(copy_to=...) set these)
    checkpointer.hook.background = background if mode in ("async", "copy") else None
    checkpointer.hook.copy = copy if mode == "copy" else None
    os.sync()  # no window pays for the page cache writeback of an earlier window's save
    time.sleep(settle)  # nor for the kernel's work after it (freed pages handed back to the host)
    began = time.perf_counter()
    saved = 0.0
    if mode != "none":
        checkpointer.save(int(engine.global_steps))
        saved = time.perf_counter() - began
    for _ in range(steps):
        train_step(engine, batch)
        checkpointer.poll()
    trained = time.perf_counter()
    checkpointer.wait()
    return time.perf_counter() - began, saved, time.perf_counter() - trained


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n_layer", type=int, default=1)  # compute only: layers share weights
    parser.add_argument("--mult", type=int, default=512)  # N per head = mult * 256 / 4
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--settle", type=float, default=5.0)  # seconds idle before each window
    args = parser.parse_args()
    load = f"{os.getloadavg()[0]:.1f}"
    deepspeed.init_distributed("gloo")
    background = BackgroundSaves()  # its writer process starts now
    engine, batch = engine_of(args.n_layer, args.mult, args.block)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        attach_retention(engine, RetentionPolicy(1, None),
                         history_path=os.path.join(tmp, "metrics.jsonl"))
        checkpointer = Checkpointer(engine, os.path.join(tmp, "checkpoints"))
        copy = StoreCopy(os.path.join(tmp, "store"), tmp)
        for _ in range(3):
            train_step(engine, batch)
        for mode in ("sync", "async", "copy"):  # untimed
            window(engine, batch, checkpointer, 1, mode, background, copy)
        times = {"none": [], "sync": [], "async": [], "copy": []}
        calls, waits = {"sync": [], "async": [], "copy": []}, {"async": [], "copy": []}
        for repeat in range(args.repeats):
            k = repeat % len(times)
            for mode in list(times)[k:] + list(times)[:k]:  # no mode always first
                seconds, call, waited = window(engine, batch, checkpointer, args.steps, mode,
                                               background, copy, args.settle)
                times[mode].append(seconds)
                if mode in calls:
                    calls[mode].append(call)
                if mode in waits:
                    waits[mode].append(waited)
        size = sum(os.path.getsize(os.path.join(parent, name))
                   for parent, _, names in os.walk(os.path.join(tmp, "checkpoints"))
                   for name in names if name.endswith(".pt"))
    median = {mode: statistics.median(seconds) for mode, seconds in times.items()}
    lost = {mode: median[mode] - median["none"] for mode in calls}
    fastest = {mode: min(times[mode]) - min(times["none"]) for mode in calls}
    step = median["none"] / args.steps
    print(f"BDH {sum(p.numel() for p in engine.module.parameters()):,} parameters, checkpoint "
          f"{size / 2**20:,.0f} MiB, {step:.2f} s/step, windows of {args.steps} steps, median "
          f"of {args.repeats}; load average {load} before, {os.getloadavg()[0]:.1f} after; the "
          f"no-save windows spread {max(times['none']) - min(times['none']):.2f} s")
    for mode, seconds in times.items():
        print(f"{mode} windows: " + " ".join(f"{t:.2f}" for t in seconds))
    print("| save | call returns after | training time lost per save | lost / synchronous |")
    print("|---|---|---|---|")
    for mode, name in (("sync", "synchronous (baseline)"), ("async", "--save_async (ours)"),
                       ("copy", "--save_async --checkpoint_copy_to (ours)")):
        print(f"| {name} | {statistics.median(calls[mode]):.2f} s | {lost[mode]:.2f} s "
              f"| {lost[mode] / lost['sync']:.2f} |")
    print("fastest windows instead: " + ", ".join(
        f"{mode} {fastest[mode]:.2f} s lost ({fastest[mode] / fastest['sync']:.2f})"
        for mode in calls))
    for mode, waited in waits.items():
        print(f"the {mode} windows waited {statistics.median(waited):.2f} s (median) at their "
              "end for the work still in flight")


if __name__ == "__main__":
    main()
