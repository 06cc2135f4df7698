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

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META
from deepspeed.utils import groups
from torch import nn

from dragon.parallel.distributed import rank, world_size

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


def keep_share(model: nn.Module, index: int, k: int) -> None:
    """Keep, in place, share `index` of `k` of every head's neurons of a whole BDH model: the
    columns of `encoder` and `encoder_v`, the rows of `decoder`, the RoPE frequencies."""
    keep_layer_share(model.layer, model.config, index, k)


def keep_layer_share(layer: nn.Module, config: Any, index: int, k: int) -> None:
    """keep_share for the shared block itself (a BDHLayer, or a pipeline stage's copy of it); a
    pipeline's marks on the weights (ds_pipe_replicated) stay."""
    nh, D, N = config.n_head, config.n_embd, config.n_neurons
    check_split(N, k)
    first, end = neuron_span(N, k, index)
    replicated = getattr(layer.encoder, "ds_pipe_replicated", None)
    with torch.no_grad():
        layer.encoder = nn.Parameter(layer.encoder[:, :, first:end].clone())
        layer.encoder_v = nn.Parameter(layer.encoder_v[:, :, first:end].clone())
        rows = layer.decoder.view(nh, N, D)[:, first:end].reshape(nh * (end - first), D)
        layer.decoder = nn.Parameter(rows.clone())
    for p, cut in zip((layer.encoder, layer.encoder_v, layer.decoder), universal_cut(config)):
        p.tensor_model_parallel = True  # DeepSpeed's gradient norm counts each shard once
        setattr(p, DS_AUTOTP_UC_META, cut)
        if replicated is not None:
            p.ds_pipe_replicated = replicated
    layer.attn.neurons = (first, end)
    layer.attn.freqs = layer.attn.frequencies(device=layer.attn.freqs.device)


def universal_cut(config: Any) -> list[dict]:
    """How a share is cut from the whole encoder, encoder_v and decoder, in the terms of
    DeepSpeed's universal checkpoint loader (the share K' of a launch takes its own from a whole
    model's checkpoint): the last axis of (nh, D, N), and each head's rows of (nh N, D)."""
    nh, D, N = config.n_head, config.n_embd, config.n_neurons
    by_neuron = {"partition_dim": 2, "logical_shape": (nh, D, N)}
    by_head_rows = {"partition_dim": 0, "logical_shape": (nh * N, D), "sub_param_sizes": [N] * nh}
    return [by_neuron, dict(by_neuron), by_head_rows]


@contextlib.contextmanager
def universal_share_group(engine: Any) -> Iterator[None]:
    """While a ZeRO-3 engine of neuron shares loads a universal checkpoint: its neuron group as
    DeepSpeed's tensor-parallel group. ZeRO-3's loader cuts each rank's share of a whole
    parameter (universal_cut) over that group, which DeepSpeed sets only for its own AutoTP;
    ZeRO-1/2 read the same group from the engine's mpu."""
    mpu = getattr(engine, "mpu", None)
    if mpu is None or engine.zero_optimization_stage() != 3 or \
            groups._TENSOR_MODEL_PARALLEL_GROUP is not None:
        yield
        return
    groups._TENSOR_MODEL_PARALLEL_GROUP = mpu.get_tensor_model_parallel_group()
    try:
        yield
    finally:
        groups._TENSOR_MODEL_PARALLEL_GROUP = None


def split_neurons(model: nn.Module, group: Any, index: int, k: int) -> None:
    """Keep share `index` of `k` of a whole BDH model's neurons (so every rank starts from the
    same weights as an unsplit model) and connect its layer to `group`, the K ranks that hold
    the shares."""
    keep_share(model, index, k)
    connect_layer(model.layer, group)
    model.neuron_split = (group, k)


def connect_layer(layer: nn.Module, group: Any) -> None:
    """Where the split layer's N-wide part begins and ends, the collectives over `group`."""
    layer.enter_neurons = EnterNeurons(group)
    layer.sum_neurons = SumNeurons(group)


def whole_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict:
    """`tensors` (the model's, by name) as the whole model's: gathered over its neuron group when
    split_neurons split it (every rank of the group calls), as they are otherwise."""
    split = getattr(model, "neuron_split", None)
    return tensors if split is None else gather_neurons(tensors, model.config, *split)


