"""BDH ("Baby Dragon Hatchling") as a Hugging Face causal LM. Knows nothing of DeepSpeed.

The math is the reference's (pathwaycom/bdh, bdh.py): one block of weights (`encoder`,
`encoder_v`, `decoder`) shared by every layer, linear attention without softmax over
RoPE-rotated sparse activations, strictly causal, LayerNorm without affine parameters.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from dragon.model.attention import (
    DEFAULT_CHUNK_SIZE,
    FORMS,
    BDHCache,
    attention,
    rope,
    rope_frequencies,
    rope_rotation,
)


class BDHConfig(PretrainedConfig):
    """The reference's hyper-parameters and defaults (25,296,896 parameters)."""

    model_type = "bdh"
    # generate() sizes its cache from num_hidden_layers; BDH calls it n_layer.
    attribute_map = {
        "num_hidden_layers": "n_layer",
        "hidden_size": "n_embd",
        "num_attention_heads": "n_head",
    }

    def __init__(
        self,
        n_layer: int = 6,
        n_embd: int = 256,
        n_head: int = 4,
        mlp_internal_dim_multiplier: int = 128,
        dropout: float = 0.1,
        vocab_size: int = 256,
        attention: str = "auto",
        attention_chunk_size: int = DEFAULT_CHUNK_SIZE,
        use_cache: bool = True,
        **kwargs,
    ):
        self.n_layer = n_layer
        self.n_embd = n_embd
        self.n_head = n_head
        self.mlp_internal_dim_multiplier = mlp_internal_dim_multiplier
        self.dropout = dropout
        self.vocab_size = vocab_size
        self.attention = attention
        self.attention_chunk_size = attention_chunk_size
        self.use_cache = use_cache  # generate() carries the state cache
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
        self.validate_sizes()

    @property
    def n_neurons(self) -> int:
        """N, the sparse width per head."""
        return self.mlp_internal_dim_multiplier * self.n_embd // self.n_head

    def validate_sizes(self) -> None:
        """One-line errors for sizes BDH cannot be built with."""
        for name in ("n_layer", "n_embd", "n_head", "mlp_internal_dim_multiplier", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BDHConfig.{name}={value!r}: must be a positive integer")
        if (self.mlp_internal_dim_multiplier * self.n_embd) % self.n_head:
            product = self.mlp_internal_dim_multiplier * self.n_embd
            raise ValueError(
                f"BDHConfig: mlp_internal_dim_multiplier*n_embd={product}"
                f" is not divisible by n_head={self.n_head}"
            )
        if self.n_neurons % 2:
            raise ValueError(f"BDHConfig: N={self.n_neurons} must be even (RoPE rotates pairs)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"BDHConfig.dropout={self.dropout}: must be in [0, 1)")
        if self.attention not in FORMS:
            raise ValueError(
                f"BDHConfig.attention={self.attention!r}: valid are {', '.join(FORMS)}"
            )
        chunk = self.attention_chunk_size
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(
                f"BDHConfig.attention_chunk_size={chunk!r}: must be a positive integer"
            )


class Attention(nn.Module):
    """Linear attention: Q = K = rope(x_sparse), V = x, strictly causal, in the configured form."""

    def __init__(self, config: BDHConfig):
        super().__init__()
        self.n = config.n_neurons
        self.neurons = (0, self.n)  # the neurons held here: all, or a slice (neuron parallelism)
        self.config = config  # the form is read at every call, so it can be switched on a model
        self.register_buffer("freqs", self.frequencies())

    def frequencies(self, device=None) -> torch.Tensor:
        """RoPE's frequencies of the neurons held here, in fp32."""
        start, stop = self.neurons
        return rope_frequencies(self.n, device=device)[..., start:stop].contiguous()

    def _apply(self, fn, recurse=True):
        # A cast of the module (model.bfloat16(), DeepSpeed's bf16 engine) must not round the
        # frequencies: recompute them in fp32 on whatever device the cast moved them to.
        super()._apply(fn, recurse)
        self.freqs = self.frequencies(device=self.freqs.device)
        return self

    def rotation(self, position: int, T: int) -> torch.Tensor:
        """RoPE's rotation of positions position..position+T-1 (shared by a forward's layers)."""
        return rope_rotation(self.freqs, position, T)

    def forward(
        self,
        x_sparse: torch.Tensor,
        v: torch.Tensor,
        state: Optional[torch.Tensor] = None,
        position: int = 0,
        return_state: bool = False,
        rotation: Optional[torch.Tensor] = None,
    ):
        """(B, nh, T, N), (B, 1, T, D) -> (B, nh, T, D); with return_state also the state after
        the last position. `state` is what positions before `position` wrote; `rotation`, when
        given, is self.rotation(position, T)."""
        if rotation is None:
            rotation = self.rotation(position, x_sparse.size(-2))
        q = rope(rotation, x_sparse)
        return attention(
            q, v, self.config.attention, self.config.attention_chunk_size, state, return_state
        )


class BDHLayer(GradientCheckpointingLayer):
    """The weights every layer shares, and one layer's forward on x of shape (B, 1, T, D).

    A GradientCheckpointingLayer: after model.activation_checkpointing_enable() each call of a
    training forward keeps only its inputs and is recomputed in the backward (transformers wraps
    `forward`). The forward is a function of its arguments (the state it continues goes in and
    comes out; nothing is written in place with autograd on), so the recompute repeats it exactly,
    dropout masks too (torch's checkpoint restores the RNG state)."""

    def __init__(self, config: BDHConfig):
        super().__init__()
        nh, D, N = config.n_head, config.n_embd, config.n_neurons
        self.encoder = nn.Parameter(torch.zeros(nh, D, N))
        self.encoder_v = nn.Parameter(torch.zeros(nh, D, N))
        self.decoder = nn.Parameter(torch.zeros(nh * N, D))
        self.attn = Attention(config)
        self.sparse = nn.ReLU()  # a module, so a hook can count what fires (model.sparsity)
        self.drop = nn.Dropout(config.dropout)
        # Where the N-wide part begins and ends. Identities here; when ranks split the neurons
        # (dragon.parallel.neurons) they become the collectives: what enters is used by every
        # rank's neurons, and what leaves is a sum over neurons, so it sums over ranks.
        self.enter_neurons = nn.Identity()
        self.sum_neurons = nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        state: Optional[torch.Tensor] = None,
        position: int = 0,
        return_state: bool = False,
        rotation: Optional[torch.Tensor] = None,
    ):
        """x (B, 1, T, D) -> the next x; with return_state also this layer's attention state.
        `rotation` (self.attn.rotation(position, T)) is computed once for all layers by callers
        that run several."""
        x_in = self.enter_neurons(x)
        x_sparse = self.sparse(x_in @ self.encoder)  # (B, nh, T, N)
        attn = self.attn(x_sparse, x_in, state, position, return_state, rotation)
        attn, state = attn if return_state else (attn, None)
        y_kv = layer_norm(self.sum_neurons(attn))  # (B, nh, T, D)
        y_sparse = self.sparse(self.enter_neurons(y_kv) @ self.encoder_v)
        xy_sparse = self.drop(x_sparse * y_sparse)
        x = layer_norm(x + layer_norm(self.sum_neurons(self.decode(xy_sparse))))
        return (x, state) if return_state else x

    def decode(self, xy_sparse: torch.Tensor) -> torch.Tensor:
        """(B, nh, T, N) -> (B, 1, T, D): each head's neurons through its rows of the decoder,
        summed over heads. Batched over heads, with no (B, T, nh*N) copy of the activations.
        One position without autograd (a generation step) on the CPU reads only the rows of the
        neurons that fired: x_sparse * y_sparse is sparse, and a step is bound by memory traffic.
        (On an accelerator, finding the fired rows would wait for the device at every layer.)"""
        B, nh, T, N = xy_sparse.shape
        if T == 1 and not torch.is_grad_enabled() and xy_sparse.device.type == "cpu":
            return fired_rows(xy_sparse.view(B, nh * N), self.decoder).view(B, 1, 1, -1)
        return (xy_sparse @ self.decoder.view(nh, N, -1)).sum(dim=1, keepdim=True)


def fired_rows(activations: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """activations (B, K) @ weight (K, M) summed over the nonzero activations only: one
    embedding bag per row of the batch, each of weight's rows weighted by its activation."""
    K, flat = activations.size(1), activations.reshape(-1)
    fired = flat.nonzero().squeeze(1)  # b * K + k, in order
    offsets = torch.searchsorted(fired, torch.arange(0, flat.numel(), K, device=flat.device))
    return F.embedding_bag(fired % K, weight, offsets, mode="sum", per_sample_weights=flat[fired])


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    """LayerNorm over the last dim with no affine parameters, as the reference."""
    return F.layer_norm(x, (x.size(-1),))


def embed_tokens(embed: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) ids -> (B, 1, T, D) normalised embeddings."""
    return layer_norm(embed(input_ids)).unsqueeze(1)


def lm_logits(x: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, D) -> (B, T, vocab) logits."""
    B, _, T, D = x.shape
    return x.view(B, T, D) @ lm_head


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's convention: labels are the input ids, shifted here; -100 is ignored."""
    shift_logits = logits[..., :-1, :].float()
    shift_labels = labels[..., 1:].to(logits.device)
    return F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1), ignore_index=-100
    )


