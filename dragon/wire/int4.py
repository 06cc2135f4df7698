"""A 4-bit all-reduce whose bytes per island do not grow with the number of islands. The code:
per block of `block` values an fp32 scale, absmax / 7, and the values rounded to -7..7, two a
byte (symmetric int4 with QLoRA's and zeroband's per-block absmax, but no lookup table: a
pseudo-gradient has no fixed distribution for a 4-bit float to fit). As in INTELLECT-1's ring
all-reduce, an all-to-all sends chunk j of every island to island j, which sums them in fp32 in
island order and encodes the sum once; an all-gather then gives every island every summed chunk."""

import torch

LEVELS = 7  # codes -7..7; stored as 1..15 in a nibble


def int4_encode(x: torch.Tensor, block: int) -> torch.Tensor:
    """x's uint8 code (its length a multiple of 2 * block): fp32 scales, then values two a byte."""
    xb = x.view(-1, block)
    scale = xb.abs().amax(dim=1) / LEVELS
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = (xb * inverse[:, None]).round_().clamp_(-LEVELS, LEVELS).to(torch.int16) + 8
    q = q.view(-1, 2)
    packed = (q[:, 0] | (q[:, 1] << 4)).to(torch.uint8)
    return torch.cat([scale.float().view(torch.uint8), packed])


def int4_decode(code: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """The n fp32 values of a packed code (n a multiple of 2 * block)."""
    blocks = n // block
    scale = code[: 4 * blocks].view(torch.float32)
    packed = code[4 * blocks :].to(torch.int16)
    q = torch.stack([packed & 0xF, packed >> 4], dim=1).view(-1, block) - 8
    return (q.float() * scale[:, None]).view(-1)


def padded_length(n: int, islands: int, block: int) -> int:
    """The length a vector of n values is padded to: whole blocks, two per byte, per island."""
    unit = islands * 2 * block
    return -(-n // unit) * unit


def chunk_codes(flat: torch.Tensor, islands: int, block: int) -> tuple[torch.Tensor, float]:
    """Phase one's local half: the codes of the padded vector's `islands` chunks, one after the
    other (chunk j goes to island j), and the squared error of encoding them."""
    length = padded_length(flat.numel(), islands, block)
    chunks = torch.nn.functional.pad(flat, (0, length - flat.numel())).view(islands, -1)
    codes = [int4_encode(chunk, block) for chunk in chunks]
    error_sq = sum(float((int4_decode(c, chunks.shape[1], block) - chunk).pow(2).sum())
                   for c, chunk in zip(codes, chunks))
    return torch.cat(codes), error_sq


def reduce_chunk(sent: torch.Tensor, group, islands: int, block: int) -> torch.Tensor:
    """Phase one's collective half (blocking): chunk j of every island's `sent` reaches island j
    (this island's index in `group`), which returns the code of their fp32 sum."""
    received = sent
    if group is not None and islands > 1:
        received = torch.empty_like(sent)
        group.alltoall_base(received, sent, [], []).wait()
    chunk = len(sent) // islands * 2 * block // (block + 8)
    total = torch.zeros(chunk, dtype=torch.float32)
    for code in received.view(islands, -1):  # island order: the same sum wherever it is made
        total += int4_decode(code, chunk, block)
    return int4_encode(total, block)


def gathered_sum(gathered: list[torch.Tensor], n: int, block: int) -> torch.Tensor:
    """Phase two's result: the first n values of every island's summed chunk, decoded."""
    chunk = len(gathered[0]) * 2 * block // (block + 8)
    return torch.cat([int4_decode(code, chunk, block) for code in gathered])[:n]
