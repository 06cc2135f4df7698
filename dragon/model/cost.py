"""Theoretical cost of BDH: parameters and FLOPs per token of each attention form, for MFU."""

from dataclasses import dataclass

from dragon.model.attention import CAUSAL_BLOCK, resolve_form, row_blocks
from dragon.model import baseline
from dragon.model.baseline import is_bdh
from dragon.model.bdh import BDHConfig


@dataclass(frozen=True)
class ModelProfile:
    parameters: int
    forward_flops_per_token: float
    backward_flops_per_token: float

    @property
    def train_flops_per_token(self) -> float:
        return self.forward_flops_per_token + self.backward_flops_per_token


def parameter_count(config: BDHConfig) -> int:
    """encoder + encoder_v + decoder (shared by all layers) + embed + lm_head; independent of
    n_layer.
    """
    nh, D, N, V = config.n_head, config.n_embd, config.n_neurons, config.vocab_size
    return 3 * nh * D * N + 2 * V * D


def causal_pairs(T: int, block: int = CAUSAL_BLOCK) -> int:
    """(row, column) score pairs the quadratic form computes for T positions: all T x T up to
    one block, else each block of rows against the positions up to its end."""
    if T <= block:
        return T * T
    return sum((end - start) * end for start, end in row_blocks(T, block))


def attention_macs_per_token(config: BDHConfig, seq_len: int, form: str = "") -> float:
    """Multiply-adds per token and layer of one attention form as computed, over seq_len positions.

    quadratic: the score pairs computed (causal_pairs), each a dot over N and a product with V.
    chunked (chunk C, T padded up to whole chunks): the quadratic form inside each chunk, plus
    each chunk's state write and state read (N x D per position each).
    recurrent: one state read and one write per position.
    """
    nh, D, N, T = config.n_head, config.n_embd, config.n_neurons, seq_len
    C = config.attention_chunk_size
    form = resolve_form(form or config.attention, T, C, has_state=False)
    if form == "chunked" and T > C:
        chunks = -(-T // C)
        return nh * chunks * (causal_pairs(C) * (N + D) + 2 * C * N * D) / T
    if form == "recurrent":
        return 2 * nh * N * D
    return nh * causal_pairs(T) * (N + D) / T


def model_profile(config: BDHConfig, seq_len: int, form: str = "") -> ModelProfile:
    """FLOPs per token at sequence length seq_len (2 FLOPs per multiply-add) for `form` (default:
    the config's, "auto" resolved for seq_len), without a returned state.

    Per layer and token: encoder, encoder_v and decoder matmuls (3 * nh*D*N MACs) and the
    attention (attention_macs_per_token); plus the lm_head (D*V MACs). Backward costs twice the
    forward.
    """
    if not is_bdh(config):
        return transformer_profile(config, seq_len)
    nh, D, N, V = config.n_head, config.n_embd, config.n_neurons, config.vocab_size
    per_layer = 3 * nh * D * N + attention_macs_per_token(config, seq_len, form)
    forward = 2.0 * (config.n_layer * per_layer + D * V)
    return ModelProfile(parameter_count(config), forward, 2.0 * forward)


def transformer_profile(config, seq_len: int) -> ModelProfile:
    """A --model_type baseline's FLOPs per token: one multiply-add for every weight of a matmul
    (not the embedding tables, biases or norm scales, whose elementwise work is not counted, as
    BDH's LayerNorms are not), plus causal attention's scores and weighted sum over on average
    half of seq_len positions per layer; backward twice the forward."""
    D, L = config.hidden_size, config.num_hidden_layers
    forward = 2.0 * (baseline.matmul_weight_count(config) + L * seq_len * D)
    return ModelProfile(baseline.parameter_count(config), forward, 2.0 * forward)
