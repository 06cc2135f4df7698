"""Top-k pseudo-gradients with error feedback (dragon.diloco.sparse): the code, the feedback's
bookkeeping over several outer steps, and the exchange among 2, 3 and 4 real processes."""

import math

import pytest
import torch
from test_quantized import exchanges_by_codec

from dragon.diloco.sparse import topk_encode, topk_sum
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
