"""One island of a compressed exchange among N islands, for tests/test_quantized.py and
tests/test_sparse.py.

    python quantized_exchange.py ISLAND N PORT OUT [int4,topk]

Each island (one process) joins a real ProcessGroupGloo of N members and exchanges its own
pseudo-gradient (random, seeded by the island) through dragon.wire.exchange.Exchange with each
code in turn: int4 (the default) and top-k (TOPK of the entries); for each it saves the average,
the bytes it measured on the wire and the payload in OUT.<code>.pt.
"""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from dragon.wire.codecs import codec_for
from dragon.wire.exchange import Exchange

LENGTH, BLOCK, TOPK = 100_000, 64, 0.02


def pseudo_gradient(island: int) -> torch.Tensor:
    return torch.randn(LENGTH, generator=torch.Generator().manual_seed(island)) * (island + 1)


def main() -> None:
    island, n, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    codecs = sys.argv[5].split(",") if len(sys.argv) > 5 else ["int4"]
    store = dist.TCPStore("127.0.0.1", port, n, island == 0, timedelta(seconds=60))
    group = dist.ProcessGroupGloo(store, island, n, timedelta(seconds=60))
    for codec in codecs:
        group.barrier().wait()  # connections made, and the last exchange done, before counting
        exchange = Exchange(pseudo_gradient(island), group, n, codec_for(codec, BLOCK, TOPK),
                            [LENGTH], measure_bytes=True)
        torch.save({"average": exchange.result(), "bytes_sent": exchange.bytes_sent,
                    "payload_bytes": exchange.payload_bytes,
                    "error": (exchange.error_sq / exchange.norm_sq) ** 0.5}, f"{out}.{codec}.pt")
    group.barrier().wait()


if __name__ == "__main__":
    main()
