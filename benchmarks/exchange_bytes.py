"""Bytes each island sends in one DiLoCo exchange, by codec and island count, side by side.

    python benchmarks/exchange_bytes.py [--values 3300000] [--islands 2,4] [--fragments 1,4]
        [--inner_steps 50]   (CPU: ~2 minutes)

N processes (one rank per island) join a real gloo group and exchange a random vector of
--values fp32 values (3.3M: the model of the wan and memory benchmarks) through
dragon.wire.exchange.Exchange, once per codec; each counts the bytes it wrote to the wire
(/proc/self/io) and the slowest island's wall time is kept. Data parallel's gradient all-reduce
moves the fp32 row's bytes every step; DiLoCo moves them once per H steps. With F fragments
(streaming DiLoCo) an exchange carries one fragment, 1/F of the values (fragments are the same
size: dragon.diloco.outer), at its own step: a window sends F of them, its busiest step one.
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
# (name, --diloco_compress, values per scale or the top-k fraction)
CODECS = [("fp32", "none", 0), ("bf16", "bf16", 0), ("int8", "int8", 1024), ("int4", "int4", 1024),
          ("top-k 2 %", "topk", 0.02), ("SparseLoCo 64 of 4096, 2-bit", "sparseloco", 64 / 4096)]


def island(rank: int, n: int, port: int, values: int, fragments: list[int], out: str) -> None:
    """One island: every codec's exchange of the whole vector and of one of F equal fragments,
    its bytes and seconds, saved to `out`."""
    import torch.distributed as dist

    from dragon.wire.codecs import codec_for
    from dragon.wire.exchange import Exchange

    store = dist.TCPStore("127.0.0.1", port, n, rank == 0, timedelta(seconds=120))
    group = dist.ProcessGroupGloo(store, rank, n, timedelta(seconds=120))
    flat = torch.randn(values, generator=torch.Generator().manual_seed(rank))
    rows = {}
    for name, compress, setting in CODECS:
        for f in fragments:
            group.barrier().wait()
            began = time.perf_counter()
            sparse = compress in ("topk", "sparseloco")
            block, topk = (0, setting) if sparse else (setting, 0.0)
            piece = flat[: values // f].clone()  # fp32 and bf16 all-reduce in place
            x = Exchange(piece, group, n, codec_for(compress, block, topk), [piece.numel()],
                         measure_bytes=True)
            rows[name, f] = (x.bytes_sent, x.payload_bytes, time.perf_counter() - began,
                             (x.error_sq / x.norm_sq) ** 0.5)
    torch.save(rows, out)
    group.barrier().wait()


def measure(n: int, values: int, fragments: list[int]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        port = 29000 + os.getpid() % 1000
        outs = [os.path.join(tmp, f"{r}.pt") for r in range(n)]
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, __file__, "--island", str(r), "--n", str(n),
                                   "--port", str(port), "--values", str(values), "--fragments",
                                   ",".join(map(str, fragments)), "--out", outs[r]], env=env)
                 for r in range(n)]
        if any(p.wait() for p in procs):
            sys.exit("an island failed")
        rows = [torch.load(o) for o in outs]
    return {key: (max(r[key][0] for r in rows), rows[0][key][1], max(r[key][2] for r in rows),
                  rows[0][key][3]) for key in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--values", type=int, default=3_300_000)
    parser.add_argument("--islands", default="2,4")
    parser.add_argument("--fragments", default="1,4", help="streaming DiLoCo's F, first 1")
    parser.add_argument("--inner_steps", type=int, default=50, help="H, for data parallel's bytes")
    parser.add_argument("--island", type=int)
    parser.add_argument("--n", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--out")
    args = parser.parse_args()
    fragments = [int(f) for f in args.fragments.split(",")]
    if args.island is not None:
        return island(args.island, args.n, args.port, args.values, fragments, args.out)
    counts = [int(n) for n in args.islands.split(",")]
    results = {n: measure(n, args.values, fragments) for n in counts}
    print_one_exchange(results, counts)
    print()
    print_windows(results, counts, fragments, args.inner_steps, args.values)


def print_one_exchange(results: dict, counts: list[int]) -> None:
    """Bytes of one exchange of the whole vector, by codec and island count."""
    fp32 = {n: results[n]["fp32", 1][0] for n in counts}
    head = " | ".join(f"{n} islands: bytes sent / fp32's" for n in counts)
    last_n, first_n = counts[-1], counts[0]
    print(f"| codec | payload bytes ({last_n} islands) | {head} | {last_n} vs {first_n} islands "
          f"| relative error | seconds ({last_n} islands) |")
    print("|---" * (5 + len(counts)) + "|")
    for name, _, _ in CODECS:
        cells = " | ".join(f"{results[n][name, 1][0]:,} / {results[n][name, 1][0] / fp32[n]:.3f}"
                           for n in counts)
        growth = results[counts[-1]][name, 1][0] / results[counts[0]][name, 1][0]
        last = results[counts[-1]][name, 1]
        print(f"| {name} | {last[1]:,} | {cells} | {growth:.2f}x | {last[3]:.4f} | "
              f"{last[2]:.2f} |")


def print_windows(results: dict, counts: list[int], fragments: list[int], h: int,
                  values: int) -> None:
    """Per window of H inner steps: the bytes an island sends and the most it sends in one step,
    for F fragments (F exchanges of 1/F of the values, one a step), against fp32 at F = 1 and
    against data parallel's fp32 gradient all-reduce at every one of the H steps."""
    head = " | ".join(f"{n} islands: window / fp32's | peak step / fp32's | window / DP's"
                      for n in counts)
    print(f"| codec | F | {head} |")
    print("|---|---" + "|---|---|---" * len(counts) + "|")
    for name, _, _ in CODECS:
        for f in fragments:
            cells = []
            for n in counts:
                fp32 = results[n]["fp32", 1][0]
                peak = results[n][name, f][0]
                dp = h * 2 * (n - 1) / n * 4 * values
                cells.append(f"{f * peak:,} / {f * peak / fp32:.3f} | {peak:,} / "
                             f"{peak / fp32:.3f} | {f * peak / dp:.4f}")
            print(f"| {name} | {f} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
