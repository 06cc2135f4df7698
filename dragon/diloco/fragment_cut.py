"""Streaming DiLoCo's cut of the weights into F fragments (dragon.diloco.outer). BDH's layers
share one block of weights, so a fragment is a set of neurons, not of layers as in the paper:
neuron n of every head is in fragment n mod F, with all it reads and writes in `encoder`,
`encoder_v` and `decoder`. Interleaving makes the cut the same for every --neuron_parallel K, each
rank (a run of N/K neurons) holding 1/F of every fragment. `embed` and `lm_head` are cut along the
vocabulary, so fragments are equal in size (peak bandwidth 1/F); other parameters (the transformer
baselines) into F equal runs. Under ZeRO each rank holds its partition's share of every fragment."""

import math

import torch

NEURON_SLICED = ("encoder", "encoder_v")  # (nh, D, N): the neuron is the last index
NEURON_ROWS = "decoder"  # (nh N, D): row h N + n is neuron n of head h
VOCAB_ROWS = "embed.weight"  # (V, D)
VOCAB_COLUMNS = "lm_head"  # (D, V)


INTERLEAVED, RUNS = "interleaved", "runs"  # neuron n in fragment n mod F, or n F / N (older states)


def element_fragments(name: str, shape: tuple, start: int, numel: int, neurons: int,
                      fragments: int, cut: str = INTERLEAVED) -> torch.Tensor:
    """The fragment of each of `numel` values of parameter `name` (of `shape`) from flattened
    offset `start` on, as int8 (`neurons`: per head on this rank)."""
    e = torch.arange(start, start + numel, dtype=torch.int64)
    leaf = name.split(".")[-1]
    if leaf in NEURON_SLICED or leaf == NEURON_ROWS:
        neuron = e % shape[-1] if leaf in NEURON_SLICED else (e // shape[-1]) % neurons
        if cut == INTERLEAVED:  # a share of N/K neurons starts at a multiple of F
            return (neuron % fragments).to(torch.int8)
        unit, units = neuron, neurons
    elif name.endswith(VOCAB_ROWS):
        unit, units = e // shape[-1], shape[0]
    elif leaf == VOCAB_COLUMNS:
        unit, units = e % shape[-1], shape[-1]
    else:
        unit, units = e, math.prod(shape)
    return (unit * fragments // units).to(torch.int8)


def fragment_ids(segments: list, shapes: dict, numels: list[int], fragments: int,
                 cut: str = INTERLEAVED) -> torch.Tensor:
    """The fragment of every value of this rank's master tensors, as one int8 vector (`segments`:
    dragon.parallel.master_weights.MasterWeights.segments; padding is in fragment 0)."""
    neurons = next((s[-1] for n, s in shapes.items() if n.split(".")[-1] == "encoder"), 1)
    ids = torch.zeros(sum(numels), dtype=torch.int8)
    base = 0
    for pieces, numel in zip(segments, numels):
        for name, at, offset, count in pieces:
            ids[base + offset:base + offset + count] = element_fragments(
                name, shapes[name], at, count, neurons, fragments, cut)
        base += numel
    return ids
