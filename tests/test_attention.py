"""The three attention forms against each other, and the state cache against full recompute.

Tolerances (fp32): logits within atol=rtol=1e-5; every parameter gradient within rtol=1e-5
and an atol of 1e-5 times that gradient's largest entry (the gradients of the test's loss reach
~100). The forms sum the same products in different orders (blocks, chunks, a prefix sum over
chunk states), so they differ by rounding only, ~1e-7 relative; a wrong mask, a missing state
read or an off-by-one position is orders of magnitude larger.
"""

import pytest
import torch

from dragon import BDHConfig, BDHForCausalLM
from dragon.model.attention import (
    AUTO_CROSSOVER,
    CAUSAL_BLOCK,
    BDHCache,
    causal_scores,
    chunked,
    quadratic,
    recurrent,
    resolve_form,
)
from dragon.model.bdh import fired_rows

from test_model import ref_forward, ref_weights

SMALL = dict(
    n_layer=2, n_embd=32, n_head=2, mlp_internal_dim_multiplier=8, vocab_size=256, dropout=0.0
)
FP32 = dict(atol=1e-5, rtol=1e-5)


def model_with(form: str, chunk: int = 8, **overrides) -> BDHForCausalLM:
    torch.manual_seed(0)  # the same weights for every form
    return BDHForCausalLM(
        BDHConfig(**{**SMALL, **overrides}, attention=form, attention_chunk_size=chunk)
    )


def ids_of(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def logits_and_grads(model: BDHForCausalLM, ids: torch.Tensor):
    """Logits and the gradients of a fixed random projection of them (defined for T=1 too)."""
    model.zero_grad()
    logits = model(ids, use_cache=False).logits
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------- the forms agree


@pytest.mark.parametrize(
    "form,chunk,T",
    [
        ("chunked", 8, 32),  # a multiple of the chunk
        ("chunked", 8, 29),  # not a multiple
        ("chunked", 16, 5),  # shorter than one chunk
        ("chunked", 7, 1),  # one position
        ("chunked", 64, 300),  # chunks of one row block inside, several chunks
        ("chunked", 160, 300),  # chunks of several row blocks
        ("recurrent", 8, 19),
        ("recurrent", 8, 1),
        ("auto", 8, 40),
    ],
)
def test_forms_match_quadratic_logits_and_gradients(form, chunk, T):
    ids = ids_of(2, T)
    ref_logits, ref_grads = logits_and_grads(model_with("quadratic"), ids)
    logits, grads = logits_and_grads(model_with(form, chunk), ids)
    torch.testing.assert_close(logits, ref_logits, **FP32)
    for name, grad in ref_grads.items():
        scale = grad.abs().max().item()
        assert scale > 0 or T == 1, name  # one position reads no state: the block gets no gradient
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_block_quadratic_matches_the_independent_reference():
    """Above one block of rows the quadratic form skips the masked half; still the reference."""
    T = 2 * CAUSAL_BLOCK + 37
    w = ref_weights(**SMALL)
    from dragon.model.convert import model_from_reference

    model = model_from_reference(w, BDHConfig(**SMALL, attention="quadratic")).eval()
    ids = ids_of(1, T)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, use_cache=False).logits, ref_forward(w, ids, 2), **FP32
        )


def test_block_backward_matches_autograd_in_float64():
    g = torch.Generator().manual_seed(4)
    # three blocks of 8 rows, the last one partial; v broadcast over the heads
    q = torch.relu(torch.randn(2, 2, 21, 6, generator=g, dtype=torch.float64)).requires_grad_()
    v = torch.randn(2, 1, 21, 4, generator=g, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: causal_scores(a, b, 8), (q, v))


def test_forms_carry_a_state_and_return_it():
    """Every form continues from a state exactly as one pass over the whole sequence does."""
    g = torch.Generator().manual_seed(5)
    q = torch.relu(torch.randn(2, 2, 40, 16, generator=g, dtype=torch.float64))
    v = torch.randn(2, 1, 40, 8, generator=g, dtype=torch.float64)
    whole, whole_state = quadratic(q, v, return_state=True)
    f64 = dict(rtol=1e-10, atol=1e-10)
    for form in (quadratic, recurrent, lambda *a, **k: chunked(a[0], a[1], 7, *a[2:], **k)):
        first, state = form(q[:, :, :13], v[:, :, :13], return_state=True)
        second, end = form(q[:, :, 13:], v[:, :, 13:], state, return_state=True)
        torch.testing.assert_close(torch.cat([first, second], dim=2), whole, **f64)
        torch.testing.assert_close(end, whole_state, **f64)
    assert whole_state.shape == (2, 2, 16, 8)


