"""Stateful training (--carry_state): the stream layout, carrying against one long forward, resets,
and real jobs of both recipes: 2 ranks against 1, the pipeline against ZeRO, DiLoCo (SIGKILL +
resume with carried state: tests/test_checkpoints.py).

Tolerances: carrying against one forward, fp32 logits within atol=rtol=1e-5 (the same sums in
another order); recipes against each other, LOSS_ATOL (conftest); a resumed run, bit for bit.
"""

import pytest
import torch
from conftest import CARRY, LOSS_ATOL, bad_input_base, losses, run_recipe_in_process
from datasets import Dataset

from dragon import BDHConfig, BDHForCausalLM
from dragon.model.attention import FP32_POSITIONS, BDHCache
from dragon.data.batches import ContiguousRowBatches, eval_streams
from dragon.run.carry import CarriedState, check_state_fits, state_bytes_per_row

FP32 = dict(atol=1e-5, rtol=1e-5)
SMALL = dict(n_layer=2, n_embd=32, n_head=2, mlp_internal_dim_multiplier=8, dropout=0.0)


def small_model(**overrides) -> BDHForCausalLM:
    torch.manual_seed(0)
    return BDHForCausalLM(BDHConfig(**{**SMALL, **overrides}))


def numbered(n: int) -> Dataset:
    """n blocks whose first id is the block's index."""
    return Dataset.from_dict({"input_ids": [[i, 0, 0] for i in range(n)]})


# ---------------------------------------------------------------- carrying is exact


@pytest.mark.parametrize("attention", ["auto", "chunked", "quadratic"])
def test_carried_steps_equal_one_long_forward(attention):
    """4 training steps of 3 rows x 24 tokens, the state carried and detached between them: the
    logits of one forward over the 96 tokens, and every step's gradients flow (only) within it."""
    model = small_model(attention=attention, attention_chunk_size=16)
    ids = torch.randint(0, 256, (3, 96), generator=torch.Generator().manual_seed(1))
    carried = CarriedState(slots=1, n_layer=2, steps_per_epoch=100)
    pieces = []
    for step in range(4):
        carried.begin_step(step)
        block = ids[:, 24 * step : 24 * (step + 1)]
        out = model(block, labels=block, cache=carried.caches[0])
        out.loss.backward()  # a graph reaching into an earlier step would fail here: freed
        carried.end_step()
        pieces.append(out.logits.detach())
    assert carried.caches[0].position == 96
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(pieces, dim=1), model(ids).logits, **FP32)


@torch.no_grad()
def test_rope_is_relative_far_along_a_stream():
    """A carried stream's positions grow without bound; RoPE is relative, so a block read from a
    zero state at position 10^8 gives the logits it gives at position 0 (fp64 phases there)."""
    model = small_model().eval()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    far = BDHCache(2)
    far.position = 10**8
    assert far.position > FP32_POSITIONS
    torch.testing.assert_close(model(ids, cache=far).logits, model(ids).logits, **FP32)


# ---------------------------------------------------------------- the stream layout


def test_rows_are_streams_that_continue_across_steps():
    ds = numbered(100)
    one = ContiguousRowBatches(ds, 4, 0, 1, grad_accum=2, seed=3)  # 8 rows, streams of 12 blocks
    assert one.steps_per_epoch == 12
    steps = [torch.cat([next(one)[:, 0] for _ in range(2)]) for _ in range(12)]
    for k in range(11):  # every row reads the next block of its stream
        assert torch.equal(steps[k + 1], steps[k] + 1)
    starts = sorted(steps[0].tolist())
    assert starts == [12 * s for s in range(8)]  # the streams tile the corpus
    wrapped = torch.cat([next(one)[:, 0] for _ in range(2)])
    assert one.epoch == 1 and sorted(wrapped.tolist()) == starts  # an epoch starts them again
    assert not torch.equal(wrapped, steps[0])  # in another seeded order of rows


def test_two_ranks_read_disjoint_streams_that_make_one_ranks():
    ds = numbered(100)
    one = ContiguousRowBatches(ds, 4, 0, 1, grad_accum=2, seed=3)
    ranks = [ContiguousRowBatches(ds, 2, r, 2, grad_accum=2, seed=3) for r in range(2)]
    for _ in range(5 * 2):  # micro-step a of the 1-rank job = rank 0's then rank 1's rows
        mine = [next(r)[:, 0] for r in ranks]
        assert not set(mine[0].tolist()) & set(mine[1].tolist())
        assert torch.equal(next(one)[:, 0], torch.cat(mine))


def test_validation_streams():
    batches = eval_streams(numbered(30), 2, 1, 2, max_samples=20)  # 4 rows of 5 blocks
    assert [b[:, 0].tolist() for b in batches] == [[10 + i, 15 + i] for i in range(5)]


