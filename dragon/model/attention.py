"""BDH's attention in three exact forms, and the state cache that carries it across calls.

BDH's attention has no softmax: with Q = K = rope(x_sparse) and V = x, position t reads
sum_{s<t} (q_t . q_s) v_s. That is a linear recurrence over a per-head state
rho (N x D): out_t = q_t rho, then rho += q_t^T v_t (read before write: strictly causal).

- quadratic: the reference's form, the (T x T) score matrix masked below the diagonal.
- chunked: quadratic inside chunks of C positions, rho carried from chunk to chunk; every
  chunk's state comes from one prefix sum, so there is no Python loop over chunks.
- recurrent: one position at a time (what a cached generation step is).

Every form takes an incoming state and a start position (RoPE positions continue the stream)
and can return the outgoing state. States are fp32 under bf16 compute: updates are accumulated
in fp32, and read back in the compute dtype. Imports nothing from dragon.
"""

import math
from typing import Optional

import torch
from transformers.cache_utils import Cache

ROPE_THETA = 2.0**16
FORMS = ("auto", "quadratic", "chunked", "recurrent")
DEFAULT_CHUNK_SIZE = 512
# "auto" takes the quadratic form up to this many positions, the chunked form above it.
AUTO_CROSSOVER = 1024
# RoPE phases in fp32 up to this position (exactly the reference's arithmetic), fp64 beyond.
FP32_POSITIONS = 2**16
# Rows of scores computed at once; each block of rows skips the positions after its end.
CAUSAL_BLOCK = 128


def rope_frequencies(n: int, device=None) -> torch.Tensor:
    """Frequencies 1/theta^(2*floor(i/2)/n) / 2pi, in fp32, shaped (1, 1, 1, n)."""
    q = (torch.arange(n, dtype=torch.float32, device=device) / 2).floor() * 2
    return (1.0 / (ROPE_THETA ** (q / n)) / (2 * math.pi)).view(1, 1, 1, n)


def rope_rotation(freqs: torch.Tensor, position: int, T: int) -> torch.Tensor:
    """e^(i 2pi (p * freq mod 1)) for positions p = position..position+T-1, in complex64, shaped
    (1, 1, T, n/2): one per interleaved pair (pairs share a frequency), cos/sin in fp32.

    p * freq is computed in fp32 as the reference does while positions are small; a carried
    stream's positions grow without bound, and beyond FP32_POSITIONS fp32 would lose the
    fraction of a turn, so the product and its fraction are computed in fp64 there.
    """
    dtype = torch.float32 if position + T <= FP32_POSITIONS else torch.float64
    positions = torch.arange(position, position + T, device=freqs.device, dtype=dtype)
    turns = (positions.view(1, 1, T, 1) * freqs[..., ::2].to(dtype)) % 1
    angles = (turns * (2 * math.pi)).float()
    return torch.complex(torch.cos(angles), torch.sin(angles))


