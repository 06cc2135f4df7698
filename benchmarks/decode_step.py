"""The state pass of one cached generation step, in the two layouts a state can have.

    python benchmarks/decode_step.py      (a few seconds)

Each layer of a generation step reads its state rho (n_head x N x D fp32) once (out = q rho) and
adds q^T v into it. rho is 4 MiB per layer at the benchmark model's size (n_head 4, N 1,024,
D 256), 24 MiB over 6 layers: every pass comes from memory, not cache. Prints, side by side, the
microseconds per layer of that read and update with rho stored N-major ((N, D) rows, what a
plain q^T v matmul gives) and D-major (each d's N numbers adjacent, what dragon.model.attention
keeps),
and of a plain sum over the same memory (what the machine's bandwidth allows). Then the
decoder's product in a step, dense against dragon's fired rows only (dragon.model.bdh.fired_rows),
at the fraction of neurons firing in a random-init model (a quarter) and sparser ones.
"""

import statistics
import time

import torch

from dragon.model.bdh import fired_rows

NH, N, D, LAYERS = 4, 1024, 256, 6


def timed(step, states, reps: int = 40) -> float:
    """Median microseconds per state of step(state) over all states, `reps` rounds."""
    for s in states:
        step(s)
    rounds = []
    for _ in range(reps):
        start = time.perf_counter()
        for s in states:
            step(s)
        rounds.append((time.perf_counter() - start) / len(states) * 1e6)
    return statistics.median(rounds)


def main() -> None:
    torch.manual_seed(0)
    q = torch.relu(torch.randn(1, NH, 1, N))
    v = torch.randn(1, 1, 1, D)
    n_major = [torch.randn(1, NH, N, D) * 0.01 for _ in range(LAYERS)]
    d_major = [s.mT.contiguous().mT for s in n_major]  # same values, (D, N) memory

    def n_major_step(rho):  # the layout a q^T v matmul gives, updated by a batched matmul
        out = q @ rho
        rho.view(NH, N, D).baddbmm_(q.view(NH, 1, N).mT, v.view(1, 1, D).expand(NH, 1, D))
        return out

    def d_major_step(rho):  # dragon.model.attention.recurrent's in-place step
        out = q @ rho
        rho.addcmul_(q.mT, v)
        return out

    results = {
        "N-major: read + baddbmm_ update": timed(n_major_step, n_major),
        "D-major: read + addcmul_ update": timed(d_major_step, d_major),
        "plain sum over the state (one read)": timed(lambda rho: rho.sum(), n_major),
    }
    print(
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, {LAYERS} states of "
        f"{NH * N * D * 4 / 2**20:.0f} MiB\n"
    )
    print("| state pass per layer | microseconds | against N-major |\n|---|---|---|")
    base = results["N-major: read + baddbmm_ update"]
    for name, us in results.items():
        print(f"| {name} | {us:.0f} | {us / base:.2f}x |")
    decoders = [torch.randn(NH * N, D) * 0.02 for _ in range(LAYERS)]  # 4 MiB each
    print("\n| decoder product (4 MiB, from memory) | dense microseconds | fired rows | ratio |")
    print("|---|---|---|---|")
    for firing in (0.25, 0.10, 0.05):
        xy = torch.rand(1, NH * N) * (torch.rand(1, NH * N) < firing)
        # the dense form is the model's: batched over heads, then summed
        dense = timed(lambda w: (xy.view(NH, 1, N) @ w.view(NH, N, D)).sum(0), decoders)
        sparse = timed(lambda w: fired_rows(xy, w), decoders)
        print(
            f"| {firing:.0%} of neurons fire | {dense:.0f} | {sparse:.0f} | {sparse / dense:.2f}x |"
        )


if __name__ == "__main__":
    main()
