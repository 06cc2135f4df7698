"""Streaming DiLoCo's cut of the weights into F fragments (dragon.diloco.outer).

The cut. BDH's layers share one block of weights, so a fragment cannot be a set of layers (the
paper's choice). A fragment here is a set of neurons: neuron n of every head is in fragment
n mod F, with its columns of `encoder` and `encoder_v` (nh, D, N) and its rows of `decoder`
(nh N, D); everything one neuron reads and writes travels together. Interleaved, not in runs,
so that the ranks that split the neurons (--neuron_parallel K, each holding a run of N/K) each
hold 1/F of every fragment and the cut is the same for every K: an island of K shares syncs
what an unsplit island syncs, each rank sending 1/K of it. `embed` (V, D) and `lm_head`
(D, V) are cut the same way along the vocabulary, tokens [f V/F, (f+1) V/F): every fragment is
then the same size (peak bandwidth 1/F of the whole) and each still holds whole units of the
model. A parameter BDH does not have (the transformer baselines) is cut into F equal runs of its
flattened values. Under ZeRO each rank holds its partition's share of every fragment, the same
share on every island.
"""

import math

import torch

NEURON_SLICED = ("encoder", "encoder_v")  # (nh, D, N): the neuron is the last index
NEURON_ROWS = "decoder"  # (nh N, D): row h N + n is neuron n of head h
VOCAB_ROWS = "embed.weight"  # (V, D)
VOCAB_COLUMNS = "lm_head"  # (D, V)


INTERLEAVED, RUNS = "interleaved", "runs"  # neuron n in fragment n mod F, or n F / N (older)


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
    """The fragment of every value of this rank's master tensors, one int8 vector over them all
    (dragon.parallel.master_weights.MasterWeights.segments says where each piece sits; padding
    belongs to fragment 0)."""
    neurons = next((s[-1] for n, s in shapes.items() if n.split(".")[-1] == "encoder"), 1)
    ids = torch.zeros(sum(numels), dtype=torch.int8)
    base = 0
    for pieces, numel in zip(segments, numels):
        for name, at, offset, count in pieces:
            ids[base + offset:base + offset + count] = element_fragments(
                name, shapes[name], at, count, neurons, fragments, cut)
        base += numel
    return ids
