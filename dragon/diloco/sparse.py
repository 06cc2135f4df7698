"""Top-k pseudo-gradients with error feedback (DeMo's and SparseLoCo's scheme).

Each rank sends only the k = ceil(fraction x n) entries of largest magnitude of its pseudo-
gradient plus the residual it kept from earlier outer steps; what it did not send (the rest, and
the bf16 rounding of what it sent) becomes the next residual, so nothing is dropped, only late.
The code: the k indices as int32, then the k values as bf16, six bytes an entry, as one uint8
tensor of the same length on every island. The exchange is an all-gather of the codes (a sparse
sum has no fixed size to reduce in place): each island sends (n-1) x 6k bytes; every island sums
the gathered codes in island order, so the averages are identical bit for bit.
"""

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
