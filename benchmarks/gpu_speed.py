"""BDH on one GPU in bf16: forward+backward tokens/s and MFU of each attention form, generation
tokens/s with the state cache against full recompute, and the peak memory of each.

    python benchmarks/gpu_speed.py                       (one H200: about 3 minutes)
    python benchmarks/gpu_speed.py --device cpu --small  (checks the script on a CPU: a minute)

A model of about 100 M parameters (n_layer 6, n_embd 512, n_head 4, multiplier 128: N = 16,384
per head, 100.9 M parameters) in bf16, T = 512, 2048 and 8192, 8,192 tokens a step. The
reference is a plain implementation of the reference's definition on the same weights (every
T x T score computed, then masked), as in model_speed.py. MFU divides the FLOPs each form really
computes (dragon.model.cost) by the GPU's bf16 dense peak (--peak_tflops, the H200's 989 by default)
and, beside it, by this GPU's measured bf16 matmul FLOP/s. Peak memory is
torch.cuda.max_memory_allocated over each measurement. A measurement that runs out of memory
says so and the rest go on. Prints markdown tables.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.model_speed import train_flops_per_token, train_step  # noqa: E402
from dragon import BDHConfig, BDHForCausalLM  # noqa: E402
from dragon.model.cost import parameter_count  # noqa: E402

DIMS = dict(n_layer=6, n_embd=512, n_head=4, mlp_internal_dim_multiplier=128, dropout=0.0)
SMALL = dict(n_layer=2, n_embd=64, n_head=2, mlp_internal_dim_multiplier=8, dropout=0.0)
FORMS = ("reference", "quadratic", "chunked")


class Device:
    """Synchronisation and peak memory on the device the benchmark runs on."""

    def __init__(self, name: str):
        self.device = torch.device(name)
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float:
        return torch.cuda.max_memory_allocated() / 2**30 if self.cuda else float("nan")

    def timed(self, fn, reps: int) -> float:
        """Median seconds of fn over reps calls, after one warm-up call."""
        times = []
        for _ in range(reps + 1):
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])


def model_for(dims: dict, form: str, dev: Device) -> BDHForCausalLM:
    torch.manual_seed(0)
    attention = "quadratic" if form == "reference" else form
    return BDHForCausalLM(BDHConfig(**dims, attention=attention)).to(dev.device, torch.bfloat16)


def matmul_tflops(dev: Device, n: int) -> float:
    a = torch.randn(n, n, device=dev.device, dtype=torch.bfloat16)
    seconds = min(dev.timed(lambda: a @ a, 3) for _ in range(3))
    return 2 * n**3 / seconds / 1e12


def training(dims: dict, form: str, T: int, tokens: int, dev: Device, reps: int) -> dict:
    """tokens/s, achieved TFLOP/s and peak GiB of bf16 forward+backward of one form at T."""
    model = model_for(dims, form, dev)
    ids = torch.randint(0, 256, (max(1, tokens // T), T), device=dev.device)
    dev.reset_peak()
    tps = ids.numel() / dev.timed(lambda: train_step(model, ids, form), reps)
    flops = tps * train_flops_per_token(model.config, form, T)
    return {"tokens/s": tps, "tflops": flops / 1e12, "peak": dev.peak_gib()}


@torch.no_grad()
def generation(dims: dict, use_cache: bool, new_tokens: int, dev: Device) -> dict:
    model = model_for(dims, "auto", dev).eval()
    prompt = torch.randint(0, 256, (1, 16), device=dev.device)

    def run():
        return model.generate(
            prompt,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=use_cache,
        )

    run()  # warm-up: kernels chosen, memory pools filled
    dev.reset_peak()
    dev.sync()
    start = time.perf_counter()
    out = run()
    dev.sync()
    seconds = time.perf_counter() - start
    return {"tokens/s": new_tokens / seconds, "peak": dev.peak_gib(), "text": out[0].tolist()}


def guarded(fn, *args) -> dict:
    """fn(*args), or {"oom": True} when the device runs out of memory (the next one goes on)."""
    try:
        return fn(*args)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"oom": True}


def cell(r: dict, base: dict, peak: float, measured: float) -> str:
    if r.get("oom"):
        return "out of memory"
    ratio = "" if base.get("oom") else f" ({r['tokens/s'] / base['tokens/s']:.2f}x)"
    return (
        f"{r['tokens/s']:,.0f}{ratio}, MFU {r['tflops'] / peak:.0%} / {r['tflops'] / measured:.0%},"
        f" {r['peak']:.1f} GiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a tiny model and short lengths")
    parser.add_argument("--peak_tflops", type=float, default=989.0, help="bf16 dense peak")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--new_tokens", type=int, default=256)
    args = parser.parse_args()
    dev = Device(args.device)
    dims = SMALL if args.small else DIMS
    lengths, tokens = ((64, 128, 256), 512) if args.small else ((512, 2048, 8192), 8192)
    measured = matmul_tflops(dev, 1024 if args.small else 8192)
    name = torch.cuda.get_device_name() if dev.cuda else "CPU"
    print(
        f"`python benchmarks/gpu_speed.py{' --small' if args.small else ''}` on {name}, torch "
        f"{torch.__version__}; BDH {dims} ({parameter_count(BDHConfig(**dims)):,} parameters), "
        f"bf16, {tokens} tokens a step; MFU against the bf16 peak {args.peak_tflops:.0f} TFLOP/s "
        f"/ against the measured bf16 matmul {measured:.1f} TFLOP/s\n"
    )
    print("| T | " + " | ".join(f"{f}: tokens/s, MFU, peak" for f in FORMS) + " |")
    print("|---|---|---|---|")
    for T in lengths:
        r = {f: guarded(training, dims, f, T, tokens, dev, args.reps) for f in FORMS}
        cells = [cell(r[f], r["reference"], args.peak_tflops, measured) for f in FORMS]
        print(f"| {T} | " + " | ".join(cells) + " |", flush=True)
    n = args.new_tokens
    cached, full = (guarded(generation, dims, c, n, dev) for c in (True, False))
    print(f"\n| {n} new tokens, greedy, batch 1 | cached | recompute | speed-up | same text |")
    print("|---|---|---|---|---|")
    if cached.get("oom") or full.get("oom"):
        oom = {name: r.get("oom", False) for name, r in (("cached", cached), ("recompute", full))}
        print(f"| out of memory: {oom} |")
        return
    print(
        f"| tokens/s, peak | {cached['tokens/s']:.1f}, {cached['peak']:.2f} GiB | "
        f"{full['tokens/s']:.1f}, {full['peak']:.2f} GiB | "
        f"{cached['tokens/s'] / full['tokens/s']:.1f}x | {cached['text'] == full['text']} |"
    )


if __name__ == "__main__":
    main()
