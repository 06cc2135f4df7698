"""What a checkpoint's CRC-32s cost (dragon.checkpoint.verify), against the save they guard and
the resume load they precede, per GB.

    python benchmarks/checksum.py [--gb 1]   (CPU: ~10 s per GB)

A state dict of fp32 tensors (64 MiB each) is written with torch.save, as DeepSpeed's checkpoint
engine writes every file, then read back and checksummed as a resume does before it loads (the
bytes in the page cache: a cold read adds the disk's time to the check and the load alike), then
loaded with torch.load as a resume loads it. A resume recomputes every checksum before it loads,
so its time with the check is CRC-32 + load, without it the load (and one stat per file, the size
check).
"""

import argparse
import os
import tempfile
import time

import torch

from dragon.checkpoint.verify import crc32_of


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=1.0)
    gb = parser.parse_args().gb
    tensors = max(1, int(gb * 16))
    state = {f"t{i}": torch.randn(16 * 2**20) for i in range(tensors)}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        path = os.path.join(tmp, "states.pt")
        began = time.perf_counter()
        torch.save(state, path)
        saved = time.perf_counter() - began
        began = time.perf_counter()
        crc32_of(path)
        summed = time.perf_counter() - began
        began = time.perf_counter()
        torch.load(path, weights_only=True)
        loaded = time.perf_counter() - began
        began = time.perf_counter()
        os.path.getsize(path)
        stat = time.perf_counter() - began
        size = os.path.getsize(path) / 2**30
    print("| GB written | torch.save s/GB | CRC-32 s/GB | CRC-32 / save | size check s "
          "| torch.load s/GB | resume with CRC-32 / without |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {size:.2f} | {saved / size:.2f} | {summed / size:.2f} | {summed / saved:.2f} "
          f"| {stat:.6f} | {loaded / size:.2f} | {(summed + loaded) / (loaded + stat):.2f} |")


if __name__ == "__main__":
    main()
