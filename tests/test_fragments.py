"""Streaming DiLoCo (--diloco_fragments): BDH's cut into fragments, the schedule and the outer
steps of one island against a hand simulation, then real recipe jobs of several islands: one
fragment is today's DiLoCo bit for bit, four fragments agree across islands, send a quarter at a
time and resume exactly with a fragment in flight."""

import shutil
import signal
import sys

import pytest
import torch
from conftest import (
    DILOCO_DELAYED,
    DILOCO_ZERO3,
    REPO,
    bad_input_base,
    losses,
    run_recipe_in_process,
)
import test_elastic as elastic
from test_diloco import island_metrics, islands_run, nesterov
from test_faults import signal_after

from dragon import BDHConfig, BDHForCausalLM
from dragon.run.diloco_args import DiLoCoArguments
from dragon.diloco.fragment_cut import fragment_ids
from dragon.diloco.outer import DiLoCo
from dragon.parallel.topology import Topology

sys.path.insert(0, str(REPO / "tests" / "scripts"))
import diloco_islands as toy  # noqa: E402

# ------------------------------------------------------------------ the cut


def tiny_bdh() -> BDHForCausalLM:
    return BDHForCausalLM(BDHConfig(n_layer=2, n_embd=32, n_head=2,
                                    mlp_internal_dim_multiplier=8, vocab_size=256))


