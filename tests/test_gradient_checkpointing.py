"""--gradient_checkpointing: each BDH layer's training forward is recomputed in the backward
(transformers' activation_checkpointing_enable over BDHLayer, torch's non-reentrant checkpoint),
and trains exactly as without it: the model alone in every attention form, with and without a
carried state, and the ZeRO, accelerate and pipeline recipes against their runs without it. The
dry run counts one layer's activations instead of all of them.

Tolerance: losses within 1e-6 and gradients within 1e-6 of their largest entry. The recompute
runs the same operations on the same inputs, dropout masks included (the RNG state is
replayed), so the two agree to the bit here; 1e-6 leaves room for kernels that do not repeat
their sums exactly (some accelerators' atomics)."""

import re

import pytest
import torch
from conftest import (PIPE_X2, REPO, ZERO2_GC, dry_run_in_process, losses,
                      run_recipe_in_process)

from dragon import BDHConfig, BDHForCausalLM
from dragon.model.attention import BDHCache
from dragon.run.args import parse_arguments

SMALL = dict(n_layer=3, n_embd=32, n_head=2, mlp_internal_dim_multiplier=8, vocab_size=256,
             dropout=0.1)
EXACT = 1e-6


def model_in(form: str) -> BDHForCausalLM:
    torch.manual_seed(0)
    return BDHForCausalLM(BDHConfig(**SMALL, attention=form, attention_chunk_size=8)).train()


def losses_and_grads(model: BDHForCausalLM, ids: torch.Tensor, carried: bool):
    """The losses and parameter gradients of one training forward and backward (dropout on), and
    how many times the attention ran. `carried`: two halves, the second continuing the state the
    first left (as --carry_state trains), its states returned too."""
    model.zero_grad()
    torch.manual_seed(1)  # the same dropout masks in both runs
    calls = []
    hook = model.layer.attn.register_forward_pre_hook(lambda *_: calls.append(1))
    if carried:
        cache, half = BDHCache(model.config.n_layer), ids.size(1) // 2
        first = model(ids[:, :half], labels=ids[:, :half], cache=cache).loss
        cache.detach_()
        second = model(ids[:, half:], labels=ids[:, half:], cache=cache).loss
        found, states = [first, second], cache.states
    else:
        found, states = [model(ids, labels=ids).loss], []
    sum(found).backward()
    hook.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return [loss.item() for loss in found], grads, len(calls), states


@pytest.mark.parametrize("carried", [False, True], ids=["fresh", "carried_state"])
@pytest.mark.parametrize("form,T", [("quadratic", 40), ("chunked", 40), ("chunked", 29),
                                    ("recurrent", 19), ("auto", 40)])
def test_recomputed_layers_train_as_stored_ones(form, T, carried):
    """In every attention form (the chunked one over several chunks, whole or not), fresh or
    continuing a carried state: the same losses, gradients and outgoing states, while the
    attention runs once more per layer (its recompute in the backward)."""
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(2))
    model = model_in(form)
    stored = losses_and_grads(model, ids, carried)
    model.activation_checkpointing_enable({"use_reentrant": False})
    assert model.is_activation_checkpointing
    recomputed = losses_and_grads(model, ids, carried)
    assert recomputed[0] == pytest.approx(stored[0], abs=EXACT)
    for name, grad in stored[1].items():
        scale = grad.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(recomputed[1][name], grad, rtol=0, atol=EXACT * scale,
                                   msg=name)
    for state, expected in zip(recomputed[3], stored[3]):
        torch.testing.assert_close(state, expected, rtol=0, atol=EXACT)
    n = model.config.n_layer * (2 if carried else 1)
    assert (stored[2], recomputed[2]) == (n, 2 * n)


def test_evaluation_and_generation_are_not_recomputed():
    """Without gradients (evaluation, generate()) a checkpointed model runs each layer once and
    keeps its state cache."""
    model = model_in("auto")
    model.activation_checkpointing_enable({"use_reentrant": False})
    calls = []
    model.layer.attn.register_forward_pre_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 5) and len(calls) == 2 * model.config.n_layer


def memory_parts(monkeypatch, capsys, argv: list[str], script="recipes/pretrain.py") -> dict:
    dry_run_in_process(monkeypatch, script, argv, {"WORLD_SIZE": "2"})
    out = capsys.readouterr().out
    return {name: float(mib.replace(",", "")) for name, mib in
            re.findall(r"^  (activations[^:]*): ([\d.,]+) MiB", out, re.M)}


