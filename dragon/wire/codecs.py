"""How a flat fp32 pseudo-gradient goes on the wire (--diloco_compress), and how the islands'
codes sum back to fp32 (the outer step stays fp32); dragon.wire.exchange moves the bytes.
fp32 and bf16 are summed by the all-reduce itself; int8 (an absmax scale per block of
--diloco_int8_block values, 0: per tensor), top-k and sparseloco (dragon.wire.sparse) are
all-gathered and summed in island order; int4 (dragon.wire.int4) sums each island's chunk
after an all-to-all and all-gathers the sums. Every island sums the same codes in the same order,
so the averages are identical bit for bit. Bytes on the wire per rank, for n islands and a
payload of P bytes: fp32, bf16 and int4 2(n-1)/n * P; int8, top-k and sparseloco (n-1) * P."""

from dataclasses import dataclass
from typing import Optional

import torch

from dragon.wire.int4 import chunk_codes, gathered_sum, reduce_chunk
from dragon.wire.sparse import sparseloco_encode, sparseloco_sum, topk_encode, topk_sum

# bytes a value on the wire, before the ring's factor (int8, int4: plus a 4-byte scale a block)
VALUE_BYTES = {"none": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}


@dataclass
class Encoded:
    """This island's code of one pseudo-gradient."""

    payload: torch.Tensor  # what the collective sends
    payload_bytes: int  # the bytes of this island's whole payload
    error_sq: float  # ||decoded - flat||^2
    sent: Optional[torch.Tensor] = None  # top-k: what the code decodes to (the rest is kept)


class Codec:
    """fp32: the all-reduce sums the values as they are."""

    op = "allreduce"  # the collective: allreduce, allgather, or scatter (all-to-all, all-gather)

    def encode(self, flat: torch.Tensor, islands: int, numels: list[int]) -> Encoded:
        return Encoded(flat, flat.numel() * 4, 0.0)

    def reduce_chunks(self, payload: torch.Tensor, group, islands: int) -> torch.Tensor:
        """scatter's first collective (blocking); the code this island then all-gathers."""
        return payload

    def total(self, gathered: list[torch.Tensor], n: int, numels: list[int]) -> torch.Tensor:
        """The fp32 sum of the islands' codes (an all-reduce's result: one already summed)."""
        return gathered[0].float()


class Bf16(Codec):
    def encode(self, flat: torch.Tensor, islands: int, numels: list[int]) -> Encoded:
        payload = flat.bfloat16()
        return Encoded(payload, payload.numel() * 2, float((payload.float() - flat).pow(2).sum()))


class Int8(Codec):
    """int8 codes after fp32 scales (absmax / 127 per block of `block` values, 0: per tensor)."""

    op = "allgather"

    def __init__(self, block: int):
        self.block = block

    def encode(self, flat: torch.Tensor, islands: int, numels: list[int]) -> Encoded:
        q, scale = int8_encode(flat, self.block, numels)
        decoded = int8_decode(q, scale, self.block, numels, flat.numel())
        payload = torch.cat([scale.view(torch.int8), q])
        return Encoded(payload, payload.numel(), float((decoded - flat).pow(2).sum()))

    def total(self, gathered: list[torch.Tensor], n: int, numels: list[int]) -> torch.Tensor:
        scales = -(-n // self.block) if self.block > 0 else len(numels)
        total = torch.zeros(n, dtype=torch.float32)
        for packed in gathered:  # island order: the same sum on every island
            scale = packed[:4 * scales].view(torch.float32)
            total += int8_decode(packed[4 * scales:], scale, self.block, numels, n)
        return total


class Int4(Codec):
    op = "scatter"

    def __init__(self, block: int):
        self.block = block

    def encode(self, flat: torch.Tensor, islands: int, numels: list[int]) -> Encoded:
        payload, error_sq = chunk_codes(flat, islands, self.block)
        return Encoded(payload, payload.numel(), error_sq)

    def reduce_chunks(self, payload: torch.Tensor, group, islands: int) -> torch.Tensor:
        return reduce_chunk(payload, group, islands, self.block)

    def total(self, gathered: list[torch.Tensor], n: int, numels: list[int]) -> torch.Tensor:
        return gathered_sum(gathered, n, self.block)


class TopK(Codec):
    op = "allgather"

    def __init__(self, fraction: float):
        self.fraction = fraction

    def encode(self, flat: torch.Tensor, islands: int, numels: list[int]) -> Encoded:
        payload, sent = topk_encode(flat, self.fraction)
        return Encoded(payload, payload.numel(), float((sent - flat).pow(2).sum()), sent)

    def total(self, gathered: list[torch.Tensor], n: int, numels: list[int]) -> torch.Tensor:
        return topk_sum(gathered, n)


class SparseLoCo(Codec):
    op = "allgather"

    def __init__(self, density: float, chunk: int):
        self.density, self.chunk = density, chunk

    def encode(self, flat: torch.Tensor, islands: int, numels: list[int]) -> Encoded:
        payload, sent = sparseloco_encode(flat, self.density, self.chunk)
        return Encoded(payload, payload.numel(), float((sent - flat).pow(2).sum()), sent)

    def total(self, gathered: list[torch.Tensor], n: int, numels: list[int]) -> torch.Tensor:
        return sparseloco_sum(gathered, n, self.density, self.chunk)


def codec_for(compress: str, block: int = 0, topk: float = 0.0, chunk: int = 4096) -> Codec:
    """The codec of --diloco_compress (none, bf16, int8, int4, topk, sparseloco)."""
    if compress == "bf16":
        return Bf16()
    if compress == "int8":
        return Int8(block)
    if compress == "int4":
        return Int4(block)
    if compress == "topk":
        return TopK(topk)
    if compress == "sparseloco":
        return SparseLoCo(topk, chunk)
    return Codec()

def int8_encode(x: torch.Tensor, block: int, numels: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes, fp32 scales): round-to-nearest of x / scale, scale = absmax / 127 per block."""
    if block > 0:
        blocks = -(-x.numel() // block)
        xb = torch.nn.functional.pad(x, (0, blocks * block - x.numel())).view(blocks, block)
        scale = xb.abs().amax(dim=1) / 127
        inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        q = (xb * inverse[:, None]).round_().clamp_(-127, 127).to(torch.int8).view(-1)
        return q, scale.float()
    scale = torch.stack([s.abs().max() if s.numel() else s.new_zeros(())
                         for s in x.split(numels)]) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = (x * torch.repeat_interleave(inverse, torch.tensor(numels))).round_().clamp_(-127, 127)
    return q.to(torch.int8), scale.float()


def int8_decode(q: torch.Tensor, scale: torch.Tensor, block: int, numels: list[int], n: int
                ) -> torch.Tensor:
    if block > 0:
        return (q.view(-1, block).float() * scale[:, None]).view(-1)[:n]
    return q.float() * torch.repeat_interleave(scale, torch.tensor(numels))