def test_auto_picks_by_length():
    assert resolve_form("auto", 1, 512, has_state=True) == "recurrent"
    assert resolve_form("auto", 1, 512, has_state=False) == "quadratic"
    assert resolve_form("auto", AUTO_CROSSOVER, 512, has_state=False) == "quadratic"
    assert resolve_form("auto", AUTO_CROSSOVER + 1, 512, has_state=False) == "chunked"
    assert resolve_form("chunked", 3, 512, has_state=False) == "chunked"


def test_bad_form_and_chunk_are_refused_in_one_line():
    for kwargs, word in ((dict(attention="flash"), "flash"), (dict(attention_chunk_size=0), "0")):
        with pytest.raises(ValueError) as info:
            BDHConfig(**SMALL, **kwargs)
        assert word in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------- state cache


@pytest.mark.parametrize("form", ["auto", "chunked", "quadratic"])
@torch.no_grad()
def test_stream_continuation_equals_one_forward(form):
    model = model_with(form).eval()
    ids = ids_of(2, 50)
    whole = model(ids, use_cache=False).logits
    for split in (1, 8, 23):
        out = model(ids[:, :split], use_cache=True)
        cache = out.past_key_values
        assert isinstance(cache, BDHCache) and cache.get_seq_length() == split
        pieces = [out.logits]
        for start, end in ((split, split + 1), (split + 1, 50)):  # one token, then the rest
            pieces.append(model(ids[:, start:end], past_key_values=cache).logits)
        assert cache.position == 50
        torch.testing.assert_close(torch.cat(pieces, dim=1), whole, **FP32)


def test_a_step_reads_only_the_fired_rows_and_equals_the_dense_product():
    """A generation step's decoder sums the rows of the nonzero activations only: the dense
    product's value for a batch row with many, few and no nonzero entries."""
    g = torch.Generator().manual_seed(3)
    acts = torch.relu(torch.randn(4, 64, generator=g))
    acts[1] *= torch.rand(64, generator=g) < 0.05
    acts[2] = 0
    weight = torch.randn(64, 16, generator=g)
    torch.testing.assert_close(fired_rows(acts, weight), acts @ weight, **FP32)
    model = model_with("auto").eval()  # one position without autograd takes fired_rows
    ids = ids_of(2, 9)
    with torch.no_grad():
        cache = model(ids[:, :8], use_cache=True).past_key_values
        step = model(ids[:, 8:], past_key_values=cache).logits
        whole = model(ids, use_cache=False).logits
    torch.testing.assert_close(step, whole[:, 8:], **FP32)


@torch.no_grad()
def test_cache_holds_fp32_states_under_bf16():
    model = model_with("chunked").to(torch.bfloat16).eval()
    cache = model(ids_of(1, 20), use_cache=True).past_key_values
    N, D = model.config.n_neurons, model.config.n_embd
    assert all(s.dtype == torch.float32 and s.shape == (1, 2, N, D) for s in cache.states)


@torch.no_grad()
def test_generate_with_cache_equals_full_recompute():
    model = model_with("auto").eval()
    prompts = ids_of(3, 7)  # a batch of equal-length prompts
    greedy = model.generate(prompts, max_new_tokens=30, do_sample=False)
    assert torch.equal(
        greedy, model.generate(prompts, max_new_tokens=30, do_sample=False, use_cache=False)
    )
    sampled = []
    for use_cache in (True, False):
        torch.manual_seed(11)
        sampled.append(
            model.generate(prompts, max_new_tokens=30, do_sample=True, top_k=5, use_cache=use_cache)
        )
    assert torch.equal(sampled[0], sampled[1]) and not torch.equal(sampled[0], greedy)
    beams = model.generate(prompts, max_new_tokens=12, num_beams=3, do_sample=False)
    assert torch.equal(
        beams,
        model.generate(prompts, max_new_tokens=12, num_beams=3, do_sample=False, use_cache=False),
    )


@torch.no_grad()
def test_generate_uses_one_token_per_step():
    """After the prompt, every forward of generate() sees one new token (O(1) in the length)."""
    model = model_with("auto").eval()
    lengths = []
    hook = model.embed.register_forward_hook(lambda m, args, out: lengths.append(args[0].size(1)))
    model.generate(ids_of(1, 9), max_new_tokens=6, do_sample=False)
    hook.remove()
    assert lengths == [9, 1, 1, 1, 1, 1]


def test_cache_reorder_select_repeat_and_detach():
    cache = BDHCache(2)
    cache.states = [torch.arange(3.0).view(3, 1, 1, 1).requires_grad_() * (i + 1) for i in range(2)]
    cache.position = 5
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert cache.states[1].view(-1).tolist() == [4.0, 4.0, 0.0]
    cache.batch_select_indices(torch.tensor([0, 2]))
    cache.batch_repeat_interleave(2)
    assert cache.states[0].view(-1).tolist() == [2.0, 2.0, 0.0, 0.0] and cache.batch_size == 4
    assert all(not s.requires_grad for s in cache.detach_().states)
    with pytest.raises(NotImplementedError):
        cache.crop(1)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.batch_size == -1
