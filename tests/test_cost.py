"""dragon.model.cost against an independent count: torch's FlopCounterMode on one forward and
backward, per token, within 2 % (TOLERANCE) for GPT-2, Llama and BDH in each attention form."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from dragon import BDHConfig, BDHForCausalLM
from dragon.model.baseline import baseline_config
from dragon.model.cost import model_profile

TOLERANCE = 0.02  # relative, of the counter's FLOPs per token


def counted_flops_per_token(model: torch.nn.Module, seq_len: int, batch: int = 2) -> dict:
    """FlopCounterMode's FLOPs per token of one forward and backward, by aten op."""
    ids = torch.randint(0, 256, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=ids).loss.backward()
    return {str(op): n / (batch * seq_len) for op, n in counter.get_flop_counts()["Global"].items()}


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
@pytest.mark.parametrize("width", [64, 128])
def test_transformer_flops_match_counter(model_type, width):
    seq_len = 257  # a recipe's block of 256 plus its target
    config = baseline_config(model_type, 256, seq_len, 2, width, 4, 0.0)
    # Eager attention: its scores and weighted sum are plain bmm the counter sees (the CPU SDPA
    # kernel is not in its table). They cover all T x T pairs, the masked half too; cost.py counts
    # the causal half, the work a causal kernel does, as it counts BDH's computed pairs.
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    ops = counted_flops_per_token(model, seq_len)
    attention = ops.pop("aten.bmm")
    counted = sum(ops.values()) + attention / 2
    expected = model_profile(config, seq_len).train_flops_per_token
    assert expected == pytest.approx(counted, rel=TOLERANCE)


@pytest.mark.parametrize("form,seq_len", [("quadratic", 257), ("chunked", 300),
                                          ("recurrent", 40)])
def test_bdh_flops_match_counter(form, seq_len):
    config = BDHConfig(n_layer=2, n_embd=64, n_head=2, mlp_internal_dim_multiplier=8,
                       dropout=0.0, attention=form, attention_chunk_size=64)
    counted = sum(counted_flops_per_token(BDHForCausalLM(config), seq_len).values())
    expected = model_profile(config, seq_len).train_flops_per_token
    assert expected == pytest.approx(counted, rel=TOLERANCE)
