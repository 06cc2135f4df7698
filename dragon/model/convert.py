"""Weights of the reference implementation (pathwaycom/bdh, bdh.py) <-> BDHForCausalLM.

The reference saves `torch.save(model.state_dict())` with the keys in REFERENCE_KEYS (a
torch.compile'd reference adds an `_orig_mod.` prefix). Our model holds the shared block
under `layer.`; everything else has the same name, shape and meaning.
"""

import torch

from dragon.model.bdh import BDHConfig, BDHForCausalLM, rope_frequencies

COMPILE_PREFIX = "_orig_mod."

# reference key -> our key
KEY_MAP = {
    "encoder": "layer.encoder",
    "encoder_v": "layer.encoder_v",
    "decoder": "layer.decoder",
    "attn.freqs": "layer.attn.freqs",
    "embed.weight": "embed.weight",
    "lm_head": "lm_head",
}
REFERENCE_KEYS = tuple(KEY_MAP)


def reference_shapes(config: BDHConfig) -> dict[str, tuple]:
    """The shape of every reference tensor for this config."""
    nh, D, N, V = config.n_head, config.n_embd, config.n_neurons, config.vocab_size
    return {
        "encoder": (nh, D, N),
        "encoder_v": (nh, D, N),
        "decoder": (nh * N, D),
        "attn.freqs": (1, 1, 1, N),
        "embed.weight": (V, D),
        "lm_head": (D, V),
    }


def _sizes(config: BDHConfig) -> str:
    return (
        f"n_head={config.n_head} n_embd={config.n_embd} N={config.n_neurons}"
        f" vocab_size={config.vocab_size}"
    )


def model_from_reference(state_dict: dict, config: BDHConfig) -> BDHForCausalLM:
    """Build an fp32 BDHForCausalLM holding the reference's weights; ValueError on any mismatch."""
    sd = {k.removeprefix(COMPILE_PREFIX): v for k, v in state_dict.items()}
    shapes = reference_shapes(config)
    for key, expected in shapes.items():
        if key not in sd:
            raise ValueError(
                f"reference state dict: missing key '{key}' (expected shape {expected}"
                f" for {_sizes(config)})"
            )
        if not isinstance(sd[key], torch.Tensor):
            raise ValueError(f"reference state dict: key '{key}' holds a {type(sd[key]).__name__}")
        got = tuple(sd[key].shape)
        if got != expected:
            raise ValueError(
                f"reference state dict: key '{key}' has shape {got}, expected {expected}"
                f" for {_sizes(config)}"
            )
    extra = sorted(set(sd) - set(shapes))
    if extra:
        raise ValueError(f"reference state dict: unexpected keys {extra}")
    # Our Attention recomputes the frequencies on every cast/move, so different ones would be
    # silently replaced: refuse them instead.
    if not torch.allclose(sd["attn.freqs"].float(), rope_frequencies(config.n_neurons), rtol=1e-6):
        raise ValueError("reference state dict: 'attn.freqs' differ from RoPE's for theta=2**16")

    model = BDHForCausalLM(config).float()
    ours = {KEY_MAP[k]: v.detach().to(device="cpu", dtype=torch.float32) for k, v in sd.items()}
    model.load_state_dict(ours, strict=True)
    return model.eval()


def reference_state_dict(model: BDHForCausalLM) -> dict:
    """Our model's weights in the reference's layout (copies, on the model's device and dtype)."""
    ours = model.state_dict()
    return {ref: ours[key].detach().clone() for ref, key in KEY_MAP.items()}
