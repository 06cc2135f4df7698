"""Theoretical cost of BDH: parameters and FLOPs per token, for MFU."""

from dataclasses import dataclass

from dragon.model import BDHConfig


@dataclass(frozen=True)
class ModelProfile:
    parameters: int
    forward_flops_per_token: float
    backward_flops_per_token: float

    @property
    def train_flops_per_token(self) -> float:
        return self.forward_flops_per_token + self.backward_flops_per_token


def parameter_count(config: BDHConfig) -> int:
    """encoder + encoder_v + decoder (shared by all layers) + embed + lm_head; independent of n_layer."""
    nh, D, N, V = config.n_head, config.n_embd, config.n_neurons, config.vocab_size
    return 3 * nh * D * N + 2 * V * D


def model_profile(config: BDHConfig, seq_len: int) -> ModelProfile:
    """FLOPs per token of the quadratic form at sequence length seq_len (2 FLOPs per multiply-add).

    Per layer and token: encoder, encoder_v and decoder matmuls (3 * nh*D*N MACs), attention
    scores and output over the full T x T product as computed (nh*T*(N+D) MACs; the causal mask
    does not skip work); plus the lm_head (D*V MACs). Backward costs twice the forward.
    """
    nh, D, N, V = config.n_head, config.n_embd, config.n_neurons, config.vocab_size
    per_layer = 3 * nh * D * N + nh * seq_len * (N + D)
    forward = 2.0 * (config.n_layer * per_layer + D * V)
    return ModelProfile(parameter_count(config), forward, 2.0 * forward)