def test_the_dry_run_counts_one_layer_s_activations(monkeypatch, capsys, tmp_path, text_file):
    """6 layers at block 256: recomputed one at a time, the estimate keeps each layer's input and
    one layer's activations, well under a third of all six; the pipeline recipe's
    --gradient_checkpointing is its --activation_checkpoint_interval 1, estimated alike."""
    base = ["--deepspeed", str(REPO / "ds_configs/zero2.json"), "--output_dir",
            str(tmp_path), "--train_file", str(text_file), "--n_layer", "6", "--n_embd", "32",
            "--n_head", "2", "--block_size", "256"]
    stored = memory_parts(monkeypatch, capsys, base)["activations"]
    recomputed = memory_parts(monkeypatch, capsys, [*base, "--gradient_checkpointing"])
    assert list(recomputed) == ["activations (recomputed 1 layer(s) at a time)"]
    assert recomputed[list(recomputed)[0]] < stored / 3
    pipe = [*base, "--deepspeed", str(REPO / "ds_configs/pipeline_zero0.json"),
            "--pipeline_stages", "2", "--gradient_accumulation_steps", "2"]
    script = "recipes/pretrain_pipeline.py"
    by_flag = memory_parts(monkeypatch, capsys, [*pipe, "--gradient_checkpointing"], script)
    by_interval = memory_parts(monkeypatch, capsys,
                               [*pipe, "--activation_checkpoint_interval", "1"], script)
    assert by_flag == by_interval
    assert list(by_flag.values())[0] < memory_parts(monkeypatch, capsys, pipe,
                                                     script)["activations"] / 2


def test_the_pipeline_takes_it_as_interval_one_and_refuses_another_interval(tmp_path):
    pipe = ["--output_dir", str(tmp_path), "--gradient_checkpointing"]
    *_, pipe_args = parse_arguments(pipeline=True, argv=pipe)
    assert pipe_args.activation_checkpoint_interval == 1
    with pytest.raises(ValueError) as refused:
        parse_arguments(pipeline=True, argv=[*pipe, "--activation_checkpoint_interval", "2"])
    assert str(refused.value) == (
        "--activation_checkpoint_interval 2 with --gradient_checkpointing: valid are 0 (off) or "
        "k >= 1 layers; --gradient_checkpointing is 1")


def test_the_pipeline_refuses_it_with_a_carried_state(monkeypatch, text_file, tmp_path):
    """A pipeline stage's layer writes its cache as it runs, so a recompute would carry the state
    twice: one line before any process group starts (the ZeRO recipe takes both)."""
    argv = ["--deepspeed", str(REPO / "ds_configs/pipeline_zero0.json"), "--output_dir",
            str(tmp_path), "--train_file", str(text_file), "--n_layer", "2", "--n_embd", "32",
            "--n_head", "2", "--block_size", "64", "--pipeline_stages", "2", "--carry_state",
            "--gradient_checkpointing"]
    line = run_recipe_in_process(monkeypatch, "recipes/pretrain_pipeline.py", argv,
                                 {"WORLD_SIZE": "2"})
    assert line == (
        "error: --carry_state with --gradient_checkpointing in the pipeline recipe: a recomputed "
        "forward would carry the state twice; drop it (--activation_checkpoint_interval 0), or "
        "train with recipes/pretrain.py, which takes both")


def assert_same_training(metrics: list[dict], reference: list[dict]) -> None:
    """Every step's loss and gradient norm, and every evaluation, within 1e-6."""
    for key in ("loss", "grad_norm", "eval_loss"):
        assert len(losses(metrics, key)) == len(losses(reference, key)) > 0, key
        assert losses(metrics, key) == pytest.approx(losses(reference, key), abs=EXACT), key


def test_the_zero_recipe_trains_the_same(runs):
    """2 ranks under ZeRO-2: the suite's zero2 run, and the same run recomputing every layer
    (its --profile_steps traces are tests/test_profiler.py's)."""
    _, metrics, _ = runs("zero2_gc", **ZERO2_GC)
    _, reference, _ = runs("zero2")
    assert_same_training(metrics, reference)


@pytest.mark.slow
def test_the_accelerate_recipe_trains_the_same(runs):
    """accelerate launch (zero2.yaml, 2 micro-batches of 2): the suite's run, and the same run
    recomputing every layer."""
    accum = dict(launcher="accelerate", config="zero2.yaml", micro=2)
    extra = ["--gradient_accumulation_steps", "2"]
    _, reference, _ = runs("accelerate_zero2.yaml", **accum, extra=extra)
    _, metrics, _ = runs("accelerate_zero2.yaml_gc", **accum,
                         extra=[*extra, "--gradient_checkpointing"])
    assert_same_training(metrics, reference)


@pytest.mark.slow
def test_the_pipeline_recipe_trains_the_same(runs):
    """2 stages: the suite's pipe_x2 run, and the same run with --gradient_checkpointing (every
    layer of a stage recomputed, tests/test_deepspeed_fixes.py)."""
    _, reference, _ = runs("pipe_x2", **PIPE_X2)
    gc = dict(PIPE_X2, extra=[*PIPE_X2["extra"], "--gradient_checkpointing"])
    _, metrics, _ = runs("pipe_x2_gc", **gc)
    assert_same_training(metrics, reference)