def test_states_reset_at_the_wrap_and_every_r_steps():
    carried = CarriedState(slots=2, n_layer=1, steps_per_epoch=6, reset_steps=4)
    zeroed = []
    for step in range(13):
        for cache in carried.caches:
            cache.states[0], cache.position = torch.ones(1), 7
        carried.begin_step(step)
        zeroed.append(all(c.states[0] is None and c.position == 0 for c in carried.caches))
    assert [s for s, z in enumerate(zeroed) if z] == [0, 4, 6, 8, 12]


def test_state_that_does_not_fit_is_refused():
    config = BDHConfig(**SMALL)
    assert state_bytes_per_row(config) == 4 * 2 * 2 * 128 * 32
    assert check_state_fits(config, 8, available=10**9) == 8 * 4 * 2 * 2 * 128 * 32
    with pytest.raises(ValueError, match="more than the 0.00 GiB available"):
        check_state_fits(config, 8, available=1000)


# ---------------------------------------------------------------- real jobs


def test_two_ranks_equal_one_rank_and_carrying_matters(runs):
    """2 ranks x micro 4 against 1 rank x micro 4 x accumulation 2, both --carry_state. Resetting
    every step (the same streams, nothing carried) gives the same first step only."""
    _, two, _ = runs("carry_2ranks", extra=CARRY)
    _, one, _ = runs("carry_1rank", nproc=1, extra=[*CARRY, "--gradient_accumulation_steps", "2"])
    _, reset, _ = runs("carry_reset1", extra=[*CARRY, "--state_reset_steps", "1"])
    assert losses(two) == pytest.approx(losses(one), abs=LOSS_ATOL)
    # (evaluation splits its streams over the ranks, so it is compared within one world size)
    assert len(losses(two, "eval_loss_carried")) == len(losses(two, "eval_loss")) == 2
    assert losses(reset)[0] == losses(two)[0]
    assert all(abs(a - b) > 1e-4 for a, b in zip(losses(reset)[1:], losses(two)[1:]))


def test_zero3_carries_like_zero2(runs):
    _, zero3, _ = runs("carry_zero3", config="zero3.json", extra=CARRY)
    _, zero2, _ = runs("carry_2ranks", extra=CARRY)
    assert losses(zero3) == pytest.approx(losses(zero2), abs=LOSS_ATOL)


def test_diloco_islands_carry_their_state_over_outer_steps(runs):
    """One island, outer SGD lr 1 without momentum, H = 2: plain training, states included (an
    outer step that reset or lost them would change every later loss)."""
    lr1 = ["--diloco_outer_lr", "1.0", "--diloco_outer_momentum", "0"]
    _, diloco, _ = runs("carry_diloco", extra=[*CARRY, "--diloco_inner_steps", "2", *lr1])
    _, plain, _ = runs("carry_2ranks", extra=CARRY)
    assert losses(diloco) == pytest.approx(losses(plain), abs=LOSS_ATOL)


@pytest.mark.slow
def test_pipeline_carries_like_zero(runs):
    """2 stages, 4 micro-batches of 4 against the ZeRO recipe on 1 rank with the same 16 rows."""
    accum4 = [*CARRY, "--gradient_accumulation_steps", "4"]
    _, zero, _ = runs("carry_zero_accum4", nproc=1, extra=accum4)
    _, pipe, _ = runs(
        "carry_pipeline",
        config="pipeline_zero0.json",
        script="recipes/pretrain_pipeline.py",
        extra=[*CARRY, "--pipeline_stages", "2", "--gradient_accumulation_steps", "4"],
    )
    for key in ("loss", "eval_loss", "eval_loss_carried"):
        assert losses(pipe, key) == pytest.approx(losses(zero, key), abs=LOSS_ATOL), key


@pytest.mark.parametrize(
    "script,argv,expected",
    [
        (
            "recipes/pretrain.py",
            ["--carry_state", "--n_embd", "4096", "--mlp_internal_dim_multiplier", "4096"],
            "GiB available; lower the micro batch size",
        ),
        (
            "recipes/pretrain_pipeline.py",
            ["--carry_state", "--pipeline_stages", "2", "--activation_checkpoint_interval", "1"],
            "a recomputed forward would carry the state twice",
        ),
        (
            "recipes/pretrain.py",
            ["--metric_for_best_model", "eval_loss_carried"],
            "eval_loss_carried is recorded only with --carry_state",
        ),
        ("recipes/pretrain.py", ["--state_reset_steps", "-1"], "--state_reset_steps=-1"),
    ],
)
def test_bad_input_stops_before_start(monkeypatch, text_file, tmp_path, script, argv, expected):
    config = "pipeline_zero0.json" if "pipeline" in script else "zero2.json"
    base = bad_input_base(config, tmp_path, text_file)
    env = {"WORLD_SIZE": "2"} if "pipeline" in script else {}
    assert expected in run_recipe_in_process(monkeypatch, script, base + argv, env)