class BDHPreTrainedModel(PreTrainedModel):
    config_class = BDHConfig
    base_model_prefix = "bdh"
    main_input_name = "input_ids"
    _no_split_modules = ["BDHLayer"]
    # Each of the n_layer calls of the shared block is recomputed on its own (BDHLayer).
    supports_gradient_checkpointing = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # The reference draws every weight from normal(0, 0.02); no biases anywhere.
        if isinstance(module, BDHLayer):
            for p in (module.encoder, module.encoder_v, module.decoder):
                p.normal_(0.0, 0.02)
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, 0.02)
        elif isinstance(module, BDHForCausalLM):
            module.lm_head.normal_(0.0, 0.02)


class BDHForCausalLM(BDHPreTrainedModel, GenerationMixin):
    """BDH with the reference's parameters: embed, one shared layer block, untied lm_head."""

    def __init__(self, config: BDHConfig):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.layer = BDHLayer(config)
        self.lm_head = nn.Parameter(torch.zeros(config.n_embd, config.vocab_size))
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        logits_to_keep: int = 0,
        cache: Optional[BDHCache] = None,
        past_key_values: Optional[BDHCache] = None,
        use_cache: Optional[bool] = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits (and the loss with labels). With a cache, input_ids continue the stream it holds.

        `cache` and `past_key_values` are the same argument (transformers' new and old names).
        use_cache defaults to whether a cache was given: a state is n_head x N x D fp32 numbers per
        layer and sequence, so it is built only when asked for (generate() asks, by
        config.use_cache).
        attention_mask is accepted for generate(); BDH has no padding support, as the reference.
        """
        cache = cache if cache is not None else past_key_values
        if use_cache is None:
            use_cache = cache is not None
        if use_cache and cache is None:
            cache = BDHCache(self.config.n_layer)
        x = embed_tokens(self.embed, input_ids)
        position = cache.position if use_cache else 0
        rotation = self.layer.attn.rotation(position, input_ids.size(1))
        if use_cache:
            for i in range(self.config.n_layer):
                x, cache.states[i] = self.layer(x, cache.states[i], position, True, rotation)
            cache.position += input_ids.size(1)
        else:
            for _ in range(self.config.n_layer):
                x = self.layer(x, rotation=rotation)
        logits = lm_logits(x, self.lm_head)
        loss = causal_lm_loss(logits, labels) if labels is not None else None
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.Tensor,
        cache: Optional[BDHCache] = None,
        use_cache: bool = True,
        **kwargs,
    ) -> dict:
        """With the state cache only the positions it has not seen go in (the whole prompt first,
        then one token per step); without it every step reruns the whole sequence."""
        cache = cache if cache is not None else kwargs.get("past_key_values")
        if not use_cache:
            return {"input_ids": input_ids, "use_cache": False}
        if cache is None:
            cache = BDHCache(self.config.n_layer)
        return {"input_ids": input_ids[:, cache.position :], "cache": cache, "use_cache": True}

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate() must not build a DynamicCache: the state cache is made above
