"""Top-k pseudo-gradients with error feedback (DeMo's and SparseLoCo's scheme), and SparseLoCo's
2-bit code of top-k within chunks. A rank sends the k = ceil(fraction x n) largest entries of its
pseudo-gradient plus the residual it kept; what it did not send (and the bf16 rounding of what it
did) becomes the next residual, so nothing is dropped, only late. The top-k code: k int32
indices, then k bf16 values, one uint8 tensor of the same length on every island, all-gathered
(a sparse sum has no fixed size to reduce in place) and summed in island order."""

import math

import torch


def topk_count(n: int, fraction: float) -> int:
    """Entries sent of an n-vector (at least one)."""
    return max(1, math.ceil(fraction * n))


def topk_encode(x: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the code of x's top-k entries by magnitude, the dense fp32 vector the code decodes to).
    Ties break by torch.topk's order, which is the same on every run of the same values."""
    k = topk_count(x.numel(), fraction)
    index = x.abs().topk(k, sorted=False).indices.sort().values.to(torch.int32)
    values = x[index.long()].bfloat16()
    sent = torch.zeros_like(x)
    sent[index.long()] = values.float()
    return torch.cat([index.view(torch.uint8), values.view(torch.uint8)]), sent


def topk_sum(codes: list[torch.Tensor], n: int) -> torch.Tensor:
    """The sum of the islands' codes as a dense fp32 n-vector, added in island order."""
    total = torch.zeros(n, dtype=torch.float32)
    for code in codes:
        k = code.numel() // 6
        index = code[: 4 * k].view(torch.int32).long()
        total.index_add_(0, index, code[4 * k:].view(torch.bfloat16).float())
    return total


# SparseLoCo (Sarfi et al., 2025): a chunk's k values take the nearest of {-1, -1/3, 1/3, 1} x its
# largest |value|; the code: every chunk's fp32 scale, then k uint16 indices, then 2-bit levels.
LEVELS = 4


def chunk_shape(n: int, chunk: int, density: float) -> tuple[int, int]:
    """(chunks, values sent per chunk) of an n-vector."""
    return -(-n // chunk), min(chunk, topk_count(chunk, density))


def sparseloco_encode(x: torch.Tensor, density: float, chunk: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the 2-bit code of x's top-k entries of every chunk, the dense fp32 vector it decodes to)."""
    n = x.numel()
    chunks, k = chunk_shape(n, chunk, density)
    padded = torch.nn.functional.pad(x, (0, chunks * chunk - n)).view(chunks, chunk)
    index = padded.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    values = padded.gather(1, index)
    scale = values.abs().amax(dim=1)
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    level = ((values * inverse[:, None] + 1) * 1.5).round_().clamp_(0, LEVELS - 1).to(torch.uint8)
    sent = torch.zeros_like(padded).scatter_(1, index, _value(level, scale)).view(-1)[:n]
    packed = torch.nn.functional.pad(level.view(-1), (0, -level.numel() % 4)).view(-1, 4)
    packed = packed[:, 0] | packed[:, 1] << 2 | packed[:, 2] << 4 | packed[:, 3] << 6
    code = [scale.float().view(torch.uint8),  # first: a view as fp32 needs its alignment
            index.to(torch.int32).to(torch.int16).view(torch.uint8).view(-1), packed]
    return torch.cat(code), sent.contiguous()


def _value(level: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (level.float() / 1.5 - 1) * scale[:, None]


def sparseloco_sum(codes: list[torch.Tensor], n: int, density: float, chunk: int
                   ) -> torch.Tensor:
    """The sum of the islands' codes as a dense fp32 n-vector, added in island order."""
    chunks, k = chunk_shape(n, chunk, density)
    total = torch.zeros(chunks * chunk, dtype=torch.float32)
    offsets = (torch.arange(chunks) * chunk)[:, None]
    for code in codes:
        scale = code[:4 * chunks].view(torch.float32)
        index = code[4 * chunks:4 * chunks + 2 * chunks * k].view(torch.int16).long() & 0xFFFF
        packed = code[4 * chunks + 2 * chunks * k:]
        level = torch.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], dim=1).view(-1)
        level = level[:chunks * k].view(chunks, k)
        total.index_add_(0, (index.view(chunks, k) + offsets).view(-1),
                         _value(level, scale).view(-1))
    return total[:n]
