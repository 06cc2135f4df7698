"""Top-k pseudo-gradients with error feedback (dragon.wire.sparse): the code, the feedback's
bookkeeping over several outer steps, and the exchange among 2, 3 and 4 real processes; SparseLoCo's
code (top-k within chunks in 2 bits) and its decaying feedback in the outer loop."""

import math

import pytest
import torch
from test_quantized import exchanges_by_codec

from dragon.run.diloco_args import DiLoCoArguments
from dragon.diloco.outer import DiLoCo
from dragon.wire.sparse import sparseloco_encode, sparseloco_sum, topk_encode, topk_sum
from dragon.parallel.topology import Topology
from diloco_islands import Weights
from quantized_exchange import LENGTH, TOPK, pseudo_gradient


def test_the_code_holds_the_largest_entries_in_bf16():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    code, sent = topk_encode(x, 0.02)
    k = math.ceil(0.02 * 5000)
    assert code.numel() == 6 * k  # int32 index and bf16 value per entry
    chosen = sent.nonzero().squeeze(1)
    assert set(chosen.tolist()) == set(x.abs().topk(k).indices.tolist())
    assert torch.equal(sent[chosen], x[chosen].bfloat16().float())
    assert torch.equal(topk_sum([code], 5000), sent)  # the code decodes to what was sent


def test_sparseloco_sends_the_largest_of_every_chunk_in_two_bits():
    """Each chunk of 4096 sends its k = 64 largest entries (1/64 of them), each off by at most a
    third of the chunk's largest |value|, as 2 bytes of index, 2 bits of level and a 4-byte scale
    a chunk; the code decodes to what was sent, and two codes sum to the sum of what each sent."""
    x = torch.randn(3 * 4096 + 1000, generator=torch.Generator().manual_seed(0))
    code, sent = sparseloco_encode(x, 1 / 64, 4096)
    assert code.numel() == 4 * (2 * 64 + 64 // 4 + 4)
    for start in range(0, x.numel(), 4096):
        part, got = x[start:start + 4096], sent[start:start + 4096]
        chosen = got.nonzero().squeeze(1)
        assert set(chosen.tolist()) == set(part.abs().topk(64).indices.tolist())
        scale = part[chosen].abs().max()
        assert (got[chosen] - part[chosen]).abs().max() <= scale / 3 * (1 + 1e-6)
        levels = torch.tensor([-1, -1 / 3, 1 / 3, 1]) * scale
        assert all(bool((levels - v).abs().min() < 1e-6 * scale) for v in got[chosen])
    assert torch.equal(sparseloco_sum([code], x.numel(), 1 / 64, 4096), sent)
    other, sent_other = sparseloco_encode(-2 * x.flip(0), 1 / 64, 4096)
    assert torch.equal(sparseloco_sum([code, other], x.numel(), 1 / 64, 4096), sent + sent_other)


def test_sparseloco_keeps_back_exactly_what_it_did_not_send_decayed():
    """One island: after every outer step the residual is beta x the last residual plus this
    step's pseudo-gradient, less what was sent (==), and theta_outer moves by lr x the sent
    average (no momentum)."""
    args = DiLoCoArguments(diloco_inner_steps=1, diloco_compress="sparseloco",
                           diloco_topk=0.05, diloco_sparseloco_chunk=64,
                           diloco_sparseloco_decay=0.9, diloco_outer_momentum=0.0,
                           diloco_outer_lr=1.0)
    weights = [torch.randn(300, generator=torch.Generator().manual_seed(2))]
    outer = DiLoCo(Weights(weights), args.config(), Topology())
    residual, theta = torch.zeros(300), weights[0].clone()
    for step in range(1, 5):
        with torch.no_grad():
            weights[0].mul_(0.8)
        delta = theta - weights[0] + 0.9 * residual
        _, sent = sparseloco_encode(delta, 0.05, 64)
        outer.maybe_outer_step(step)
        residual, theta = delta - sent, theta - sent
        assert torch.equal(outer.fragments[0].residual, residual)
        assert torch.equal(outer.theta_outer(), theta)
        assert torch.equal(weights[0], theta)


def test_error_feedback_sends_every_pseudo_gradient_in_the_end():
    """Over 80 outer steps, what was sent plus the residual left equals the sum of the
    pseudo-gradients (each step sends the top 5 % of pseudo-gradient + residual and keeps the
    rest); the residual levels off: its norm over steps 41-80 is no larger than over steps 21-40
    (a residual that grew as a random walk would be sqrt(2) times larger there, a linear one
    twice)."""
    generator = torch.Generator().manual_seed(1)
    residual, sent_total, grads_total, norms = torch.zeros(2000), 0, 0, []
    for _ in range(80):
        grad = torch.randn(2000, generator=generator)
        compensated = grad + residual
        _, sent = topk_encode(compensated, 0.05)
        residual = compensated - sent
        sent_total = sent_total + sent.double()
        grads_total = grads_total + grad.double()
        norms.append(float(residual.norm()))
    assert torch.allclose(sent_total + residual.double(), grads_total, rtol=0, atol=1e-5)
    assert max(norms[40:]) < 1.1 * max(norms[20:40])


@pytest.fixture(scope="module")
def exchanges(tmp_path_factory):
    return exchanges_by_codec(tmp_path_factory)["topk"]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_island_gets_the_same_average_of_what_each_sent(exchanges, n):
    results = exchanges[n]
    for other in results[1:]:
        assert torch.equal(other["average"], results[0]["average"])
    want = sum(topk_encode(pseudo_gradient(i), TOPK)[1].double() for i in range(n)) / n
    assert torch.allclose(results[0]["average"].double(), want, rtol=1e-6, atol=1e-7)
    # what a rank sends per island: (n - 1) codes of 6 bytes an entry, 2 % of the entries
    payload = results[0]["payload_bytes"]
    assert payload == 6 * math.ceil(TOPK * LENGTH)
    for r in results:
        assert (n - 1) * payload <= r["bytes_sent"] <= (n - 1) * payload + 2048
    assert payload * (n - 1) <= 4 * LENGTH * 2 * (n - 1) / n / 16  # <= 1/16 of fp32's ring
