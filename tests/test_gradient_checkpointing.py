"""Each BDH layer's training forward recomputed in the backward (transformers'
activation_checkpointing_enable over BDHLayer, torch's non-reentrant checkpoint) trains exactly as
without it: the model alone in every attention form, with and without a carried state.

Tolerance: losses within 1e-6 and gradients within 1e-6 of their largest entry. The recompute
runs the same operations on the same inputs, dropout masks included (the RNG state is
replayed), so the two agree to the bit here; 1e-6 leaves room for kernels that do not repeat
their sums exactly (some accelerators' atomics)."""

import pytest
import torch

from dragon import BDHConfig, BDHForCausalLM
from dragon.model.attention import BDHCache

SMALL = dict(n_layer=3, n_embd=32, n_head=2, mlp_internal_dim_multiplier=8, vocab_size=256,
             dropout=0.1)
EXACT = 1e-6


def model_in(form: str) -> BDHForCausalLM:
    torch.manual_seed(0)
    return BDHForCausalLM(BDHConfig(**SMALL, attention=form, attention_chunk_size=8)).train()


def losses_and_grads(model: BDHForCausalLM, ids: torch.Tensor, carried: bool):
    """The losses and parameter gradients of one training forward and backward (dropout on), and
    how many times the attention ran. `carried`: two halves, the second continuing the state the
    first left (as --carry_state trains), its states returned too."""
    model.zero_grad()
    torch.manual_seed(1)  # the same dropout masks in both runs
    calls = []
    hook = model.layer.attn.register_forward_pre_hook(lambda *_: calls.append(1))
    if carried:
        cache, half = BDHCache(model.config.n_layer), ids.size(1) // 2
        first = model(ids[:, :half], labels=ids[:, :half], cache=cache).loss
        cache.detach_()
        second = model(ids[:, half:], labels=ids[:, half:], cache=cache).loss
        found, states = [first, second], cache.states
    else:
        found, states = [model(ids, labels=ids).loss], []
    sum(found).backward()
    hook.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return [loss.item() for loss in found], grads, len(calls), states


@pytest.mark.parametrize("carried", [False, True], ids=["fresh", "carried_state"])
@pytest.mark.parametrize("form,T", [("quadratic", 40), ("chunked", 40), ("chunked", 29),
                                    ("recurrent", 19), ("auto", 40)])
def test_recomputed_layers_train_as_stored_ones(form, T, carried):
    """In every attention form (the chunked one over several chunks, whole or not), fresh or
    continuing a carried state: the same losses, gradients and outgoing states, while the
    attention runs once more per layer (its recompute in the backward)."""
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(2))
    model = model_in(form)
    stored = losses_and_grads(model, ids, carried)
    model.activation_checkpointing_enable({"use_reentrant": False})
    assert model.is_activation_checkpointing
    recomputed = losses_and_grads(model, ids, carried)
    assert recomputed[0] == pytest.approx(stored[0], abs=EXACT)
    for name, grad in stored[1].items():
        scale = grad.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(recomputed[1][name], grad, rtol=0, atol=EXACT * scale,
                                   msg=name)
    for state, expected in zip(recomputed[3], stored[3]):
        torch.testing.assert_close(state, expected, rtol=0, atol=EXACT)
    n = model.config.n_layer * (2 if carried else 1)
    assert (stored[2], recomputed[2]) == (n, 2 * n)


def test_evaluation_and_generation_are_not_recomputed():
    """Without gradients (evaluation, generate()) a checkpointed model runs each layer once and
    keeps its state cache."""
    model = model_in("auto")
    model.activation_checkpointing_enable({"use_reentrant": False})
    calls = []
    model.layer.attn.register_forward_pre_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 5) and len(calls) == 2 * model.config.n_layer
