"""Neuron parallelism: K ranks each hold N/K of every head's neurons (BDH's tensor parallelism).

Everything N-wide in BDH is per neuron or a sum over neurons. x = ReLU(v @ encoder) and
y = ReLU(a @ encoder_v) are per neuron, so a rank needs only its columns of `encoder` and
`encoder_v`. The attention's scores are sums over neurons and its state rho is a sum of outer
products of N-rows, so each rank's neurons give a partial attention output (and their own rows
of rho, with no communication); the decoder (N -> D) is a sum over neurons too. A layer thus
costs two all-reduces of (B, nh|1, T, D), like a Megatron block, while the N-wide weights,
activations and states are split K ways. `embed`, `lm_head` and the (parameter-free)
LayerNorms are replicated: every rank of a group computes them on the same values.

The model code is the same for K = 1: a layer marks where its N-wide part begins
(`enter_neurons`) and ends (`sum_neurons`), identities there, and split_neurons swaps in the
collectives below (Megatron's f and g: identity one way, all-reduce the other).
"""

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SHARDED = ("layer.encoder", "layer.encoder_v", "layer.decoder")


class _Enter(torch.autograd.Function):
    """Forward: the replicated input as it is. Backward: every rank's neurons add to its
    gradient, so the partial gradients are summed over the group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Sum(torch.autograd.Function):
    """Forward: the partial sums over this rank's neurons, summed over the group. Backward: the
    gradient is the same on every rank (what follows is replicated), and is each partial's."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: Any) -> torch.Tensor:
        total = partial.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class EnterNeurons(nn.Module):
    def __init__(self, group: Any):
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Enter.apply(x, self.group)


class SumNeurons(nn.Module):
    def __init__(self, group: Any):
        super().__init__()
        self.group = group

    def forward(self, partial: torch.Tensor) -> torch.Tensor:
        return _Sum.apply(partial, self.group)


def check_split(n_neurons: int, k: int) -> None:
    """One-line ValueError when N neurons per head cannot be split K ways (each rank's share must
    hold whole RoPE pairs)."""
    if k < 1 or n_neurons % (2 * k):
        raise ValueError(
            f"--neuron_parallel {k}: N={n_neurons} neurons per head must split into {k} even "
            f"shares (valid: divisors of {n_neurons // 2})"
        )


def neuron_span(n_neurons: int, k: int, index: int) -> tuple[int, int]:
    """(first, end) of the neurons of every head that share `index` of `k` holds."""
    share = n_neurons // k
    return index * share, (index + 1) * share


def split_neurons(model: nn.Module, group: Any, index: int, k: int) -> None:
    """Keep, in place, share `index` of `k` of every head's neurons of a whole BDH model (so every
    rank starts from the same weights as an unsplit model), and connect its layer to `group`,
    the K ranks that hold the shares."""
    config, layer = model.config, model.layer
    nh, D, N = config.n_head, config.n_embd, config.n_neurons
    check_split(N, k)
    first, end = neuron_span(N, k, index)
    with torch.no_grad():
        layer.encoder = nn.Parameter(layer.encoder[:, :, first:end].clone())
        layer.encoder_v = nn.Parameter(layer.encoder_v[:, :, first:end].clone())
        rows = layer.decoder.view(nh, N, D)[:, first:end].reshape(nh * (end - first), D)
        layer.decoder = nn.Parameter(rows.clone())
    for p in (layer.encoder, layer.encoder_v, layer.decoder):
        p.tensor_model_parallel = True  # DeepSpeed's gradient norm counts each shard once
    layer.attn.neurons = (first, end)
    layer.attn.freqs = layer.attn.frequencies(device=layer.attn.freqs.device)
    layer.enter_neurons, layer.sum_neurons = EnterNeurons(group), SumNeurons(group)
    model.neuron_parallel = (index, k)


def gather_neurons(tensors: dict[str, torch.Tensor], config: Any, group: Any, k: int) -> dict:
    """The whole model's tensors from every rank's share: the sharded ones gathered over `group`
    and put back in neuron order (replicated ones as they are). Every rank of the group calls it."""
    nh, D, N = config.n_head, config.n_embd, config.n_neurons
    whole = dict(tensors)
    for name in SHARDED:
        share = tensors[name].contiguous()
        shares = [torch.empty_like(share) for _ in range(k)]
        dist.all_gather(shares, share, group=group)
        if name.endswith("decoder"):
            whole[name] = torch.cat([s.view(nh, N // k, D) for s in shares], 1).view(nh * N, D)
        else:
            whole[name] = torch.cat(shares, dim=2)
    return whole
