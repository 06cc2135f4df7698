"""Layouts that compose (dragon.parallel.layout): the layout value itself, and neuron parallelism
inside DiLoCo islands and with carried state, each against the same run without the split."""

import shutil
from pathlib import Path

import pytest
import torch
from conftest import CARRY, LOSS_ATOL, losses, run_tool
from test_diloco import final_logits, island_metrics, islands_run

from dragon.model.bdh import BDHForCausalLM
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
                  "--diloco_outer_momentum", "0.3", "--diloco_fragment_delay", "1"]
SPLIT = ["--neuron_parallel", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("mode, extra", [("sync", []), ("int4_fragments", INT4_FRAGMENTS)])
def test_islands_of_two_neuron_shares_equal_islands_of_one_rank(mode, extra, runs):
    """2 islands x K=2 (4 ranks, ZeRO-2) against 2 islands x 1 rank, sync and delayed (int4
    fragments, which also cover delayed mode's landing): each rank's pseudo-gradient
    covers its share and meets the same share of the other island. Losses, evaluations and the
    outer gradient norms of both islands within 2e-5 (the neuron sums are added in another
    order), the weights after every outer step within rounding, the islands identical at the
    end, the exports' logits within 1e-5 (with int4 within 1e-2: a weight whose rounding lands
    on the other side of a code boundary is a code apart); each rank sends less than the
    unsplit rank."""
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
    # the export: the neuron sums' rounding in sync mode; with int4 a few weights a code apart
    gap = (final_logits(split) - final_logits(one)).abs().max()
    assert gap < (1e-2 if "int4" in extra else 1e-5), gap


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


# ---- neurons x pipeline, and the whole grid ------------------------------------------------

PIPE = "recipes/pretrain_pipeline.py"
PIPE_NEURONS = ["--pipeline_stages", "2", *SPLIT]


def resume_copy(out, tmp_path, islands=(None,)) -> Path:
    """A new run directory holding only the step-4 checkpoint of `out` (of each island), beside
    the run's files (config.json, run.json)."""
    resumed = tmp_path / f"{out.name}_resumed"
    for island in islands:
        where = Path(f"island{island}") if island is not None else Path()
        shutil.copytree(out / where / "checkpoints" / "step4",
                        resumed / where / "checkpoints" / "step4")
        for file in (out / where / "checkpoints").glob("*.json"):
            shutil.copy(file, resumed / where / "checkpoints")
        (resumed / where / "checkpoints" / "latest").write_text("step4")
    return resumed


@pytest.mark.slow
def test_a_pipeline_of_neuron_shares_equals_one_process(runs, tmp_path):
    """2 stages x K=2 (4 ranks, each stage's copy of the shared block split in two, tied within
    each share) equal the ZeRO recipe on one process over 8 steps within 2e-5: losses,
    evaluations, BDH's sparsity, the export; recipes/export.py joins the shares of the
    checkpoint into the same model exactly. Resumed at step 4, steps 5-8 repeat bit for bit (the
    RNG streams' part of a pipeline's resume, with dropout on, is in test_checkpoints)."""
    single_out, single, _ = runs("single_accum", launcher="python", nproc=1, micro=4,
                                 extra=["--gradient_accumulation_steps", "4"])
    out, split, _ = runs("pipe2_neurons", nproc=4, config="pipeline_zero0.json", script=PIPE,
                         extra=[*PIPE_NEURONS, "--gradient_accumulation_steps", "4"])
    for key in ("loss", "eval_loss", "sparsity/layer1/xy"):
        assert losses(split, key) == pytest.approx(losses(single, key), abs=LOSS_ATOL), key
    assert (final_logits(out) - final_logits(single_out)).abs().max() < 1e-4
    exported = run_tool("recipes/export.py", "--checkpoint", out / "checkpoints" / "step8",
                        "--output", tmp_path / "hf")
    assert exported.returncode == 0, exported.stderr[-3000:]
    ids = torch.arange(64).view(2, 32)
    with torch.no_grad():
        exported_logits = BDHForCausalLM.from_pretrained(tmp_path / "hf")(ids).logits
    assert torch.equal(exported_logits, final_logits(out))

    _, resumed, _ = runs("pipe2_neurons_resumed", nproc=4, config="pipeline_zero0.json",
                         script=PIPE, out=resume_copy(out, tmp_path),
                         extra=[*PIPE_NEURONS, "--gradient_accumulation_steps", "4",
                                "--resume_from_checkpoint", "latest"])
    assert [m["step"] for m in resumed] == [5, 6, 7, 8]
    assert losses(resumed) == losses(split)[4:]


@pytest.mark.slow
def test_the_whole_grid_trains_resumes_and_ends_on_identical_islands(runs, tmp_path):
    """8 ranks = 2 DiLoCo islands (delayed, int8) x 2 pipeline stages (ZeRO-1, dropout on) x
    K=2: the loss falls, the islands end on identical weights and theta_outer, and resumed at
    step 4 both islands repeat steps 5-8 bit for bit."""
    grid = [*PIPE_NEURONS, "--gradient_accumulation_steps", "2", "--dropout", "0.2", *ISLANDS,
            "--diloco_mode", "delayed", "--diloco_compress", "int8"]
    out = islands_run(runs, "grid", nproc=8, config="pipeline_zero1.json", script=PIPE,
                      extra=grid)
    metrics = [island_metrics(out, i) for i in (0, 1)]
    assert losses(metrics[0])[-1] < losses(metrics[0])[0] - 0.3
    last = [[m for m in island if "outer_step" in m][-1] for island in metrics]
    for key in ("weights_sum", "weights_sumsq", "outer_sum", "outer_sumsq"):
        assert last[0][key] == last[1][key], key
    resumed = islands_run(runs, "grid_resumed", nproc=8, config="pipeline_zero1.json",
                          script=PIPE, out=resume_copy(out, tmp_path, (0, 1)),
                          extra=[*grid, "--resume_from_checkpoint", "latest"])
    for island in (0, 1):
        again = island_metrics(resumed, island)
        assert [m["step"] for m in again if "loss" in m] == [5, 6, 7, 8]
        assert losses(again) == losses(metrics[island])[4:]


# ---- resume on another layout ----------------------------------------------------------------


ACCUMULATE4 = ["--gradient_accumulation_steps", "4"]
# where a K=2 ZeRO-2 checkpoint resumes: (ranks, DeepSpeed JSON, micro-batch, recipe, flags)
ONTO = {"k4_zero3": (4, "zero3.json", 8, "recipes/pretrain.py", ["--neuron_parallel", "4"]),
        "k4_zero0": (4, "zero0.json", 8, "recipes/pretrain.py", ["--neuron_parallel", "4"]),
        "k2_pipe_zero1": (4, "pipeline_zero1.json", 2, PIPE, [*PIPE_NEURONS, *ACCUMULATE4]),
        "k2_pipe_zero0": (4, "pipeline_zero0.json", 2, PIPE, [*PIPE_NEURONS, *ACCUMULATE4])}


@pytest.mark.slow
@pytest.mark.parametrize("onto", ONTO)
def test_a_neuron_split_checkpoint_resumes_on_another_split(onto, runs, tmp_path):
    """A K=2 checkpoint (ZeRO-2, 2 ranks) resumed at step 4 with K=4 (4 ranks, ZeRO-3, each
    share cut from the whole parameter over the neuron group; ZeRO-0 with a file per share) and
    as 2 pipeline stages x K=2 (ZeRO-0, its files cut per share; ZeRO-1, loading the same form
    through a universal folder under the pipeline's parameter names; a join into K=1 is in
    test_a_zero1_pipeline_resumes_on_zero2_without_the_pipeline):
    the shares' weights and Adam moments are joined into the whole model and re-split, and
    steps 5-8, the evaluation and the export continue the uninterrupted run within 2e-5."""
    nproc, config, micro, script, flags = ONTO[onto]
    out, full, _ = runs("neurons_zero2", config="zero2.json", micro=8, extra=SPLIT)
    resumed_out, resumed, proc = runs(
        f"neurons_resumed_{onto}", nproc=nproc, config=config, micro=micro, script=script,
        out=resume_copy(out, tmp_path), extra=[*flags, "--resume_from_checkpoint", "latest"])
    assert "resume: converting the checkpoint from ZeRO-2 on 1 data-parallel rank(s) x 2 neuron " \
        "shares" in proc.stderr + proc.stdout
    assert [m["step"] for m in resumed if "loss" in m] == [5, 6, 7, 8]
    for key in ("loss", "eval_loss"):
        assert losses(resumed, key) == pytest.approx(losses(full, key)[-len(losses(resumed, key)):],
                                                     abs=LOSS_ATOL), key
    assert (final_logits(resumed_out) - final_logits(out)).abs().max() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("onto, config, micro, flags", [("zero3", "zero3.json", 2, []),
                                                        ("neurons", "zero2.json", 4, SPLIT)])
def test_a_fragmented_diloco_run_resumes_on_another_island_layout(onto, config, micro, flags,
                                                                  runs, tmp_path):
    """2 islands x 2 ZeRO-2 ranks, 2 fragments in delayed mode, resumed at step 4 (fragment 0's
    exchange in flight) on ZeRO-3 islands, and on islands of K=2 neuron shares: every fragment's
    theta_outer, outer momentum and the average in flight are laid out for the new partition
    (cut by neuron), and steps 5-8 continue the uninterrupted run within 2e-5 on both islands,
    which end identical."""
    fragments = [*ISLANDS[:2], "--diloco_inner_steps", "4", "--diloco_checksum",
                 "--diloco_fragments", "2", *DELAYED, "--diloco_outer_momentum", "0.5",
                 "--diloco_fragment_delay", "1"]
    out = islands_run(runs, "fragments_fp32_zero2", nproc=4, micro=2, extra=fragments)
    resumed = islands_run(runs, f"fragments_fp32_on_{onto}", nproc=4, micro=micro, config=config,
                          out=resume_copy(out, tmp_path, (0, 1)),
                          extra=[*fragments, *flags, "--resume_from_checkpoint", "latest"])
    for island in (0, 1):
        full, again = island_metrics(out, island), island_metrics(resumed, island)
        assert [m["step"] for m in again if "loss" in m] == [5, 6, 7, 8]
        assert losses(again) == pytest.approx(losses(full)[4:], abs=LOSS_ATOL)
        sums = {m["step"]: m["outer_sum"] for m in full if m["step"] > 4 and "outer_sum" in m}
        assert {m["step"]: pytest.approx(m["outer_sum"], abs=1e-4) for m in again
                if "outer_sum" in m} == sums
    last = [[m for m in island_metrics(resumed, i) if "outer_step" in m][-1] for i in (0, 1)]
    for key in ("weights_sum", "outer_sum"):
        assert last[0][key] == last[1][key], key


@pytest.mark.slow
def test_diloco_islands_resume_into_and_out_of_a_pipeline(runs, tmp_path):
    """2 delayed islands of a 2-stage ZeRO-1 pipeline resumed at step 4 (an average in flight)
    as 2 islands of one ZeRO-2 rank, and the other way round: a stage's DiLoCo state names the
    plain model's parameters, so theta_outer, the outer momentum and the average in flight are
    joined into the whole model's and cut again; steps 5-8, the evaluation and the outer
    checksums continue the uninterrupted run within 2e-5 on both islands."""
    pipe = dict(nproc=4, config="pipeline_zero1.json", script=PIPE)
    pipe_flags = [*ISLANDS, *DELAYED, "--pipeline_stages", "2"]
    piped = islands_run(runs, "islands_pipe2_zero1", **pipe, extra=pipe_flags)
    plain = islands_run(runs, "islands_delayed", extra=[*ISLANDS, *DELAYED])
    for out, name, onto, flags in ((piped, "islands_pipe2_as_zero2", {}, [*ISLANDS, *DELAYED]),
                                   (plain, "islands_as_pipe2_zero1", pipe, pipe_flags)):
        resumed = islands_run(runs, name, **onto, out=resume_copy(out, tmp_path, (0, 1)),
                              extra=[*flags, "--resume_from_checkpoint", "latest"])
        for island in (0, 1):
            full, again = island_metrics(out, island), island_metrics(resumed, island)
            assert [m["step"] for m in again if "loss" in m] == [5, 6, 7, 8]
            for key in ("loss", "eval_loss", "outer_sum"):
                assert losses(again, key) == pytest.approx(
                    losses(full, key)[-len(losses(again, key)):], abs=LOSS_ATOL), (name, key)


@pytest.mark.slow
def test_islands_of_neuron_shares_resume_unsplit(runs, tmp_path):
    """2 delayed islands x K=2, resumed at step 4 (an average in flight) as 2 islands of one
    unsplit rank: theta_outer, the outer momentum, the last pseudo-gradient and the average in
    flight are joined by neuron (each share's values placed through its cut), and steps 5-8
    and the outer steps continue the uninterrupted run within 2e-5 on both islands."""
    out = islands_run(runs, "islands_neurons_delayed", nproc=4, extra=[*ISLANDS, *DELAYED, *SPLIT])
    resumed = islands_run(runs, "islands_neurons_delayed_unsplit", out=resume_copy(
        out, tmp_path, (0, 1)), extra=[*ISLANDS, *DELAYED, "--resume_from_checkpoint", "latest"])
    for island in (0, 1):
        full, again = island_metrics(out, island), island_metrics(resumed, island)
        assert [m["step"] for m in again if "loss" in m] == [5, 6, 7, 8]
        for key in ("loss", "eval_loss", "outer_grad_norm"):
            assert losses(again, key) == pytest.approx(
                losses(full, key)[-len(losses(again, key)):], abs=LOSS_ATOL), key
        sums = {m["step"]: m["outer_sum"] for m in full if m["step"] > 4 and "outer_sum" in m}
        assert {m["step"]: pytest.approx(m["outer_sum"], abs=1e-4) for m in again
                if "outer_sum" in m} == sums


@pytest.mark.slow
def test_the_accelerate_recipe_with_diloco_islands_equals_the_zero_recipe(runs):
    """2 DiLoCo islands of one rank under `accelerate launch` train as the ZeRO recipe's 2
    islands under torchrun: losses, evaluations and outer gradient norms of both islands within
    2e-5, the same outer steps, the export the same model."""
    ours = islands_run(runs, "islands_sync", extra=ISLANDS)
    out, _, _ = runs("accelerate_islands", launcher="accelerate", config="zero2.yaml",
                     script="recipes/pretrain_accelerate.py", extra=ISLANDS)
    for island in (0, 1):
        a, b = island_metrics(ours, island), island_metrics(out, island)
        for key in ("loss", "eval_loss", "outer_grad_norm"):
            assert losses(b, key) == pytest.approx(losses(a, key), abs=LOSS_ATOL), key
        assert losses(b, "outer_step") == losses(a, "outer_step") == [1, 2, 3, 4]
    assert (final_logits(out) - final_logits(ours)).abs().max() < 1e-4


@pytest.mark.slow
def test_a_zero1_pipeline_resumes_on_zero2_without_the_pipeline(runs, tmp_path):
    """A 2-stage ZeRO-1 pipeline (its Adam state partitioned per stage) resumed at step 4 by the
    ZeRO recipe on 2 ZeRO-2 ranks: the stages' weights and moments become the whole model's
    universal checkpoint, and steps 5-8, the evaluation and the export continue the pipeline's
    uninterrupted run within 2e-5; here a pipeline of K=2 shares, joined at K=1."""
    for name, flags in (("pipe2_zero1_neurons", SPLIT),):
        extra = ["--pipeline_stages", "2", "--gradient_accumulation_steps", "4", *flags]
        out, full, _ = runs(name, nproc=2 * (len(flags) // 2 + 1), config="pipeline_zero1.json",
                            script=PIPE, extra=extra)
        resumed_out, resumed, proc = runs(
            f"{name}_as_zero2", micro=2, out=resume_copy(out, tmp_path),
            extra=["--gradient_accumulation_steps", "4", "--resume_from_checkpoint", "latest"])
        assert "resume: converting the checkpoint from a pipeline of 2 stages with ZeRO-1" in \
            proc.stderr + proc.stdout
        assert [m["step"] for m in resumed if "loss" in m] == [5, 6, 7, 8]
        for key in ("loss", "eval_loss"):
            assert losses(resumed, key) == pytest.approx(
                losses(full, key)[-len(losses(resumed, key)):], abs=LOSS_ATOL), (name, key)
        assert (final_logits(resumed_out) - final_logits(out)).abs().max() < 1e-4
