"""Neuron parallelism (dragon.parallel.neurons): K = 2 and 4 real processes that split BDH's
neurons give the unsplit model's logits and gradients in every attention form, carry its state
and generate its greedy text."""

import subprocess
import sys

import pytest
import torch

from conftest import REPO, free_port, job_env

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from neuron_split import CASES, run_cases, whole_model  # noqa: E402


def split_among(k: int, tmp_path) -> dict:
    port, out = free_port(), tmp_path / f"k{k}.pt"
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests/scripts/neuron_split.py"),
                               str(r), str(k), str(port), str(out)], cwd=REPO, env=job_env(),
                              stderr=subprocess.PIPE, text=True) for r in range(k)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def unsplit():
    return run_cases(whole_model(), lambda grads: grads)


@pytest.mark.parametrize("k", [2, 4])
def test_split_neurons_equal_the_whole_model(k, unsplit, tmp_path):
    """Logits and every gradient within 1e-5 (fp32; the sums over neurons are added in another
    order) for the quadratic, chunked and recurrent forms at T = 16 (two chunks of 8) and 13;
    a stream continued through the sharded state cache gives the one-call logits; greedy
    generation gives the same ids."""
    split = split_among(k, tmp_path)
    for case in CASES:
        ours, whole = split[case], unsplit[case]
        assert (ours["logits"] - whole["logits"]).abs().max() < 1e-5, case
        assert abs(ours["loss"] - whole["loss"]) < 1e-5, case
        assert ours["grads"].keys() == whole["grads"].keys()
        for name, grad in whole["grads"].items():
            scale = grad.abs().max()
            assert (ours["grads"][name] - grad).abs().max() <= 1e-5 * max(1.0, scale), (case, name)
    assert (split["carried"] - unsplit["carried"]).abs().max() < 1e-5
    assert torch.equal(split["generated"], unsplit["generated"])
