"""Layouts that compose (dragon.parallel.layout): the layout value itself, and neuron parallelism
inside DiLoCo islands and with carried state, each against the same run without the split."""

import pytest
from conftest import CARRY, LOSS_ATOL, losses
from test_diloco import final_logits, island_metrics, islands_run

from dragon.parallel.layout import Layout, plan_layout


def test_a_layout_places_every_rank_and_names_its_groups():
    """8 ranks = 2 islands x 2 stages x K=2 x 1 data-parallel rank: ranks in DeepSpeed's
    (pipe, data, model) order inside each island, neuron shares adjacent; the groups by island
    rank; one line naming the flag for a launch that does not split."""
    layout = plan_layout(8, 2, False, 2, 2, True)
    assert (layout.island_size, layout.data_parallel, layout.launch_world) == (4, 1, 8)
    assert [tuple(layout.position(r)) for r in range(8)] == [
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0), (0, 1, 0, 1),
        (1, 0, 0, 0), (1, 0, 0, 1), (1, 1, 0, 0), (1, 1, 0, 1)]
    assert "    stage 1 neuron groups: [2, 3]" in layout.groups()
    assert layout.grid()[5] == "  rank 5: island 1, stage 0, neurons 1 of 2, data rank 0 of 1"
    four = plan_layout(4, 1, False, 1, 2, False)
    assert four.groups() == ["  neuron groups: [0, 1] [2, 3]",
                             "  data-parallel groups: [0, 2] [1, 3]"]
    assert four.one_island() == Layout(neurons=2, data_parallel=2)
    with pytest.raises(ValueError, match=r"^--neuron_parallel 4: the ranks per stage 2 is not "):
        plan_layout(8, 2, False, 2, 4, True)
    with pytest.raises(ValueError, match=r"^--diloco_islands 3: the world size 8 is not "):
        plan_layout(8, 3, False, 1, 1, False)


# 2 islands, H 2 (F=2 fragments: H 4), checksums of the weights after every outer step
ISLANDS = ["--diloco_islands", "2", "--diloco_inner_steps", "2", "--diloco_checksum"]
DELAYED = ["--diloco_mode", "delayed"]
# int4 blocks of 32 values: a block is then the same values whether a rank holds all of a
# neuron row or a share of it, so the split quantizes exactly what the unsplit island does
INT4_FRAGMENTS = [*DELAYED, "--diloco_fragments", "2", "--diloco_compress", "int4",
                  "--diloco_int8_block", "32", "--diloco_inner_steps", "4", "--save_steps", "8",
                  "--diloco_outer_momentum", "0.3"]
SPLIT = ["--neuron_parallel", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("mode, extra", [("sync", []), ("delayed", DELAYED),
                                         ("int4_fragments", INT4_FRAGMENTS)])
def test_islands_of_two_neuron_shares_equal_islands_of_one_rank(mode, extra, runs):
    """2 islands x K=2 (4 ranks, ZeRO-2) against 2 islands x 1 rank: each rank's pseudo-gradient
    covers its share and meets the same share of the other island. Losses, evaluations and the
    outer gradient norms of both islands within 2e-5 (the neuron sums are added in another
    order), the weights after every outer step within rounding, the islands identical at the
    end, the export the same model; each rank sends less than the unsplit rank."""
    one = islands_run(runs, f"islands_{mode}", extra=[*ISLANDS, *extra])
    split = islands_run(runs, f"islands_neurons_{mode}", nproc=4, extra=[*ISLANDS, *extra, *SPLIT])
    for island in (0, 1):
        a, b = island_metrics(one, island), island_metrics(split, island)
        assert losses(b) == pytest.approx(losses(a), abs=LOSS_ATOL)
        assert losses(b, "eval_loss") == pytest.approx(losses(a, "eval_loss"), abs=LOSS_ATOL)
        assert losses(b, "outer_grad_norm") == pytest.approx(losses(a, "outer_grad_norm"),
                                                             rel=1e-4)
        # int4: a value the split's rounding puts on the other side of a code boundary moves
        # by one code (about a seventh of its block's largest value)
        tolerance = 2e-3 if "int4" in extra else 1e-4
        assert losses(b, "weights_sum") == pytest.approx(losses(a, "weights_sum"),
                                                         abs=tolerance)
        assert max(losses(b, "outer_payload_bytes")) < max(losses(a, "outer_payload_bytes"))
    outer = [[m for m in island_metrics(split, i) if "outer_step" in m] for i in (0, 1)]
    for key in ("weights_sum", "weights_sumsq", "outer_sum", "outer_sumsq"):
        assert outer[0][-1][key] == outer[1][-1][key], key  # identical islands at the end
    assert (final_logits(split) - final_logits(one)).abs().max() < 50 * tolerance


@pytest.mark.slow
def test_a_split_model_carries_its_share_of_the_state(runs):
    """--carry_state with K=2 (each rank carries its own neurons' rows of every state) trains as
    one rank carrying the whole state: losses, evaluations (also on carried state) and gradient
    norms."""
    carry = [*CARRY, "--gradient_accumulation_steps", "2"]
    _, one, _ = runs("carry_1rank", nproc=1, extra=carry)
    _, split, _ = runs("carry_neurons", extra=[*carry, *SPLIT])
    for key in ("loss", "eval_loss", "eval_loss_carried"):
        assert losses(split, key) == pytest.approx(losses(one, key), abs=LOSS_ATOL), key
    assert losses(split, "grad_norm") == pytest.approx(losses(one, "grad_norm"), rel=1e-4)