def rope(rotation: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of v (..., T, n): each pair (v0, v1) is the complex number
    v0 + i v1, times its rotation. One pass over v forward and one backward."""
    pairs = torch.view_as_complex(v.to(state_dtype(v.dtype)).unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2).to(v.dtype)


def resolve_form(form: str, T: int, chunk: int, has_state: bool) -> str:
    """The form "auto" stands for at T positions (an explicit form stays): the recurrent form for
    one position after a state, the quadratic form up to the measured crossover (or one chunk,
    where the two are the same), the chunked form beyond (benchmarks/README.md)."""
    if form != "auto":
        return form
    if T == 1 and has_state:
        return "recurrent"
    return "quadratic" if T <= max(AUTO_CROSSOVER, chunk) else "chunked"


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """States are at least fp32 (bf16 and fp16 compute keeps an fp32 state)."""
    return torch.promote_types(dtype, torch.float32)


def _state_update(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q^T v over the positions, at least in fp32: (..., T, N), (..., T, D) -> (..., N, D),
    laid out D-major (see d_major)."""
    dtype = state_dtype(q.dtype)
    return (v.to(dtype).mT @ q.to(dtype)).mT


def d_major(state: torch.Tensor) -> torch.Tensor:
    """The state (..., N, D) with its N numbers of each d adjacent in memory: a (..., D, N)
    buffer seen transposed. A generation step reads the whole state once per layer, and a
    vector-matrix product over this layout runs at the machine's memory bandwidth, about twice
    as fast as over (N, D) rows (benchmarks/README.md). Returns `state` itself when it is."""
    return state.mT.contiguous().mT


def _read(q: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    return q @ state.to(q.dtype)


def causal_scores(q: torch.Tensor, v: torch.Tensor, block: int = CAUSAL_BLOCK) -> torch.Tensor:
    """sum_{s<t} (q_t . q_s) v_s over the positions (dim -2) of q (..., T, N), v (..., T, D).

    Above `block` positions the scores are computed one block of rows at a time, each against
    only the positions before its end, so the work above the diagonal is mostly skipped.
    """
    if q.size(-2) <= block:
        return (q @ q.mT).tril(diagonal=-1) @ v
    return _BlockCausal.apply(q, v, block)


def row_blocks(T: int, block: int) -> list[tuple[int, int]]:
    """(start, end) of each block of rows the quadratic form computes at once."""
    return [(start, min(start + block, T)) for start in range(0, T, block)]


class _BlockCausal(torch.autograd.Function):
    """causal_scores by blocks of rows, with a backward that adds each block's gradients into
    one buffer in place (autograd's own would materialise a full-size gradient per slice)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
        scores, rows = [], []
        for start, end in row_blocks(q.size(-2), block):
            s = (q[..., start:end, :] @ q[..., :end, :].mT).tril(diagonal=start - 1)
            scores.append(s)
            rows.append(s @ v[..., :end, :])
        ctx.block = block
        ctx.save_for_backward(q, v, *scores)
        return torch.cat(rows, dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, v, *scores = ctx.saved_tensors
        dq = torch.zeros_like(q)
        dv = torch.zeros(
            *torch.broadcast_shapes(q.shape[:-2], v.shape[:-2]),
            *v.shape[-2:],
            dtype=v.dtype,
            device=v.device,
        )
        for (start, end), s in zip(row_blocks(q.size(-2), ctx.block), scores):
            g = grad[..., start:end, :]
            ds = (g @ v[..., :end, :].mT).tril(diagonal=start - 1)
            dv[..., :end, :] += s.mT @ g
            dq[..., start:end, :] += ds @ q[..., :end, :]
            dq[..., :end, :] += ds.mT @ q[..., start:end, :]
        return dq, dv.sum_to_size(v.shape), None


def quadratic(
    q: torch.Tensor,
    v: torch.Tensor,
    state: Optional[torch.Tensor] = None,
    return_state: bool = False,
):
    """(B, nh, T, N) rotated activations, (B, 1, T, D) values -> (B, nh, T, D) [, state]."""
    out = causal_scores(q, v)
    if state is not None:
        out = out + _read(q, state)
    if not return_state:
        return out
    update = _state_update(q, v)
    return out, update if state is None else state + update


def chunked(
    q: torch.Tensor,
    v: torch.Tensor,
    chunk: int,
    state: Optional[torch.Tensor] = None,
    return_state: bool = False,
):
    """The chunked form: quadratic inside each chunk of `chunk` positions, plus each chunk's
    read of the state that all earlier chunks (and `state`) wrote. Any T; the last chunk is
    zero-padded, which adds nothing to any state."""
    B, nh, T, N = q.shape
    D = v.size(-1)
    if T <= chunk:
        return quadratic(q, v, state, return_state)
    n_chunks = -(-T // chunk)
    pad = n_chunks * chunk - T
    if pad:
        q = torch.nn.functional.pad(q, (0, 0, 0, pad))
        v = torch.nn.functional.pad(v, (0, 0, 0, pad))
    qc = q.view(B, nh, n_chunks, chunk, N)
    vc = v.view(v.size(0), 1, n_chunks, chunk, D)
    updates = _state_update(qc, vc)  # (B, nh, n_chunks, N, D): what each chunk writes
    # The state each chunk reads: everything written before it (an exclusive prefix sum).
    before = torch.cat(
        [torch.zeros_like(updates[:, :, :1]), updates[:, :, :-1].cumsum(dim=2)], dim=2
    )
    if state is not None:
        before = before + state.unsqueeze(2)
    out = (causal_scores(qc, vc) + _read(qc, before)).view(B, nh, n_chunks * chunk, D)[:, :, :T]
    if not return_state:
        return out
    return out, d_major(before[:, :, -1] + updates[:, :, -1])


def _add_in_place(rho: torch.Tensor, q: torch.Tensor, v: torch.Tensor) -> None:
    """rho += q^T v for one position, q (B, nh, 1, N), v (B, 1|nh, 1, D), into rho
    (B, nh, N, D) in one elementwise pass over it, in whatever layout it has."""
    rho.addcmul_(q.to(rho.dtype).mT, v.to(rho.dtype))


def recurrent(
    q: torch.Tensor,
    v: torch.Tensor,
    state: Optional[torch.Tensor] = None,
    return_state: bool = False,
):
    """One position at a time: out_t = q_t rho, then rho += q_t^T v_t.

    Without autograd the given state is updated in place, in one fused pass over it: a
    generation step reads rho and adds into it while it is still in cache.
    """
    B, nh, T, N = q.shape
    D = v.size(-1)
    if state is None:
        rho = q.new_zeros(B, nh, D, N, dtype=state_dtype(q.dtype)).mT
    else:
        rho = state
    in_place = state is not None and not (
        torch.is_grad_enabled() and (q.requires_grad or v.requires_grad or rho.requires_grad)
    )
    if in_place and T == 1:  # a generation step: no slicing, no concatenation
        out = _read(q, rho)
        _add_in_place(rho, q, v)
        return (out, rho) if return_state else out
    outs = []
    for t in range(T):
        q_t, v_t = q[:, :, t : t + 1], v[:, :, t : t + 1]
        outs.append(_read(q_t, rho))
        if in_place:
            _add_in_place(rho, q_t, v_t)
        else:
            rho = rho + _state_update(q_t, v_t)
    out = torch.cat(outs, dim=2)
    return (out, rho) if return_state else out


def attention(
    q: torch.Tensor,
    v: torch.Tensor,
    form: str,
    chunk: int,
    state: Optional[torch.Tensor] = None,
    return_state: bool = False,
):
    """Dispatch to one form (after resolving "auto" for this T)."""
    form = resolve_form(form, q.size(-2), chunk, state is not None)
    if form == "quadratic":
        return quadratic(q, v, state, return_state)
    if form == "chunked":
        return chunked(q, v, chunk, state, return_state)
    if form == "recurrent":
        return recurrent(q, v, state, return_state)
    raise ValueError(f"attention form {form!r}: valid are {', '.join(FORMS)}")


class BDHCache(Cache):
    """Each layer's attention state rho (B, nh, N, D) in fp32, and the positions seen so far.

    The object generate() carries between steps, and what continues a stream by hand:
    `out = model(ids[:, :t], use_cache=True)` then
    `model(ids[:, t:], past_key_values=out.past_key_values)`. Every row of the batch is at the
    same position. A recurrent state cannot be rolled back, so crop() is refused.
    """

    def __init__(self, n_layer: int):
        super().__init__(layers=[])
        self.n_layer = n_layer
        self.states: list[Optional[torch.Tensor]] = [None] * n_layer
        self.position = 0

    def __len__(self) -> int:
        return self.n_layer

    def __repr__(self) -> str:
        return f"BDHCache(n_layer={self.n_layer}, position={self.position})"

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.position

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1  # a state has no length limit

    @property
    def is_linear(self) -> list[bool]:
        return [True] * self.n_layer

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.states[0] is not None

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        return -1 if self.states[0] is None else self.states[0].size(0)

    def _map(self, fn) -> None:
        self.states = [None if s is None else d_major(fn(s)) for s in self.states]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda s: s.index_select(0, beam_idx.to(s.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda s: s.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda s: s[indices])

    def detach_(self) -> "BDHCache":
        """Stop gradients at this point of the stream (truncated backpropagation)."""
        self._map(lambda s: s.detach())
        return self

    def reset(self) -> None:
        self.states, self.position = [None] * self.n_layer, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "BDHCache: a recurrent state cannot be cropped back to an earlier position"
        )

    def activate_past_recording(self) -> None:
        raise NotImplementedError("BDHCache: assisted generation needs a croppable cache")