def join_shares(shares: list[dict[str, torch.Tensor]], config: Any) -> dict:
    """The whole model's tensors from the K shares' (in share order): the sharded ones put back in
    neuron order, the replicated ones (and the RoPE frequencies, recomputed) from share 0."""
    nh, D, N = config.n_head, config.n_embd, config.n_neurons
    k = len(shares)
    whole = {name: t for name, t in shares[0].items() if not name.endswith("attn.freqs")}
    for name in (n for n in SHARDED if n in shares[0]):
        if name.endswith("decoder"):
            parts = [s[name].reshape(nh, N // k, D) for s in shares]
            whole[name] = torch.cat(parts, dim=1).reshape(nh * N, D)
        else:
            whole[name] = torch.cat([s[name] for s in shares], dim=2)
    return whole


def share_of(name: str, whole: torch.Tensor, config: Any, index: int, k: int) -> torch.Tensor:
    """Share `index` of `k` of the whole model's tensor `name` (a weight or an Adam moment of
    it): the inverse of join_shares. Replicated tensors are whole in every share."""
    nh, D, N = config.n_head, config.n_embd, config.n_neurons
    first, end = neuron_span(N, k, index)
    if name.endswith("attn.freqs"):
        return whole[..., first:end].contiguous()
    if name not in SHARDED:
        return whole
    if name.endswith("decoder"):
        return whole.reshape(nh, N, D)[:, first:end].reshape(nh * (end - first), D).clone()
    return whole[:, :, first:end].clone()


def split_grad_norm(model: nn.Module) -> float:
    """The whole model's gradient norm where split_neurons split it: the shards' squares summed
    over the group, the replicated gradients (the same on every rank of it) counted once."""
    group, _ = model.neuron_split
    shards, replicated = torch.zeros(1), torch.zeros(1)
    for p in model.parameters():
        if p.grad is not None:
            squares = p.grad.detach().float().pow(2).sum().cpu()
            if getattr(p, "tensor_model_parallel", False):
                shards += squares
            else:
                replicated += squares
    dist.all_reduce(shards, group=group)
    return float((shards + replicated).sqrt())


def gather_neurons(tensors: dict[str, torch.Tensor], config: Any, group: Any, k: int) -> dict:
    """The whole model's tensors from every rank's share, gathered over `group` (every rank of it
    calls)."""
    gathered = [dict(tensors) for _ in range(k)]
    for name in SHARDED:
        share = tensors[name].contiguous()
        parts = [torch.empty_like(share) for _ in range(k)]
        dist.all_gather(parts, share, group=group)
        for shares, part in zip(gathered, parts):
            shares[name] = part
    return join_shares(gathered, config)


class NeuronGroups:
    """The process groups of K-way neuron parallelism over this world of W ranks: neuron group g
    holds ranks gK..gK+K-1 (adjacent ranks, so a node that holds a multiple of K keeps its
    all-reduces local), data-parallel group j the ranks j, j+K, ... that hold the same share.
    DeepSpeed reads them through its `mpu` interface (the methods below): gradients are averaged
    and ZeRO partitions within a data-parallel group."""

    def __init__(self, k: int):
        world, me = dist.get_world_size(), dist.get_rank()
        self.k, self.index = k, me % k
        self.dp_rank, self.dp_world = me // k, world // k
        for g in range(self.dp_world):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(g * k, (g + 1) * k)))
            if g == self.dp_rank:
                self.neuron_group = group
        self.dp_ranks = []
        for j in range(k):
            ranks = list(range(j, world, k))
            group = dist.new_group(ranks)
            if j == self.index:
                self.dp_group, self.dp_ranks = group, ranks

    def split(self, model: nn.Module) -> None:
        split_neurons(model, self.neuron_group, self.index, self.k)

    def get_model_parallel_rank(self) -> int:
        return self.index

    def get_model_parallel_world_size(self) -> int:
        return self.k

    def get_model_parallel_group(self) -> Any:
        return self.neuron_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_world

    def get_data_parallel_group(self) -> Any:
        return self.dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_ranks


def split_model(model: nn.Module, k: int) -> tuple[Optional[NeuronGroups], int, int]:
    """--neuron_parallel K: its groups with `model` cut to this rank's share (None for K = 1, the
    model whole), and this rank's data-parallel rank and world."""
    if k == 1:
        return None, rank(), world_size()
    neurons = NeuronGroups(k)
    neurons.split(model)
    return neurons, neurons.dp_rank, neurons.dp_world
