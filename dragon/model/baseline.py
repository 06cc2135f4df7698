"""A transformer baseline through the same recipe: transformers' own GPT-2 or Llama.

dragon only sizes it and wires it in; the data, schedule, metrics, checkpoints and export of the
ZeRO recipe are the same as BDH's. Sizes come from the size flags (--n_layer, --n_embd,
--n_head), or with --match_params the width is chosen so that the parameter count is nearest the
BDH those flags describe. The output embedding is untied, as BDH's is.
"""

from typing import Any

import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PretrainedConfig

BASELINES = ("gpt2", "llama")


def is_bdh(config: Any) -> bool:
    return getattr(config, "model_type", "") == "bdh"


def baseline_config(model_type: str, vocab_size: int, positions: int, n_layer: int, n_embd: int,
                    n_head: int, dropout: float) -> PretrainedConfig:
    """GPT-2 (learned positions, GELU MLP of 4 x width) or Llama (RoPE, SwiGLU MLP of about
    8/3 x width rounded to a multiple of 8) of these sizes; ValueError for sizes it cannot have."""
    if n_embd % n_head:
        raise ValueError(f"--model_type {model_type}: --n_embd {n_embd} is not divisible by "
                         f"--n_head {n_head}")
    if model_type == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_positions=positions, n_embd=n_embd,
                          n_layer=n_layer, n_head=n_head, resid_pdrop=dropout, embd_pdrop=dropout,
                          attn_pdrop=dropout, bos_token_id=None, eos_token_id=None,
                          tie_word_embeddings=False)
    if model_type == "llama":
        if (n_embd // n_head) % 2:
            raise ValueError(f"--model_type llama: a head of {n_embd // n_head} dimensions cannot "
                             "be rotated in pairs (RoPE); make n_embd / n_head even")
        return LlamaConfig(vocab_size=vocab_size, hidden_size=n_embd,
                           intermediate_size=-(-8 * n_embd // 3 // 8) * 8,
                           num_hidden_layers=n_layer, num_attention_heads=n_head,
                           num_key_value_heads=n_head, max_position_embeddings=positions,
                           attention_dropout=dropout, bos_token_id=None, eos_token_id=None,
                           tie_word_embeddings=False)
    raise ValueError(f"--model_type {model_type!r}: valid are bdh, {', '.join(BASELINES)}")


def parameter_count(config: PretrainedConfig) -> int:
    """The parameters of the model `config` describes (counted on the meta device)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def matmul_weight_count(config: PretrainedConfig) -> int:
    """The weights that multiply activations in a matmul: every Linear's (and GPT-2's Conv1D's)
    matrix, so not the embedding tables, biases or norm scales."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in tables)


def matched_config(model_type: str, target: int, vocab_size: int, positions: int, n_layer: int,
                   n_head: int, dropout: float) -> PretrainedConfig:
    """The config of n_layer layers and n_head heads whose width (a multiple of 2 x n_head) gives
    the parameter count nearest `target`."""
    step, best = 2 * n_head, None
    for width in range(step, 64 * 1024, step):
        config = baseline_config(model_type, vocab_size, positions, n_layer, width, n_head,
                                 dropout)
        gap = abs(parameter_count(config) - target)
        if best is not None and gap > best[0]:  # the count only grows with the width
            break
        best = (gap, config)
    return best[1]
