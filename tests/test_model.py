"""BDHForCausalLM against an independent plain implementation of the reference (pathwaycom/bdh).

The `ref_*` functions below are written from the BDH definition only (reference state-dict
layout, plain tensors); they import nothing from dragon.model.bdh. Tiny sizes, fp32, CPU.

Tolerances:
- fp32 logits vs the plain implementation: atol=rtol=1e-5. Same math, only the summation order
  of matmul/einsum differs (~1e-7 relative in fp32); logits are O(0.1-1).
- recurrent vs quadratic attention: float64 activations (the phases stay fp32 in both), rtol=1e-10;
  fp32 rtol=1e-4 (sums of up to T*N products of O(1) terms, accumulated in different orders).
- bf16 vs fp32 logits: relative L2 error < 5e-2 (measured ~6e-3: bf16 has 8 mantissa bits and
  the error compounds over the layers; 5e-2 still catches a wrong RoPE or a missing LayerNorm).
"""

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from dragon.model.convert import (
    REFERENCE_KEYS,
    model_from_reference,
    reference_shapes,
    reference_state_dict,
)
from dragon.model.bdh import BDHConfig, BDHForCausalLM
from dragon.model.cost import model_profile, parameter_count

REPO = Path(__file__).resolve().parents[1]
TINY = dict(n_layer=3, n_embd=32, n_head=2, mlp_internal_dim_multiplier=8, vocab_size=256)
FP32 = dict(atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- independent implementation


def ref_freqs(n: int) -> torch.Tensor:
    """1/(theta^(q(i)/n))/(2pi), q(i) = 2*floor(i/2), theta = 2**16, fp32, shape (n,)."""
    q = torch.tensor([2 * (i // 2) for i in range(n)], dtype=torch.float32)
    return 1.0 / (2.0**16) ** (q / n) / (2 * math.pi)


def ref_rope(v: torch.Tensor) -> torch.Tensor:
    """Rotate (..., T, N): pair (v[2k], v[2k+1]) -> (-v[2k+1], v[2k]); out = v*cos + v_rot*sin."""
    T, N = v.shape[-2:]
    phase = (torch.arange(T, dtype=torch.float32)[:, None] * ref_freqs(N)) % 1 * (2 * math.pi)
    v_rot = torch.empty_like(v)
    v_rot[..., 0::2] = -v[..., 1::2]
    v_rot[..., 1::2] = v[..., 0::2]
    return (v * torch.cos(phase)).to(v.dtype) + (v_rot * torch.sin(phase)).to(v.dtype)


def ref_attention(x_sparse: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Quadratic form: Q = K = rope(x_sparse), scores strictly causal, no softmax."""
    T = x_sparse.shape[-2]
    qr = ref_rope(x_sparse)
    mask = torch.ones(T, T, dtype=qr.dtype).tril(diagonal=-1)
    return ((qr @ qr.transpose(-1, -2)) * mask) @ v


def ref_attention_recurrent(x_sparse: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Linear-time form: out_t = (R_t x_t)^T rho; then rho += (R_t x_t) v_t^T."""
    B, nh, T, N = x_sparse.shape
    D = v.shape[-1]
    qr = ref_rope(x_sparse)
    v = v.expand(B, nh, T, D)
    rho = torch.zeros(B, nh, N, D, dtype=qr.dtype)
    outs = []
    for t in range(T):
        outs.append(torch.einsum("bhn,bhnd->bhd", qr[:, :, t], rho))
        rho = rho + torch.einsum("bhn,bhd->bhnd", qr[:, :, t], v[:, :, t])
    return torch.stack(outs, dim=2)


def ln(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],))


def ref_forward(w: dict, idx: torch.Tensor, n_layer=TINY["n_layer"], dropout=0.0, training=False):
    B, T = idx.shape
    nh, D, N = w["encoder"].shape
    x = ln(w["embed.weight"][idx]).unsqueeze(1)  # (B, 1, T, D)
    for _ in range(n_layer):
        x_sparse = F.relu(x @ w["encoder"])  # (B, nh, T, N)
        y_kv = ln(ref_attention(x_sparse, x))  # (B, nh, T, D)
        y_sparse = F.relu(y_kv @ w["encoder_v"])
        xy = F.dropout(x_sparse * y_sparse, dropout, training)
        y_mlp = xy.transpose(1, 2).reshape(B, 1, T, nh * N) @ w["decoder"]
        x = ln(x + ln(y_mlp))
    return x.view(B, T, D) @ w["lm_head"]


def ref_weights(n_embd, n_head, mlp_internal_dim_multiplier, vocab_size, seed=0, **_) -> dict:
    g = torch.Generator().manual_seed(seed)
    nh, D, V = n_head, n_embd, vocab_size
    N = mlp_internal_dim_multiplier * D // nh

    def randn(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    return {
        "encoder": randn(nh, D, N),
        "encoder_v": randn(nh, D, N),
        "decoder": randn(nh * N, D),
        "embed.weight": randn(V, D),
        "lm_head": randn(D, V),
        "attn.freqs": ref_freqs(N).view(1, 1, 1, N),
    }


@pytest.fixture(scope="module")
def weights():
    return ref_weights(**TINY)


@pytest.fixture(scope="module")
def model(weights):
    return model_from_reference(weights, BDHConfig(**TINY, dropout=0.0)).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------- forward, loss, reference


def test_logits_shape_and_loss(model, ids):
    out = model(ids, labels=ids)
    assert out.logits.shape == (2, 12, 256)
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)

    labels = ids.clone()
    labels[0, 5:] = -100
    labels[1, :3] = -100
    keep = labels[:, 1:] != -100
    expected = F.cross_entropy(out.logits[:, :-1][keep], labels[:, 1:][keep])
    torch.testing.assert_close(model(ids, labels=labels).loss, expected)


@torch.no_grad()
def test_matches_independent_implementation(model, weights, ids):
    torch.testing.assert_close(model(ids).logits, ref_forward(weights, ids), **FP32)
    assert torch.equal(model.layer.attn.freqs.view(-1), ref_freqs(model.config.n_neurons))


def test_reference_state_dict_round_trip(model, weights):
    sd = reference_state_dict(model)
    assert set(sd) == set(REFERENCE_KEYS) == set(weights)
    assert {k: tuple(v.shape) for k, v in sd.items()} == reference_shapes(model.config)
    for k in weights:
        assert torch.equal(sd[k], weights[k]), k


@torch.no_grad()
def test_strictly_causal(model, ids):
    t = 6
    changed = ids.clone()
    changed[:, t + 1 :] = (changed[:, t + 1 :] + 1) % 256
    a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


@torch.no_grad()
def test_position_does_not_attend_to_itself(model):
    g = torch.Generator().manual_seed(2)
    N, D, T = model.config.n_neurons, model.config.n_embd, 8
    x_sparse = F.relu(torch.randn(2, 2, T, N, generator=g))
    v = torch.randn(2, 1, T, D, generator=g)
    out = model.layer.attn(x_sparse, v)
    assert out.shape == (2, 2, T, D)
    assert torch.all(out[:, :, 0] == 0)
    t = 4
    v2 = v.clone()
    v2[:, :, t] += 10.0
    out2 = model.layer.attn(x_sparse, v2)
    assert torch.equal(out[:, :, : t + 1], out2[:, :, : t + 1])  # t itself does not see v_t
    assert not torch.allclose(out[:, :, t + 1 :], out2[:, :, t + 1 :])


@torch.no_grad()
def test_recurrent_form_equals_quadratic(model):
    g = torch.Generator().manual_seed(3)
    N, D, T = model.config.n_neurons, model.config.n_embd, 10
    x_sparse = F.relu(torch.randn(2, 2, T, N, generator=g, dtype=torch.float64))
    v = torch.randn(2, 1, T, D, generator=g, dtype=torch.float64)
    quadratic = model.layer.attn(x_sparse, v)
    f64 = dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(quadratic, ref_attention_recurrent(x_sparse, v), **f64)
    torch.testing.assert_close(quadratic, ref_attention(x_sparse, v), **f64)
    x32, v32 = x_sparse.float(), v.float()
    torch.testing.assert_close(
        model.layer.attn(x32, v32), ref_attention_recurrent(x32, v32), rtol=1e-4, atol=1e-4
    )


# ---------------------------------------------------------------- sizes and cost


def test_parameter_count():
    counts = []
    for n_layer in (1, 4):
        config = BDHConfig(**{**TINY, "n_layer": n_layer})
        m = BDHForCausalLM(config)
        counts.append(sum(p.numel() for p in m.parameters()))
        assert counts[-1] == parameter_count(config) == model_profile(config, 8).parameters
    assert counts[0] == counts[1] == 3 * 2 * 32 * 128 + 2 * 256 * 32
    default = BDHConfig()
    assert default.n_neurons == 8192
    assert sum(p.numel() for p in BDHForCausalLM(default).parameters()) == 25_296_896
    assert parameter_count(default) == 25_296_896


def test_model_profile():
    config = BDHConfig(**{**TINY, "n_layer": 2})  # nh=2 D=32 N=128 V=256
    p = model_profile(config, 16)
    # per layer 3*nh*D*N + nh*T*(N+D) = 24576 + 5120 MACs; x2 layers; + D*V = 8192; x2 FLOPs
    assert p.forward_flops_per_token == 2 * (2 * (24576 + 5120) + 8192) == 135168
    assert p.backward_flops_per_token == 2 * p.forward_flops_per_token
    assert p.train_flops_per_token == 3 * p.forward_flops_per_token > 0
    assert model_profile(config, 32).forward_flops_per_token > p.forward_flops_per_token
    configs = [BDHConfig(**{**TINY, "n_layer": n}) for n in (1, 2, 3)]
    f = [model_profile(c, 16).forward_flops_per_token for c in configs]
    assert f[2] - f[1] == f[1] - f[0] == 2 * (24576 + 5120)

    # the formula is what the matmuls of the forward actually cost
    from torch.utils.flop_counter import FlopCounterMode

    m = BDHForCausalLM(config).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        m(torch.zeros(2, 16, dtype=torch.long), use_cache=False)
    assert counter.get_total_flops() / (2 * 16) == p.forward_flops_per_token

    # and for every attention form, T a multiple of the chunk or not
    for form, T in (
        ("chunked", 16),
        ("chunked", 23),
        ("recurrent", 9),
        ("auto", 40),
        ("quadratic", 300),
    ):
        c = BDHConfig(**{**TINY, "n_layer": 2, "attention": form, "attention_chunk_size": 8})
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            BDHForCausalLM(c).eval()(torch.zeros(1, T, dtype=torch.long), use_cache=False)
        assert counter.get_total_flops() / T == pytest.approx(
            model_profile(c, T).forward_flops_per_token
        )


def test_config_errors():
    bad = [
        dict(n_layer=0),
        dict(n_embd=32, n_head=3, mlp_internal_dim_multiplier=1),  # 32 not divisible by 3
        dict(n_embd=6, n_head=2, mlp_internal_dim_multiplier=1),  # N = 3 is odd
        dict(vocab_size=-1),
        dict(dropout=1.0),
    ]
    for kwargs in bad:
        with pytest.raises(ValueError) as info:
            BDHConfig(**kwargs)
        assert "\n" not in str(info.value), kwargs


# ---------------------------------------------------------------- Hugging Face integration


def test_save_load_round_trip_and_auto_classes(model, ids, tmp_path):
    assert isinstance(AutoConfig.for_model("bdh", **TINY), BDHConfig)
    assert isinstance(AutoModelForCausalLM.from_config(BDHConfig(**TINY)), BDHForCausalLM)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert isinstance(AutoConfig.from_pretrained(tmp_path), BDHConfig)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, BDHForCausalLM) and not loaded.training
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@torch.no_grad()
def test_generate_greedy_matches_full_recompute(model, ids):
    prompt = ids[:, :5]
    out = model.generate(prompt, max_new_tokens=6, do_sample=False)
    expected = prompt
    for _ in range(6):
        next_id = model(expected).logits[:, -1].argmax(-1, keepdim=True)
        expected = torch.cat([expected, next_id], dim=1)
    assert torch.equal(out, expected)


@torch.no_grad()
def test_generate_sampling(model, ids):
    prompt = ids[:, :5]
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(model.generate(prompt, max_new_tokens=6, do_sample=True, top_k=5))
    out = runs[0]
    assert out.shape == (2, 11) and torch.equal(out[:, :5], prompt)
    assert int(out.min()) >= 0 and int(out.max()) < 256
    assert torch.equal(runs[0], runs[1])
    logits = model(out).logits  # each sampled token is among the top 5 given its prefix
    for t in range(5, 11):
        top5 = logits[:, t - 1].topk(5).indices
        assert (top5 == out[:, t : t + 1]).any(-1).all()


def test_bf16_keeps_fp32_frequencies(model, ids, tmp_path):
    freqs32 = model.layer.attn.freqs.clone()
    m16 = BDHForCausalLM(model.config)
    m16.load_state_dict(model.state_dict())
    m16 = m16.to(torch.bfloat16).eval()
    assert m16.layer.encoder.dtype == torch.bfloat16
    assert m16.layer.attn.freqs.dtype == torch.float32
    assert torch.equal(m16.layer.attn.freqs, freqs32)

    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.layer.decoder.dtype == torch.bfloat16
    assert loaded.layer.attn.freqs.dtype == torch.float32
    assert torch.equal(loaded.layer.attn.freqs, freqs32)

    with torch.no_grad():
        ref, low = model(ids).logits, m16(ids).logits
    assert low.dtype == torch.bfloat16
    assert ((low.float() - ref).norm() / ref.norm()).item() < 5e-2


def test_dropout_only_on_sparse_product(weights, ids):
    m = model_from_reference(weights, BDHConfig(**TINY, dropout=0.5))
    assert sum(isinstance(x, torch.nn.Dropout) for x in m.modules()) == 1
    m.train()
    torch.manual_seed(7)
    a = m(ids).logits
    b = m(ids).logits
    assert not torch.allclose(a, b)
    # same RNG stream, dropout at the single place the reference applies it
    torch.manual_seed(7)
    expected = ref_forward(weights, ids, dropout=0.5, training=True)
    torch.testing.assert_close(a, expected, **FP32)
    m.eval()
    with torch.no_grad():
        assert torch.equal(m(ids).logits, m(ids).logits)
        torch.testing.assert_close(m(ids).logits, ref_forward(weights, ids), **FP32)


# ---------------------------------------------------------------- converter


def run_converter(*args):
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, "recipes/convert_reference.py", *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def size_args(config: dict) -> list:
    return [x for k, v in config.items() for x in (f"--{k}", v)]


def error_lines(stderr: str) -> list:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_converter_cli(tmp_path):
    config = {**TINY, "n_layer": 2, "n_head": 4, "n_embd": 64, "mlp_internal_dim_multiplier": 4}
    w = ref_weights(**config, seed=5)
    torch.save(w, tmp_path / "ref.pt")
    result = run_converter(
        "--input", tmp_path / "ref.pt", "--output", tmp_path / "hf", *size_args(config)
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.config.n_layer == 2 and loaded.config.n_neurons == 64
    idx = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx).logits, ref_forward(w, idx, 2), **FP32)
    assert "Traceback" not in result.stderr and "wrote" in result.stdout


@pytest.fixture
def converter_main(monkeypatch):
    """The CLI's main() in this process (an interpreter start costs seconds): argv -> SystemExit."""
    path = REPO / "recipes" / "convert_reference.py"
    spec = importlib.util.spec_from_file_location("convert_reference", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def main(*args):
        monkeypatch.setattr(sys, "argv", ["convert_reference.py", *map(str, args)])
        script.main()

    return main


def test_converter_cli_in_process(converter_main, capsys, tmp_path, ids):
    config = {**TINY, "n_layer": 2}
    w = ref_weights(**config)
    torch.save({f"_orig_mod.{k}": v for k, v in w.items()}, tmp_path / "compiled.pt")
    converter_main(
        "--input", tmp_path / "compiled.pt", "--output", tmp_path / "hf", *size_args(config)
    )
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ref_forward(w, ids, 2), **FP32)

    torch.save(w, tmp_path / "ref.pt")
    # a wrong size: the key and the expected shape, on one line, exit code 2
    with pytest.raises(SystemExit) as info:
        converter_main(
            "--input",
            tmp_path / "ref.pt",
            "--output",
            tmp_path / "bad",
            *size_args({**config, "mlp_internal_dim_multiplier": 4}),
        )
    assert info.value.code == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "'encoder'" in line and "(2, 32, 128)" in line and "(2, 32, 64)" in line
    assert not (tmp_path / "bad").exists()

    partial = {k: v for k, v in w.items() if k != "encoder_v"}
    torch.save(partial, tmp_path / "partial.pt")
    with pytest.raises(SystemExit) as info:
        converter_main(
            "--input", tmp_path / "partial.pt", "--output", tmp_path / "bad", *size_args(config)
        )
    assert info.value.code == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "missing key 'encoder_v'" in line

    with pytest.raises(SystemExit) as info:
        converter_main("--input", tmp_path / "missing.pt", "--output", tmp_path / "bad")
    assert info.value.code == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert line.startswith("error: input file not found") and "missing.pt" in line

    with pytest.raises(SystemExit) as info:  # a config BDH cannot be built with
        converter_main(
            "--input", tmp_path / "ref.pt", "--output", tmp_path / "bad", "--n_head", "3"
        )
    assert info.value.code == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "n_head=3" in line
    assert not (tmp_path / "bad").exists()


def test_model_from_reference_compiled_prefix_and_errors(weights, ids):
    config = BDHConfig(**TINY, dropout=0.0)
    compiled = {f"_orig_mod.{k}": v for k, v in weights.items()}
    with torch.no_grad():
        logits = model_from_reference(compiled, config)(ids).logits
        torch.testing.assert_close(logits, ref_forward(weights, ids), **FP32)

    missing = {k: v for k, v in weights.items() if k != "decoder"}
    with pytest.raises(ValueError, match=r"missing key 'decoder' \(expected shape \(256, 32\)"):
        model_from_reference(missing, config)

    wrong = {**weights, "lm_head": weights["lm_head"][:, :100]}
    with pytest.raises(ValueError, match=r"'lm_head' has shape \(32, 100\), expected \(32, 256\)"):
        model_from_reference(wrong, config)

    with pytest.raises(ValueError, match="unexpected keys.*'ln.weight'"):
        model_from_reference({**weights, "ln.weight": torch.ones(32)}, config)

    with pytest.raises(ValueError, match="attn.freqs"):
        model_from_reference({**weights, "attn.freqs": weights["attn.freqs"] * 2}, config)


def test_the_sparsity_probe_counts_what_fires():
    """SparsityProbe's per-layer fractions of positive x, y and x * y against the layer's math
    redone by hand (two batches averaged); the hooks leave with the `with`."""
    from dragon.model.bdh import embed_tokens, layer_norm
    from dragon.model.sparsity import SparsityProbe

    torch.manual_seed(0)
    config = BDHConfig(n_layer=3, n_embd=32, n_head=2, mlp_internal_dim_multiplier=8,
                       vocab_size=256, dropout=0.1)
    model = BDHForCausalLM(config).eval()
    batches = [torch.randint(0, 256, (2, 24)) for _ in range(2)]
    with torch.no_grad(), SparsityProbe(model, config.n_layer) as probe:
        for batch in batches:
            model(batch)
    model(batches[0])  # after the `with`: not counted
    got = probe.fractions()

    want, layer = {}, model.layer
    with torch.no_grad():
        for batch in batches:
            x = embed_tokens(model.embed, batch)
            rotation = layer.attn.rotation(0, batch.size(1))
            for i in range(config.n_layer):
                xs = F.relu(x @ layer.encoder)
                ys = F.relu(layer_norm(layer.attn(xs, x, None, 0, False, rotation))
                            @ layer.encoder_v)
                for kind, t in (("x", xs), ("y", ys), ("xy", xs * ys)):
                    key = f"sparsity/layer{i}/{kind}"
                    want[key] = want.get(key, 0.0) + float((t > 0).float().mean()) / 2
                x = layer_norm(x + layer_norm(layer.decode(xs * ys)))
    assert sorted(got) == sorted(want) and len(got) == 9
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-6), key
    assert 0 < got["sparsity/layer0/xy"] < got["sparsity/layer0/x"] < 1