def test_a_fragment_holds_whole_neurons_and_tokens_and_a_quarter_of_the_model():
    """F = 4 on BDH: neuron n of every head (its encoder and encoder_v columns, its decoder row)
    and token v (its embedding row, its lm_head column) lie in one fragment, n mod F and v F / V;
    the fragments are the same size. Cut as ZeRO cuts (a flat partition through the middle of
    parameters), every value keeps its fragment."""
    model = tiny_bdh()
    named = dict(model.named_parameters())
    shapes = {n: tuple(p.shape) for n, p in named.items()}
    numels = [p.numel() for p in named.values()]
    whole = fragment_ids([[(n, 0, 0, p.numel())] for n, p in named.items()], shapes, numels, 4)
    assert torch.bincount(whole.long()).tolist() == [sum(numels) // 4] * 4
    ids = dict(zip(named, whole.split(numels)))
    nh, D, N = shapes["layer.encoder"]
    neuron = torch.arange(N) % 4
    for name in ("layer.encoder", "layer.encoder_v"):
        assert torch.equal(ids[name].view(nh, D, N).long(), neuron.expand(nh, D, N))
    assert torch.equal(ids["layer.decoder"].view(nh, N, -1).long(),
                       neuron[None, :, None].expand(nh, N, D))
    V = shapes["lm_head"][1]
    token = torch.arange(V) * 4 // V
    assert torch.equal(ids["embed.weight"].view(V, D).long(), token[:, None].expand(V, D))
    assert torch.equal(ids["lm_head"].view(D, V).long(), token.expand(D, V))
    # two ZeRO-like partitions of one flat group, the cut inside the decoder
    flat_names, total, cut = list(named), sum(numels), sum(numels) // 2 + 100
    parts = [[], []]
    offset = 0
    for name, numel in zip(flat_names, numels):
        for part, (lo, hi) in enumerate(((0, cut), (cut, total))):
            a, b = max(lo, offset), min(hi, offset + numel)
            if a < b:
                parts[part].append((name, a - offset, a - lo, b - a))
        offset += numel
    halves = [fragment_ids([pieces], shapes, [size], 4)
              for pieces, size in zip(parts, (cut, total - cut))]
    assert torch.equal(torch.cat(halves), whole)


# ------------------------------------------------------------------ one island by hand

H, F, STEPS_BY_HAND = 4, 4, 10


def simulate(mode: str, delay: int, alpha: float):
    """One island of toy weights, fragments of 250 contiguous values, every outer step by hand:
    after each inner step, (the weights, the fragments that synced, those that landed)."""
    w = torch.cat([t.flatten() for t in toy.initial_weights()])
    centre = torch.cat([t.flatten() for t in toy.centre(0)])
    masks = [(torch.arange(w.numel()) * F // w.numel()) == f for f in range(F)]
    outer, bufs, flight, record = [w[m].clone() for m in masks], [None] * F, {}, []
    for step in range(1, STEPS_BY_HAND + 1):
        w = w - toy.INNER_LR * (w - centre)
        final = step == STEPS_BY_HAND
        landed = sorted(f for f, (_, at) in flight.items() if at <= step or final)
        for f in landed:
            outer[f], bufs[f] = nesterov(outer[f], bufs[f], flight.pop(f)[0])
            w[masks[f]] = alpha * w[masks[f]] + (1 - alpha) * outer[f]
        syncing = list(range(F)) if final else [
            f for f in range(F) if step >= max(f, 1) and step % H == f * H // F]
        deltas = {f: outer[f] - w[masks[f]] for f in syncing}
        for f, delta in deltas.items():
            if mode == "sync" or final:
                outer[f], bufs[f] = nesterov(outer[f], bufs[f], delta)
                w[masks[f]] = outer[f]
                landed.append(f)
            else:
                flight[f] = (delta, step + delay)
        record.append((w.clone(), syncing, sorted(set(landed))))
    return record


@pytest.mark.parametrize("mode,delay,alpha", [("sync", 0, 0.0), ("delayed", 1, 0.5),
                                              ("delayed", 1, 0.0)])
def test_one_island_of_four_fragments_equals_the_hand_simulation(mode, delay, alpha):
    """Fragment f syncs once per window, at inner steps f H / F + kH, steps its own Nesterov
    outer optimizer, and (delayed) lands `delay` steps later merged with the local progress; the
    last step syncs every fragment. Weights after every step within 1e-6."""
    args = DiLoCoArguments(diloco_inner_steps=H, diloco_fragments=F, diloco_mode=mode,
                           diloco_fragment_alpha=alpha, diloco_outer_momentum=0.9,
                           diloco_fragment_delay=delay or None)
    weights = toy.Weights(toy.initial_weights())
    ids = (torch.arange(1000) * F // 1000).to(torch.int8)
    outer = DiLoCo(weights, args.config(), Topology(), ids=ids)
    for step, (want, syncing, landed) in enumerate(simulate(mode, delay, alpha), 1):
        with torch.no_grad():
            for t, c in zip(weights.tensors(), toy.centre(0)):
                t.sub_(toy.INNER_LR * (t - c))
        metrics = outer.maybe_outer_step(step, final=step == STEPS_BY_HAND)
        last = step == STEPS_BY_HAND
        assert metrics.get("outer_fragment") == (F if last else next(iter(syncing), None)), step
        assert metrics.get("outer_landed") == (F if last else next(iter(landed), None)), step
        got = torch.cat([t.flatten() for t in weights.tensors()])
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    first_window = [f for s in range(1, H + 1) for f in outer.syncing(s, False)]
    assert sorted(first_window) == list(range(F)) and first_window == [1, 2, 3, 0]


# ------------------------------------------------------------------ recipe jobs


@pytest.mark.parametrize("shared", ["diloco_zero3", "diloco_delayed"])
def test_one_fragment_is_todays_diloco_bit_for_bit(runs, shared):
    """--diloco_fragments 1 trains as a run without it: sync (ZeRO-3, H 4) and delayed (ZeRO-0,
    dropout, H 2); every loss and every checksum of the weights equal, bit for bit."""
    setting = DILOCO_ZERO3 if shared == "diloco_zero3" else DILOCO_DELAYED
    before = islands_run(runs, shared, **setting)
    one = islands_run(runs, f"{shared}_f1", config=setting["config"],
                      extra=[*setting["extra"], "--diloco_fragments", "1"])
    for island in (0, 1):
        a, b = island_metrics(before, island), island_metrics(one, island)
        assert losses(a) == losses(b)
        for key in ("weights_sum", "weights_sumsq", "outer_sum", "outer_sumsq"):
            assert losses(a, key) == losses(b, key) and losses(a, key), key


FRAGMENTS = ["--diloco_islands", "2", "--diloco_inner_steps", "4", "--diloco_checksum",
             "--diloco_fragments", "4", "--dropout", "0.2"]
DELAYED_INT4 = [*FRAGMENTS, "--diloco_mode", "delayed", "--diloco_compress", "int4",
                "--diloco_int8_block", "256", "--diloco_fragment_delay", "1"]


def fragment_records(out, island: int) -> list[dict]:
    return [m for m in island_metrics(out, island) if "outer_step" in m]


@pytest.mark.slow
def test_four_delayed_int4_fragments_on_zero2_islands(runs, tmp_path, monkeypatch, text_file):
    """2 islands x 2 ZeRO-2 ranks, F = 4, H 4, 4-bit, each fragment in flight for one step: one
    fragment syncs per step at its offset and lands a step later; theta_outer is bit-identical on
    both islands after every landing and the weights after the last step; a fragment is a
    quarter of the payload; the loss falls. Resumed at step 4, with fragment 0 in flight, steps
    5-8 repeat bit for bit; a resume without --diloco_fragments 4 is refused in one line."""
    full_out = islands_run(runs, "fragments_zero2_int4", nproc=4, micro=2, extra=DELAYED_INT4)
    records = [fragment_records(full_out, i) for i in (0, 1)]
    assert [m["outer_fragment"] for m in records[0]] == [1, 2, 3, 0, 1, 2, 3, 4]  # 4: all
    assert [m.get("outer_landed") for m in records[0]] == [None, 1, 2, 3, 0, 1, 2, 4]
    for a, b in zip(*records):
        assert (a["outer_sum"], a["outer_sumsq"]) == (b["outer_sum"], b["outer_sumsq"])
    assert records[0][-1]["weights_sum"] == records[1][-1]["weights_sum"]
    assert records[0][-1]["weights_sumsq"] == records[1][-1]["weights_sumsq"]
    payloads = [m["outer_payload_bytes"] for m in records[0]]
    assert max(payloads[:-1]) <= 0.3 * payloads[-1]  # the last step sends every fragment
    assert records[0][-2]["outer_peak_bytes"] == max(m["outer_bytes_sent"] for m in records[0][:-1])
    metrics = island_metrics(full_out, 0)
    assert losses(metrics)[-1] < losses(metrics)[0] - 0.3
    resumed_out = tmp_path / "resumed"
    for i in (0, 1):
        shutil.copytree(full_out / f"island{i}" / "checkpoints" / "step4",
                        resumed_out / f"island{i}" / "checkpoints" / "step4")
        (resumed_out / f"island{i}" / "checkpoints" / "latest").write_text("step4")
    islands_run(runs, "fragments_zero2_int4_resumed", nproc=4, micro=2, out=resumed_out,
                extra=[*DELAYED_INT4, "--resume_from_checkpoint", "latest"])
    for i in (0, 1):
        full, resumed = island_metrics(full_out, i), island_metrics(resumed_out, i)
        assert [m["step"] for m in resumed] == [5, 6, 7, 8]
        assert losses(resumed) == losses(full)[4:]
        for key in ("outer_sum", "weights_sum", "outer_landed"):
            assert [m.get(key) for m in resumed] == [m.get(key) for m in full[4:]], key
    one = [*bad_input_base("zero2.json", resumed_out, text_file), *BASE,
           "--mlp_internal_dim_multiplier", "8", "--resume_from_checkpoint", "latest"]
    assert "holds DiLoCo state in 4 fragment(s); resume it with --diloco_fragments 4" in (
        run_recipe_in_process(monkeypatch, "recipes/pretrain.py", one, {"WORLD_SIZE": "4"}))
    synced = [*one, "--diloco_fragments", "4"]  # sync mode, the default
    assert "holds DiLoCo state of --diloco_mode delayed; resume it with --diloco_mode delayed" in (
        run_recipe_in_process(monkeypatch, "recipes/pretrain.py", synced, {"WORLD_SIZE": "4"}))


@pytest.mark.slow
def test_four_sync_fragments_on_pipeline_islands_with_topk(runs):
    """2 islands x a 2-stage bf16 pipeline, F = 4 synced in turn, top-k 10 % with error feedback:
    theta_outer identical on both islands after every fragment step, the weights after the last;
    each stage sends a quarter of its entries' codes per step; the loss falls."""
    out = islands_run(runs, "fragments_pipe_topk", nproc=4, micro=4,
                      config="pipeline_zero0.json", script="recipes/pretrain_pipeline.py",
                      extra=["--bf16", "--pipeline_stages", "2", "--gradient_accumulation_steps",
                             "2", *FRAGMENTS[:-2], "--diloco_topk", "0.1"])
    records = [fragment_records(out, i) for i in (0, 1)]
    assert [m["step"] for m in records[0]] == list(range(1, 9))
    for a, b in zip(*records):
        assert (a["outer_sum"], a["outer_sumsq"]) == (b["outer_sum"], b["outer_sumsq"])
        # (step 1 is warm-up's first step at learning rate 0: nothing to send or keep back)
        assert a["outer_residual_norm"] > 0 or a["step"] == 1
    for key in ("weights_sum", "weights_sumsq"):
        assert records[0][-1][key] == records[1][-1][key]
    payloads = [m["outer_payload_bytes"] for m in records[0]]
    assert all(p == pytest.approx(payloads[-1] / 4, rel=0.02) for p in payloads[:-1])
    metrics = island_metrics(out, 0)
    assert losses(metrics)[-1] < losses(metrics)[0] - 0.3


def test_two_sync_int8_fragments_on_zero3_islands(runs):
    """2 islands of one ZeRO-3 rank (H 4), F = 2 synced in turn in int8: a fragment at steps 2, 6
    (fragment 1) and 4 (fragment 0), both at the last step; theta_outer bit-identical on both
    islands after each, the weights after the last; the loss falls."""
    out = islands_run(runs, "fragments_zero3_int8", **dict(
        DILOCO_ZERO3, extra=[*DILOCO_ZERO3["extra"], "--diloco_fragments", "2",
                             "--diloco_compress", "int8"]))
    records = [fragment_records(out, i) for i in (0, 1)]
    assert [(m["step"], m["outer_fragment"]) for m in records[0]] == [(2, 1), (4, 0), (6, 1),
                                                                      (8, 2)]
    for a, b in zip(*records):
        assert (a["outer_sum"], a["outer_sumsq"]) == (b["outer_sum"], b["outer_sumsq"])
        assert 0 < a["outer_compress_error"] < 0.01
    for key in ("weights_sum", "weights_sumsq"):
        assert records[0][-1][key] == records[1][-1][key]
    metrics = island_metrics(out, 0)
    assert losses(metrics)[-1] < losses(metrics)[0] - 0.3


@pytest.fixture
def store():
    with elastic.island_store() as address:
        yield address


@pytest.mark.slow
# delayed only: a sync join of fragments is that join without the landing's redo, and a sync join
# runs in test_elastic (ZeRO-2) and test_multinode (a lost node)
@pytest.mark.parametrize("mode, quorums", [("delayed", [2, 2, 2, 2, 1])])
def test_an_elastic_island_killed_and_rejoined_ends_on_the_live_islands_weights(
        tmp_path, text_file, store, mode, quorums):
    """Elastic ZeRO-2 islands with F = 2 (H 4: a fragment every 2 steps; delayed: each lands
    one step after it syncs, in a round of its own). Island 1 is killed after its step 5;
    island 0 trains on alone from its step 6 (quorum 1). Island 1 started again with
    --diloco_join takes theta_outer and both fragments' outer optimizers at a later fragment
    step (delayed: the landing of that step is redone among both, so that the joiner applies
    the same average): from there theta_outer is bit-identical on both islands at every
    fragment step, and after the last step (every fragment synced) so are the weights."""
    last = 32
    steps = ["--max_steps", str(last), "--eval_steps", str(last), "--save_steps", "8",
             "--diloco_fragments", "2", "--diloco_outer_momentum", "0.3",
             "--lr_scheduler_type", "constant_with_warmup", "--diloco_mode", mode]
    out = tmp_path / "run"
    procs = [elastic.start(i, 2, out, text_file, store, extra=steps) for i in (0, 1)]
    signal_after(procs[1], out / "island1" / "metrics.jsonl", "rank", signal.SIGKILL, ranks=1)
    procs[1].wait(timeout=60)
    joiner = elastic.start_joiner_after_step_8(procs[0], out, store, lambda: elastic.start(
        1, 2, out, text_file, store, extra=[*steps, "--diloco_join"]))
    for proc in (procs[0], joiner):
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
    mine = elastic.outer(out, 0)
    theirs = {m["step"]: m for m in elastic.outer(out, 1) if m["step"] > 6}
    assert [m["outer_quorum"] for m in mine[:len(quorums)]] == quorums  # step 6 alone
    assert min(theirs) > 8 and max(theirs) == last
    assert sorted(theirs) == [m["step"] for m in mine if m["step"] >= min(theirs)]
    assert len(theirs) >= 5
    for m in mine:
        if m["step"] in theirs:
            assert m["outer_quorum"] == 2
            for key in ("outer_sum", "outer_sumsq"):
                assert m[key] == theirs[m["step"]][key], (m["step"], key)
    for key in ("weights_sum", "weights_sumsq"):
        assert mine[-1][key] == theirs[last][key], key
    assert (out / "final" / "model.safetensors").exists()


# ------------------------------------------------------------------ bad input

BASE = ["--diloco_islands", "2", "--diloco_inner_steps", "4"]


@pytest.mark.parametrize("argv,expected", [
    (["--diloco_fragments", "5"], "--diloco_fragments 5: needs --diloco_inner_steps of at least 5, "
     "got 4"),
    (["--diloco_fragments", "0"], "--diloco_fragments 0: must be >= 1"),
    (["--diloco_fragment_delay", "1"], "--diloco_fragment_delay 1 needs --diloco_fragments > 1"),
    (["--diloco_fragments", "2", "--diloco_fragment_delay", "1"],
     "--diloco_fragment_delay 1 overlaps the exchange with inner steps: use it with "
     "--diloco_mode delayed"),
    (["--diloco_fragments", "2", "--diloco_mode", "delayed", "--diloco_fragment_delay", "3"],
     "--diloco_fragment_delay 3: must be auto or in [1, H//F = 2]"),
    (["--diloco_fragments", "2", "--diloco_fragment_delay", "auto"],
     "--diloco_fragment_delay auto overlaps the exchange with inner steps: use it with "
     "--diloco_mode delayed"),
    (["--diloco_fragments", "2", "--diloco_mode", "delayed", "--diloco_fragment_delay", "soon"],
     "--diloco_fragment_delay 'soon': valid are auto or inner steps (an integer)"),
    (["--diloco_fragments", "2", "--diloco_mode", "delayed", "--diloco_fragment_delay", "auto",
      "--diloco_exchange_thread", "false"], "--diloco_fragment_delay auto needs the exchange "
     "thread: drop --diloco_exchange_thread false, or give a delay in steps"),
    (["--diloco_fragments", "2", "--diloco_mode", "delayed", "--diloco_fragment_alpha", "1.5"],
     "--diloco_fragment_alpha 1.5: must be in [0, 1]"),
])
def test_bad_fragment_input_stops_before_start(monkeypatch, text_file, tmp_path, argv, expected):
    base = bad_input_base("zero2.json", tmp_path, text_file)
    assert expected in run_recipe_in_process(monkeypatch, "recipes/pretrain.py",
                                             base + BASE + argv, {})
