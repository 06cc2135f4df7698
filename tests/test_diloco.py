"""DiLoCo: the outer step against hand computations (real gloo groups), then real recipe jobs of
several islands on every engine: equivalences, identical weights across islands, resume,
compression."""

import copy
import json
import math
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import (
    DILOCO_DELAYED,
    LOSS_ATOL,
    REPO,
    bad_input_base,
    free_port,
    job_env,
    losses,
    read_jsonl,
    run_recipe_in_process,
)

from dragon import BDHForCausalLM
from dragon.checkpoint.catalog import is_complete
from dragon.run.diloco_args import DiLoCoArguments
from dragon.diloco.fragment_cut import RUNS, fragment_ids
from dragon.diloco.outer import DiLoCo
from dragon.wire.sparse import topk_encode
from dragon.diloco.state import STATE_VERSION
from dragon.parallel.topology import Topology

sys.path.insert(0, str(REPO / "tests" / "scripts"))
import diloco_islands as toy  # noqa: E402

PIPE = "recipes/pretrain_pipeline.py"


# ------------------------------------------------------------------ the outer step by hand


def nesterov(theta, buf, grad, lr=0.7, mu=0.9):
    """torch.optim.SGD(nesterov=True), written out: buf = mu*buf + g; theta -= lr*(g + mu*buf)."""
    buf = grad.clone() if buf is None else mu * buf + grad
    return theta - lr * (grad + mu * buf), buf


@torch.no_grad()
def inner_step(weights) -> None:
    """The toy inner step of island 0: a gradient step of 0.3 towards its centre."""
    for t, ci in zip(weights.tensors(), toy.centre(0)):
        t.sub_(0.3 * (t - ci))


def toy_outer_loop(args: DiLoCoArguments, steps: int, final_step: int = 0) -> DiLoCo:
    """One island on toy weights: `steps` inner steps, each followed by maybe_outer_step."""
    outer = DiLoCo(toy.Weights(toy.initial_weights()), args.config(), Topology())
    for step in range(1, steps + 1):
        inner_step(outer.weights)
        outer.maybe_outer_step(step, final=step == final_step)
    return outer


def test_outer_nesterov_step_equals_hand_computation():
    """One island, three outer steps of Nesterov SGD (lr 0.7, momentum 0.9) on toy weights."""
    w = toy.initial_weights()
    weights = toy.Weights([t.clone() for t in w])
    outer = DiLoCo(weights, DiLoCoArguments(diloco_inner_steps=2).config(), Topology())
    theta, buf = torch.cat([t.flatten() for t in w]).double(), None
    c = torch.cat([t.flatten() for t in toy.centre(0)]).double()
    for step in range(1, 7):
        inner_step(weights)
        metrics = outer.maybe_outer_step(step)
        if step % 2:
            assert metrics == {}
            continue
        inner = theta.clone()
        for _ in range(2):
            inner = inner - 0.3 * (inner - c)
        delta = theta - inner
        theta, buf = nesterov(theta, buf, delta)
        got = torch.cat([t.flatten() for t in weights.tensors()]).double()
        torch.testing.assert_close(
            got, theta, rtol=1e-5, atol=1e-6
        )  # the working weights are theta_outer
        torch.testing.assert_close(
            outer.theta_outer().double(),
            theta,
            rtol=1e-5,
            atol=1e-6,
        )
        assert metrics["outer_step"] == step // 2 and metrics["outer_bytes_sent"] == 0
        assert metrics["outer_grad_norm"] == pytest.approx(delta.norm().item(), rel=1e-5)
    state = outer.state_dict()  # momentum survives a save / load
    again = DiLoCo(
        toy.Weights([t.clone() for t in weights.tensors()]),
        DiLoCoArguments(diloco_inner_steps=2).config(),
        Topology(),
    )
    again.load_state_dict(state)
    torch.testing.assert_close(
        again.fragments[0].optimizer.state_dict()["state"][0]["momentum_buffer"],
        outer.fragments[0].optimizer.state_dict()["state"][0]["momentum_buffer"],
        rtol=0,
        atol=0,
    )


def format_3(outer: DiLoCo) -> dict:
    """A plain DiLoCo state as dragon saved it before it saved by parameter name (format 3:
    every vector flat over the rank's values)."""
    fragment, x = outer.fragments[0], outer.fragments[0].in_flight
    flight = {"average": x.exchange.result().clone(), "lands_at": x.lands_at,
              "synced_at": x.synced_at, "delta": x.delta.clone(), "contributed": x.contributed,
              "share": x.share}
    return {"version": 3, "outer_step": outer.outer_step, "mode": outer.mode,
            "numels": outer.numels, "fragments": 1, "cut": "interleaved", "segments": None,
            "neuron_share": (0, 1), "peak_bytes": outer.runtime.report.peak_bytes, "pace": None,
            "fragment": [{"outer": fragment.outer.clone(), "residual": None, "in_flight": flight,
                          "optimizer": copy.deepcopy(fragment.optimizer.state_dict())}]}


def format_2(state: dict, sizes: list[int]) -> dict:
    """Format 3's plain DiLoCo `state` as dragon saved it before fragments owned their state
    (format 2; format 1 is the same keys without "version")."""
    fragment, flight = state["fragment"][0], state["fragment"][0]["in_flight"]
    moments = fragment["optimizer"]["state"].get(0, {})
    per_tensor = {i: {k: (v.split(sizes)[i] if torch.is_tensor(v) and v.dim() else v)
                      for k, v in moments.items()} for i in range(len(sizes))} if moments else {}
    return {"version": 2, "outer_step": state["outer_step"], "mode": state["mode"],
            "numels": state["numels"], "segments": None, "neuron_share": (0, 1),
            "outer_params": list(fragment["outer"].split(sizes)),
            "optimizer": {"state": per_tensor, "param_groups": [dict(
                fragment["optimizer"]["param_groups"][0], params=list(range(len(sizes))))]},
            "previous": flight["delta"], "residual": None, "pending": flight["average"],
            "previous_share": flight["share"], "contributed": flight["contributed"],
            "peak_bytes": state["peak_bytes"]}


@pytest.mark.parametrize("version", [1, 2, 3])
def test_a_state_of_an_older_format_resumes_exactly_and_a_newer_one_is_refused(version):
    """A delayed-mode state with momentum and an average in flight, saved in format 1, 2 or 3,
    loads and trains on bit for bit as the same state in today's format; a state of a later
    format is refused in one line."""
    args = DiLoCoArguments(diloco_inner_steps=2, diloco_mode="delayed",
                           diloco_outer_momentum=0.5)
    outer = toy_outer_loop(args, 4)
    state = outer.state_dict()
    assert state["version"] == STATE_VERSION
    older = format_3(outer)
    if version < 3:
        older = format_2(older, [t.numel() for t in outer.weights.tensors()])
    if version == 1:
        del older["version"]
    resumed = []
    for saved in (state, older):
        again = DiLoCo(toy.Weights([t.clone() for t in outer.weights.tensors()]), args.config(),
                       Topology())
        again.load_state_dict(saved)
        for step in range(5, 9):
            inner_step(again.weights)
            again.maybe_outer_step(step)
        resumed.append(again)
    assert torch.equal(resumed[0].theta_outer(), resumed[1].theta_outer())
    assert resumed[0].outer_step == resumed[1].outer_step == 4
    with pytest.raises(ValueError, match=f"this dragon reads formats up to {STATE_VERSION}"):
        again.load_state_dict(dict(state, version=STATE_VERSION + 1))


def test_one_island_delayed_equals_sync_also_past_a_final_step():
    """With one island the eager update has nothing late (the average is its own fresh pseudo-
    gradient), so delayed equals sync under Nesterov, also when a run ended at step 4 goes on."""
    runs = {
        mode: toy_outer_loop(
            DiLoCoArguments(diloco_inner_steps=2, diloco_mode=mode), 8, final_step=4
        ).weights.tensors()
        for mode in ("sync", "delayed")
    }
    for got, want in zip(runs["delayed"], runs["sync"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_delayed_mode_with_outer_momentum_warns():
    with pytest.warns(UserWarning, match="--diloco_outer_momentum 0.9"):
        DiLoCoArguments(diloco_inner_steps=50, diloco_mode="delayed")
    with pytest.warns(
        UserWarning, match="--diloco_outer_lr 1 --diloco_outer_momentum 0.3 did best"
    ):
        DiLoCoArguments(
            diloco_inner_steps=50,
            diloco_mode="delayed",
            diloco_outer_lr=1.0,
            diloco_outer_momentum=0.5,
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DiLoCoArguments(diloco_inner_steps=50, diloco_mode="delayed", diloco_outer_momentum=0.0)
        DiLoCoArguments(
            diloco_inner_steps=50,
            diloco_mode="delayed",
            diloco_outer_lr=1.0,
            diloco_outer_momentum=0.3,
        )
        DiLoCoArguments(diloco_inner_steps=50)


def test_any_torch_optimizer_as_outer_optimizer():
    """outer_optimizer=...: theta_outer follows that optimizer fed the pseudo-gradients."""
    weights = toy.Weights(toy.initial_weights())
    outer = DiLoCo(
        weights,
        DiLoCoArguments(diloco_inner_steps=1).config(),
        Topology(),
        outer_optimizer=lambda params: torch.optim.Adam(params, lr=0.05),
    )
    reference = [t.clone() for t in toy.initial_weights()]
    adam = torch.optim.Adam(reference, lr=0.05)
    for step in range(1, 4):
        inner_step(weights)
        with torch.no_grad():
            for r, t in zip(reference, weights.tensors()):
                r.grad = r - t  # the pseudo-gradient, before the outer step overwrites t
        outer.maybe_outer_step(step)
        adam.step()
        for got, want in zip(weights.tensors(), reference):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fragments_with_adam_as_outer_optimizer_load_as_they_were_saved():
    """Two fragments, one of them a single value, each with an Adam outer optimizer: the state
    saved after outer steps loads into a new outer loop with every fragment's theta_outer,
    moments and step as they were (==)."""
    args = DiLoCoArguments(diloco_inner_steps=2, diloco_fragments=2)
    weights = toy.Weights(toy.initial_weights())
    ids = torch.zeros(sum(t.numel() for t in weights.tensors()), dtype=torch.int8)
    ids[3] = 1

    def outer_loop(weights) -> DiLoCo:
        return DiLoCo(weights, args.config(), Topology(), ids=ids,
                      outer_optimizer=lambda params: torch.optim.Adam(params, lr=0.05))

    outer = outer_loop(weights)
    for step in range(1, 5):
        inner_step(weights)
        outer.maybe_outer_step(step)
    again = outer_loop(toy.Weights([t.clone() for t in weights.tensors()]))
    again.load_state_dict(outer.state_dict())
    for mine, theirs in zip(again.fragments, outer.fragments):
        assert torch.equal(mine.outer, theirs.outer)
        a, b = (f.optimizer.state_dict()["state"][0] for f in (mine, theirs))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class EncoderPartition(toy.Weights):
    """12 of the 16 values of a BDH-shaped encoder (one head, D 2, N 8), as a ZeRO partition
    holds part of a parameter: its fragments hold other counts of values by each cut."""

    def segments(self):
        return [[("layer.encoder", 0, 0, 12)]]

    def shapes(self):
        return {"layer.encoder": (1, 2, 8)}


def format_2_fragments(outer: DiLoCo) -> dict:
    """A sync state of streaming DiLoCo as dragon saved it before fragments owned their state and
    before the cut was named (format 2: the runs cut)."""
    return {"version": 2, "outer_step": outer.outer_step, "mode": outer.mode,
            "numels": outer.numels, "fragments": outer.F, "segments": outer.weights.segments(),
            "neuron_share": (0, 1), "outer_params": [f.outer.clone() for f in outer.fragments],
            "optimizers": [copy.deepcopy(f.optimizer.state_dict()) for f in outer.fragments],
            "in_flight": {}, "residual": None, "peak_bytes": outer.runtime.report.peak_bytes}


@pytest.mark.parametrize("version", [2, STATE_VERSION])
def test_a_state_saved_with_fragments_in_runs_resumes_on_a_partition_as_it_was_cut(version):
    """Fragments saved with the older cut (neurons in runs, not interleaved) on a partition that
    holds part of a parameter, where the two cuts give the fragments other sizes, in format 2 or
    today's: the loaded loop takes the saved cut and trains on bit for bit as the uninterrupted
    one (==)."""
    args = DiLoCoArguments(diloco_inner_steps=2, diloco_fragments=2, diloco_outer_momentum=0.5)
    weights = EncoderPartition([torch.linspace(-1, 1, 12)])
    runs = fragment_ids(weights.segments(), weights.shapes(), [12], 2, RUNS)
    assert torch.bincount(runs.long()).tolist() == [8, 4]  # interleaved: [6, 6]

    def train(outer: DiLoCo, steps: range) -> None:
        for step in steps:
            with torch.no_grad():
                outer.weights.tensors()[0].sub_(0.3 * (outer.weights.tensors()[0] - 2))
            outer.maybe_outer_step(step)

    outer = DiLoCo(weights, args.config(), Topology())
    outer.cut_as(RUNS)
    assert torch.equal(outer.fragments[0].ids, runs)
    train(outer, range(1, 6))
    state = outer.state_dict() if version == STATE_VERSION else format_2_fragments(outer)
    again = DiLoCo(EncoderPartition([weights.tensors()[0].clone()]), args.config(), Topology())
    again.load_state_dict(state)
    assert again.cut == RUNS and torch.equal(again.theta_outer(), outer.theta_outer())
    train(outer, range(6, 10))
    train(again, range(6, 10))
    assert torch.equal(again.theta_outer(), outer.theta_outer())
    assert torch.equal(again.weights.tensors()[0], outer.weights.tensors()[0])


def int8_roundtrip(x: torch.Tensor, block: int, numels: list[int]) -> torch.Tensor:
    """The documented int8 code: scale = absmax / 127 per block (or tensor), q = round(x * (1 /
    scale)).
    """
    pieces = x.split(block) if block else x.split(numels)
    out = []
    for p in pieces:
        scale = p.abs().max() / 127
        inverse = 1 / scale if scale > 0 else torch.zeros(())
        out.append((p * inverse).round().clamp(-127, 127) * scale)
    return torch.cat(out)


def int8_error_bound(x: torch.Tensor, block: int, numels: list[int]) -> float:
    """Round to nearest: |error| <= scale / 2 = absmax / 254 for every value of a block."""
    pieces = x.split(block) if block else x.split(numels)
    return (
        math.sqrt(sum(p.numel() * (p.abs().max().item() / 254) ** 2 for p in pieces))
        / x.norm().item()
    )


def simulate(mode, compress, block=256, lr=0.7, mu=0.9, topk=0.0, island_steps=None):
    """Both islands and the outer loop in fp32 by hand: per outer step, each island's weights and
    theta_outer, and the compression error and average norm the loop should report. Delayed mode is
    Kale et al.'s eager update: each island steps its own Nesterov on the late average with its own
    share of it swapped for its fresh one (with top-k: what it sent; the rest waits in its
    residual). `island_steps` ("3,1"): the inner steps each island trains per outer step, each
    island's pseudo-gradient weighted by its share of them (sent as 2 k_i / sum k times itself)."""
    steps_of = [int(k) for k in island_steps.split(",")] if island_steps else [toy.INNER_STEPS] * 2
    scales = [2 * k / sum(steps_of) for k in steps_of]
    numels = [math.prod(s) for s in toy.SHAPES]
    theta = torch.cat([t.flatten() for t in toy.initial_weights()])
    centres = [torch.cat([t.flatten() for t in toy.centre(i)]) for i in (0, 1)]
    thetas, bufs, previous = (
        [theta.clone(), theta.clone()],
        [None, None],
        [torch.zeros_like(theta)] * 2,
    )
    pending, steps, residuals = None, [], [torch.zeros_like(theta)] * 2
    for k in range(1, toy.OUTER_STEPS + 1):
        w = [x.clone() for x in thetas]
        for i in (0, 1):
            for _ in range(steps_of[i]):
                w[i] = w[i] - toy.INNER_LR * (w[i] - centres[i])
        deltas = [scales[i] * (thetas[i] - w[i]) for i in (0, 1)]
        if topk:  # error feedback: the top entries of delta + residual, in bf16
            deltas = [d + r for d, r in zip(deltas, residuals)]
            sent = [topk_encode(d, topk)[1] for d in deltas]
            residuals = [d - x for d, x in zip(deltas, sent)]
            average = (sent[0] + sent[1]) / 2
        elif compress == "none":
            sent, average = deltas, (deltas[0] + deltas[1]) / 2
        elif compress == "bf16":  # bf16 on the wire, summed in bf16 by the all-reduce
            sent = [d.bfloat16().float() for d in deltas]
            average = (deltas[0].bfloat16() + deltas[1].bfloat16()).float() / 2
        else:  # int8 gathered, dequantized and summed in fp32
            sent = [int8_roundtrip(d, block, numels) for d in deltas]
            average = (sent[0] + sent[1]) / 2
        errors = [((s - d).norm() / d.norm()).item() for s, d in zip(sent, deltas)]
        bounds = [
            int8_error_bound(d, block, numels) if compress == "int8" else 2**-9 for d in deltas
        ]
        final = k == toy.OUTER_STEPS
        if mode == "sync":
            applied = average
            theta, bufs[0] = nesterov(thetas[0], bufs[0], average, lr, mu)
            thetas = [theta, theta]
        else:
            applied = average if final else pending
            late = torch.zeros_like(theta) if pending is None else pending
            own = sent if topk else deltas
            for i in (0, 1):  # the fresh share of this island; at the end, the whole fresh average
                eager = late - previous[i] / 2 + (average if final else own[i] / 2)
                thetas[i], bufs[i] = nesterov(thetas[i], bufs[i], eager, lr, mu)
            previous, pending = own, average
            if final:  # the islands' momenta differ: theta_outer is averaged over them
                thetas = [(thetas[0] + thetas[1]) / 2] * 2
        steps.append(
            {
                "weights": [x.clone() for x in thetas],
                "outer": [x.clone() for x in thetas],
                "errors": errors,
                "bounds": bounds,
                "norm": None if applied is None else applied.norm().item(),
            }
        )
    return steps


@pytest.fixture(scope="module")
def two_islands(tmp_path_factory):
    """tests/scripts/diloco_islands.py as two real islands (one launch each, a gloo group between
    them).
    """
    out = tmp_path_factory.mktemp("islands")
    store = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(REPO / "tests/scripts/diloco_islands.py"),
                str(i),
                store,
                str(out / f"island{i}.json"),
            ],
            cwd=REPO,
            env=job_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (0, 1)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    return [json.loads((out / f"island{i}.json").read_text()) for i in (0, 1)]


def flat(lists):
    return torch.tensor([v for part in lists for v in part])


@pytest.mark.parametrize("index", range(len(toy.SCENARIOS)))
def test_two_islands_equal_hand_simulation(two_islands, index):
    """Sync and delayed schedules, fp32 / bf16 / int8 / top-k on the wire, against the hand
    simulation."""
    scenario = toy.SCENARIOS[index]
    mode, compress = scenario["diloco_mode"], scenario["diloco_compress"]
    block = scenario.get("diloco_int8_block", 256)
    topk = scenario.get("diloco_topk", 0.0)
    expected = simulate(
        mode,
        compress,
        block,
        scenario.get("diloco_outer_lr", 0.7),
        scenario.get("diloco_outer_momentum", 0.9),
        topk,
        scenario.get("diloco_island_steps"),
    )
    # top-k: an int32 index and a bf16 value per entry sent
    payload = 6 * math.ceil(topk * 1000) if topk else {"none": 4000, "bf16": 2000,
                                                       "int8": 1000}[compress]
    for island in (0, 1):
        for k, (got, want) in enumerate(
            zip(two_islands[island][index]["outer_steps"], expected), 1
        ):
            theta, weights = flat(got["outer"]), flat(got["weights"])
            if compress == "int8":
                # An fp32 rounding difference may move a value across a rounding boundary of its
                # int8 code; all but a few values agree to fp32 precision, none by more than 2
                # codes.
                for value, ref in (
                    (theta, want["outer"][island]),
                    (weights, want["weights"][island]),
                ):
                    close = torch.isclose(value, ref, rtol=1e-5, atol=1e-6)
                    assert close.float().mean() >= 0.99, (k, close.float().mean())
                    assert (value - ref).abs().max() <= 2 * 1.5 * ref.abs().max() / 127
            else:
                torch.testing.assert_close(theta, want["outer"][island], rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(weights, want["weights"][island], rtol=1e-5, atol=1e-6)
            m = got["metrics"]
            assert m["outer_step"] == k
            if scenario.get("diloco_island_steps"):  # tokens: one a step in the toy
                assert m["island_steps"] == m["island_tokens"] == (3, 1)[island]
                assert m["outer_weight"] == (0.75, 0.25)[island]
                assert m["island_plan"] == (3, 1)[island]
            assert (
                payload <= m["outer_payload_bytes"] <= payload * 1.06
            )  # + int8 scales and padding
            # one peer: gloo sends each byte of the payload once (measured in sync mode, a model in
            # delayed),
            # and delayed mode's last step the 4000 bytes of theta_outer it averages
            averaged = 4000 if mode == "delayed" and k == toy.OUTER_STEPS else 0
            assert (
                m["outer_payload_bytes"]
                <= m["outer_bytes_sent"] - averaged
                <= m["outer_payload_bytes"] + 1024
            )
            if compress != "none":
                assert m["outer_compress_error"] == pytest.approx(want["errors"][island], rel=0.05)
                assert 0 < m["outer_compress_error"] <= want["bounds"][island]
            if want["norm"] is None:
                assert (
                    "outer_grad_norm" not in m
                )  # delayed: no average has arrived at the first outer step
            else:
                assert m["outer_grad_norm"] == pytest.approx(want["norm"], rel=1e-3)
            if mode == "delayed" and want["norm"] is not None:
                assert 0 <= m["outer_comm_hidden_seconds"] <= m["outer_comm_seconds"]
    if mode == "delayed":  # islands differ between outer steps (own progress), agree at the end
        for key in ("weights", "outer"):
            last = [flat(two_islands[i][index]["outer_steps"][-1][key]) for i in (0, 1)]
            assert torch.equal(last[0], last[1])


def test_data_of_islands_is_one_data_parallel_job():
    """Island i's data rank d reads what rank i * dp + d of one job over every island reads."""
    assert Topology(islands=2, island=1, island_rank=0, island_size=2).data_shard(1, 2) == (3, 4)
    assert Topology(islands=3, island=2, island_rank=1, island_size=4).data_shard(0, 2) == (4, 6)


# ------------------------------------------------------------------ recipe jobs

SGD = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": 0.0,
    "zero_optimization": {"stage": 1},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 10**6,
    "optimizer": {"type": "SGD", "params": {"lr": "auto", "momentum": 0.0, "weight_decay": 0.0}},
}
DILOCO = ["--diloco_islands", "2", "--diloco_inner_steps", "2", "--diloco_checksum"]
LR1 = ["--diloco_outer_lr", "1.0", "--diloco_outer_momentum", "0"]


def island_metrics(out, island):
    return read_jsonl(out / f"island{island}" / "metrics.jsonl")


def islands_run(
    runs,
    name,
    nproc=2,
    config="zero2.json",
    micro=4,
    extra=(),
    out=None,
    script="recipes/pretrain.py",
):
    """conftest's Runs for jobs of several islands: their directory (metrics in
    <out>/island<i>/metrics.jsonl)."""
    return runs(name, nproc=nproc, config=config, micro=micro, extra=extra, out=out,
                script=script)[0]


def assert_islands_identical(
    out, keys=("weights_sum", "weights_sumsq", "outer_sum", "outer_sumsq"), steps=(2, 4, 6, 8)
):
    """After every outer step, the fingerprints of both islands' weights are bit-identical."""
    outer = [[m for m in island_metrics(out, i) if "outer_step" in m] for i in (0, 1)]
    assert [m["step"] for m in outer[0]] == list(steps) == [m["step"] for m in outer[1]]
    for a, b in zip(*outer):
        for key in keys:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])


def final_logits(out):
    model = BDHForCausalLM.from_pretrained(out / "final").eval()
    with torch.no_grad():
        return model(torch.arange(64).view(2, 32)).logits


def test_one_island_with_identity_outer_step_is_plain_training(runs):
    """--diloco_islands 1, outer SGD lr 1 without momentum: theta_outer is the inner weights, step
    for step.
    """
    out, metrics, _ = runs("diloco_1island", extra=["--diloco_inner_steps", "2", *LR1])
    _, ref, _ = runs("zero2")
    assert losses(metrics) == pytest.approx(losses(ref), abs=LOSS_ATOL)
    assert losses(metrics, "eval_loss") == pytest.approx(losses(ref, "eval_loss"), abs=LOSS_ATOL)
    assert [m["outer_step"] for m in metrics if "outer_step" in m] == [1, 2, 3, 4]
    assert (
        out / "checkpoints" / "step8" / "diloco_state_0.pt"
    ).exists()  # one island: the usual layout


@pytest.mark.slow
def test_two_islands_of_two_equal_data_parallel_sgd(runs, tmp_path_factory):
    """2 islands x 2 ranks, inner SGD, H = 1, outer SGD lr 1: synchronous SGD over 4 ranks on the
    same data.
    """
    cfg = tmp_path_factory.mktemp("cfg") / "sgd_zero1.json"
    cfg.write_text(json.dumps(SGD))
    sgd = ["--learning_rate", "0.5", "--max_grad_norm", "0"]
    out = islands_run(
        runs,
        "diloco_sgd_2x2",
        nproc=4,
        micro=2,
        config=str(cfg),
        extra=[
            *sgd,
            *DILOCO[:2],
            "--diloco_inner_steps",
            "1",
            "--diloco_checksum",
            *LR1,
            "--save_steps",
            "4",
        ],
    )
    ref_out, ref, _ = runs("sgd_4ranks", nproc=4, micro=2, config=str(cfg), extra=sgd)
    per_island = [losses(island_metrics(out, i)) for i in (0, 1)]
    assert [(a + b) / 2 for a, b in zip(*per_island)] == pytest.approx(losses(ref), abs=LOSS_ATOL)
    assert losses(island_metrics(out, 0), "eval_loss") == pytest.approx(
        losses(ref, "eval_loss"), abs=LOSS_ATOL
    )
    assert losses(ref)[-1] < losses(ref)[0] - 0.3  # it learns
    torch.testing.assert_close(final_logits(out), final_logits(ref_out), atol=1e-4, rtol=1e-4)
    outer = [m for m in island_metrics(out, 0) if "outer_step" in m]
    assert [m["outer_step"] for m in outer] == list(range(1, 9))
    assert_islands_identical(out, steps=range(1, 9))
    # ZeRO-1 over 2 ranks: each rank ships its half of the fp32 master weights to its peer
    n_params = sum(p.numel() for p in BDHForCausalLM.from_pretrained(out / "final").parameters())
    assert outer[0]["outer_payload_bytes"] == pytest.approx(4 * n_params / 2, rel=0.01)


@pytest.mark.slow
def test_zero3_bf16_int8_islands_stay_identical_and_learn(runs):
    out = islands_run(
        runs,
        "diloco_zero3_int8",
        nproc=4,
        micro=2,
        config="zero3.json",
        extra=["--bf16", *DILOCO, "--diloco_compress", "int8"],
    )
    assert_islands_identical(out)
    metrics = island_metrics(out, 0)
    assert losses(metrics)[-1] < losses(metrics)[0] - 0.3
    errors = [m["outer_compress_error"] for m in metrics if "outer_step" in m]
    assert all(0 < e < 0.01 for e in errors), errors  # int8, 1024 values per scale: under 1 %
    assert (out / "final" / "model.safetensors").exists()
    assert sorted(p.name for p in (out / "island1" / "checkpoints").iterdir() if p.is_dir()) == [
        "step4",
        "step8",
    ]


@pytest.mark.slow
def test_zero2_int4_delayed_islands_agree_and_learn(runs):
    """4-bit pseudo-gradients through the all-to-all / all-gather exchange (its all-gather under
    the next inner steps: delayed mode), islands of two ZeRO-2 ranks, each exchanging its own
    partition's share: the islands end bit-identical, learn, and send about 4.5 bits a value."""
    extra = [*DILOCO, "--diloco_compress", "int4", "--diloco_int8_block", "256",
             "--diloco_mode", "delayed", "--diloco_outer_lr", "1.0", "--diloco_outer_momentum",
             "0.3"]
    out = islands_run(runs, "diloco_zero2_int4", nproc=4, micro=2, extra=extra)
    outer = [[m for m in island_metrics(out, i) if "outer_step" in m] for i in (0, 1)]
    assert [m["step"] for m in outer[0]] == [2, 4, 6, 8] == [m["step"] for m in outer[1]]
    for key in ("weights_sum", "weights_sumsq", "outer_sum", "outer_sumsq"):
        assert outer[0][-1][key] == outer[1][-1][key], key
    metrics = island_metrics(out, 0)
    assert losses(metrics)[-1] < losses(metrics)[0] - 0.3
    assert all(0 < m["outer_compress_error"] < 0.2 for m in outer[0])
    fp32_bytes = 4 * sum(p.numel() for p in BDHForCausalLM.from_pretrained(out / "final")
                         .parameters()) / 2  # each of an island's two ranks ships half
    assert all(m["outer_payload_bytes"] <= fp32_bytes / 7 for m in outer[0])


PIPE_ISLANDS = ["--bf16", "--pipeline_stages", "2", "--gradient_accumulation_steps", "2", *DILOCO]


def pipeline_islands(runs):
    """2 islands x a 2-stage bf16 pipeline, one rank per stage (ZeRO-0): 4 processes."""
    return islands_run(
        runs,
        "diloco_pipe",
        nproc=4,
        micro=4,
        config="pipeline_zero0.json",
        script=PIPE,
        extra=PIPE_ISLANDS,
    )


@pytest.mark.slow
def test_pipeline_islands_stay_identical(runs):
    """2 islands x a 2-stage bf16 pipeline: each stage ships its own weights; the tied block stays
    tied.
    """
    out = pipeline_islands(runs)
    assert_islands_identical(out)
    metrics = island_metrics(out, 0)
    assert losses(metrics)[-1] < losses(metrics)[0] - 0.3
    assert (out / "final" / "model.safetensors").exists()


@pytest.mark.slow
def test_pipeline_with_data_parallel_islands_ship_half_a_stage(runs):
    """2 islands x (2 stages x 2 data-parallel ranks, ZeRO-1), 8 processes: rank r of an island
    ships only its ZeRO partition of its stage, half of what the same stage ships without data
    parallel."""
    out = islands_run(
        runs,
        "diloco_pipe_dp2",
        nproc=8,
        micro=2,
        config="pipeline_zero1.json",
        script=PIPE,
        extra=PIPE_ISLANDS,
    )
    assert_islands_identical(out)
    metrics = island_metrics(out, 0)
    assert losses(metrics)[-1] < losses(metrics)[0] - 0.3
    whole_stage = island_metrics(pipeline_islands(runs), 0)
    payload = {m["outer_payload_bytes"] for m in metrics if "outer_step" in m}
    stage = {m["outer_payload_bytes"] for m in whole_stage if "outer_step" in m}
    assert len(payload) == len(stage) == 1
    assert payload.pop() == pytest.approx(
        stage.pop() / 2, rel=0.01
    )  # rel: ZeRO's alignment padding


def test_delayed_mode_resumes_exactly(runs, tmp_path):
    """ZeRO-0 fp32, delayed outer steps with dropout on: resuming at step 4 (an average in flight)
    replays steps 5-8 of both islands bit for bit. Each island steps its own theta_outer (eager
    updates); the last outer step applies everything and averages them, so the islands end on the
    same weights."""
    extra = DILOCO_DELAYED["extra"]
    full_out = islands_run(runs, "diloco_delayed", **DILOCO_DELAYED)
    full = [island_metrics(full_out, i) for i in (0, 1)]
    assert (
        full[0][1]["outer_sum"] != full[1][1]["outer_sum"]
    )  # step 2: each island's own fresh share
    for key in ("weights_sum", "weights_sumsq", "outer_sum", "outer_sumsq"):
        assert full[0][-1][key] == full[1][-1][key]
    hidden = [m["outer_comm_hidden_seconds"] for m in full[0] if "outer_comm_hidden_seconds" in m]
    assert len(hidden) == 3 and all(h >= 0 for h in hidden)
    resumed = resume_islands_at_step_4(runs, "diloco_delayed_resumed", full_out, tmp_path,
                                       "zero0.json", extra)
    for i in (0, 1):
        assert [m["step"] for m in resumed[i]] == [5, 6, 7, 8]
        assert losses(resumed[i]) == losses(full[i])[4:]
        assert [m.get("outer_sum") for m in resumed[i]] == [m.get("outer_sum") for m in full[i][4:]]


def test_islands_copied_to_a_store_resume_from_it_exactly(runs, tmp_path):
    """2 delayed islands with --checkpoint_copy_to STORE: the store is laid out as the output
    directory, each island's checkpoints whole in <store>/island<i> with `latest` and its
    metrics. With the step-8 copies gone and `latest` at step4 (the store of a run lost after
    step 4's copy), the same command with --resume_from_checkpoint file://STORE in a fresh
    directory fetches each island's copy and resumes it, and with the store's path each island
    reads its own copy where it is: steps 5-8 repeat bit for bit."""
    store = tmp_path / "store"
    extra = [*DILOCO_DELAYED["extra"], "--checkpoint_copy_to", str(store)]
    full_out = islands_run(runs, "diloco_copied", config="zero0.json", extra=extra)
    full = [island_metrics(full_out, i) for i in (0, 1)]
    for i in (0, 1):
        copied = store / f"island{i}"
        assert (copied / "checkpoints" / "latest").read_text() == "step8"
        assert is_complete(str(copied / "checkpoints" / "step8"))
        assert is_complete(str(copied / "checkpoints" / "step4"))
        assert (copied / "metrics.jsonl").is_file()
        shutil.rmtree(copied / "checkpoints" / "step8")
        (copied / "checkpoints" / "latest").write_text("step4")
    fetched, by_path = tmp_path / "fetched", tmp_path / "by_path"
    islands_run(runs, "diloco_copied_fetched", config="zero0.json", out=fetched,
                extra=[*DILOCO_DELAYED["extra"], "--resume_from_checkpoint", f"file://{store}"])
    islands_run(runs, "diloco_copied_by_path", config="zero0.json", out=by_path,
                extra=[*DILOCO_DELAYED["extra"], "--resume_from_checkpoint", str(store)])
    for i in (0, 1):
        assert (fetched / f"island{i}" / "resumed_from" / "checkpoints" / "step4").is_dir()
        assert not (by_path / f"island{i}" / "resumed_from").exists()
        for out in (fetched, by_path):
            resumed = island_metrics(out, i)
            assert [m["step"] for m in resumed] == [5, 6, 7, 8]
            assert losses(resumed) == losses(full[i])[4:]


def resume_islands_at_step_4(runs, name, full_out, tmp_path, config, extra) -> list[list]:
    """Both islands of `full_out` restarted from their step-4 checkpoints (alone in a new
    directory); each island's metrics of the resumed run."""
    resumed_out = tmp_path / "resumed"
    for i in (0, 1):
        shutil.copytree(
            full_out / f"island{i}" / "checkpoints" / "step4",
            resumed_out / f"island{i}" / "checkpoints" / "step4",
        )
        (resumed_out / f"island{i}" / "checkpoints" / "latest").write_text("step4")
    islands_run(runs, name, config=config, out=resumed_out,
                extra=[*extra, "--resume_from_checkpoint", "latest"])
    return [island_metrics(resumed_out, i) for i in (0, 1)]


# SparseLoCo's code of 40,960 values in chunks of 4096, 205 of each sent: 10 fp32 scales, then
# 2 bytes of index and 2 bits of level a value
SPARSELOCO_BYTES = 4 * 10 + 2 * 2050 + 2050 // 4 + 1


@pytest.mark.slow
@pytest.mark.parametrize("name,codec,payload,fall", [
    ("diloco_topk", [], 6 * math.ceil(0.05 * 40_960), 0.3),
    ("diloco_sparseloco", ["--diloco_compress", "sparseloco", *LR1], SPARSELOCO_BYTES, 0.15)])
def test_topk_with_error_feedback_agrees_learns_and_resumes_exactly(runs, tmp_path, name, codec,
                                                                    payload, fall):
    """2 islands (ZeRO-0, H 2, sync) sending 5 % of their pseudo-gradients' entries (top-k, or
    SparseLoCo's 5 % of every chunk in 2 bits): both hold bit-identical weights after every
    outer step, each sent its code's bytes, what each kept back is logged, the loss falls (by
    `fall` in 8 steps: SparseLoCo, without outer momentum, moves less so soon);
    resumed at step 4, steps 5-8 repeat bit for bit (the residual is in the checkpoint: without
    it step 6's average would differ)."""
    extra = [*DILOCO, "--diloco_topk", "0.05", *codec]
    full_out = islands_run(runs, name, config="zero0.json", extra=extra)
    assert_islands_identical(full_out)
    full = [island_metrics(full_out, i) for i in (0, 1)]
    outer = [m for m in full[0] if "outer_step" in m]
    assert {m["outer_payload_bytes"] for m in outer} == {payload}
    assert all(m["outer_residual_norm"] > 0 for m in outer)
    assert losses(full[0])[-1] < losses(full[0])[0] - fall
    resumed = resume_islands_at_step_4(runs, f"{name}_resumed", full_out, tmp_path,
                                       "zero0.json", extra)
    for i in (0, 1):
        assert [m["step"] for m in resumed[i]] == [5, 6, 7, 8]
        assert losses(resumed[i]) == losses(full[i])[4:]
        for key in ("outer_sum", "outer_residual_norm"):
            assert [m.get(key) for m in resumed[i]] == [m.get(key) for m in full[i][4:]]


def test_zero0_bf16_with_bf16_pseudo_gradients(runs):
    """ZeRO-0 bf16 (fp32 copies per parameter), bf16 on the wire: identical islands, learning, small
    error.
    """
    out = islands_run(
        runs,
        "diloco_zero0_bf16",
        config="zero0.json",
        extra=["--bf16", *DILOCO, "--diloco_compress", "bf16"],
    )
    assert_islands_identical(out)
    metrics = island_metrics(out, 0)
    assert losses(metrics)[-1] < losses(metrics)[0] - 0.3
    errors = [m["outer_compress_error"] for m in metrics if "outer_step" in m]
    assert all(0 < e <= 2**-9 for e in errors), (
        errors
    )  # round to nearest bf16: at most 2^-9 relative


# ------------------------------------------------------------------ bad input


ELASTIC_LAUNCH = [
    *"--diloco_islands 2 --diloco_inner_steps 2 --diloco_elastic --diloco_island_index 0".split(),
    *"--diloco_store 127.0.0.1:1 --diloco_store_external".split(),
]


@pytest.mark.parametrize(
    "script,argv,env,expected",
    [
        (
            "recipes/pretrain.py",
            ["--diloco_inner_steps", "0"],
            {},
            "--diloco_inner_steps 0: must be >= 1",
        ),
        (
            "recipes/pretrain.py",
            ["--diloco_inner_steps", "2", "--diloco_compress", "zstd"],
            {},
            "--diloco_compress 'zstd': valid are none, bf16, int8",
        ),
        (
            "recipes/pretrain.py",
            ["--diloco_inner_steps", "3", "--save_steps", "4"],
            {},
            "--save_steps 4: must be a multiple of --diloco_inner_steps 3",
        ),
        (
            "recipes/pretrain.py",
            ["--diloco_islands", "2", "--diloco_inner_steps", "2"],
            {"WORLD_SIZE": "3"},
            "--diloco_islands 2: the world size 3 is not divisible by it",
        ),
        ("recipes/pretrain.py", ["--diloco_islands", "2"], {}, "needs --diloco_inner_steps"),
        (
            "recipes/pretrain.py",
            ["--diloco_inner_steps", "2", "--diloco_mode", "async"],
            {},
            "valid are sync, delayed",
        ),
        (
            PIPE,
            ["--pipeline_stages", "3", "--diloco_islands", "2", "--diloco_inner_steps", "2"],
            {"WORLD_SIZE": "4"},
            "--pipeline_stages 3: the island size 2 is not divisible by it",
        ),
        (
            "recipes/pretrain.py",
            ["--diloco_islands", "2", "--diloco_inner_steps", "2", "--diloco_elastic"],
            {},
            "--diloco_elastic needs one launch per island (--diloco_island_index",
        ),
        (
            "recipes/pretrain.py",
            ["--diloco_islands", "2", "--diloco_inner_steps", "2", "--diloco_join"],
            {},
            "--diloco_join needs --diloco_elastic",
        ),
        (
            "recipes/pretrain.py",
            [*ELASTIC_LAUNCH[:-1]],
            {},
            "--diloco_elastic needs --diloco_store_external",
        ),
        (
            "recipes/pretrain.py",
            [*ELASTIC_LAUNCH, "--diloco_min_islands", "3"],
            {},
            "--diloco_min_islands 3: must be in [1, --diloco_islands 2]",
        ),
        (
            "recipes/pretrain.py",
            ["--diloco_inner_steps", "2", "--diloco_compress", "sparseloco"],
            {},
            "--diloco_compress sparseloco with --diloco_outer_momentum 0.9: its error feedback "
            "replaces outer momentum; add --diloco_outer_momentum 0",
        ),
        *[(
            "recipes/pretrain.py",
            ["--diloco_inner_steps", "2", "--diloco_compress", "sparseloco",
             "--diloco_outer_momentum", "0", flag, value],
            {},
            f"{flag} {value}: must be in {valid}",
        ) for flag, value, valid in (("--diloco_sparseloco_chunk", "70000", "[1, 65536]"),
                                     ("--diloco_sparseloco_decay", "1.5", "(0, 1]"))],
        *[(
            "recipes/pretrain.py",
            ["--diloco_islands", "2", "--diloco_inner_steps", "4", *more],
            {},
            expected,
        ) for more, expected in (
            (["--diloco_island_steps", "4,5"], "--diloco_island_steps '4,5': valid are auto or "
             "2 counts, one per island, each in [1, H = 4] (e.g. 4,4)"),
            (["--diloco_island_steps", "fast"], "--diloco_island_steps 'fast': valid are auto"),
            (["--diloco_island_steps", "auto", "--carry_state"], "--diloco_island_steps auto "
             "with --carry_state: a resting step would break the carried streams"),
            (["--diloco_island_steps", "4,2", "--diloco_mode", "delayed", *ELASTIC_LAUNCH[4:]],
             "--diloco_island_steps 4,2 with --diloco_elastic needs --diloco_mode sync"))],
    ],
)
def test_bad_input_stops_before_start(
    monkeypatch, text_file, tmp_path, script, argv, env, expected
):
    base = bad_input_base(
        ("pipeline_zero0.json" if script == PIPE else "zero2.json"), tmp_path, text_file
    )
    assert expected in run_recipe_in_process(monkeypatch, script, base + argv, env)


def test_a_run_of_one_island_resumed_by_two_is_refused(monkeypatch, runs, tmp_path):
    """The run's checkpoints are in <out>/checkpoints, not island0/: one line naming the way to
    go on, before any process group starts, and nothing created on disk."""
    out = tmp_path / "run"
    shutil.copytree(runs("zero2")[0], out)
    before = sorted(p.name for p in out.iterdir())
    argv = [*bad_input_base("zero2.json", out, runs.text_file), "--diloco_islands", "2",
            "--diloco_inner_steps", "2", "--resume_from_checkpoint", "latest"]
    line = run_recipe_in_process(monkeypatch, "recipes/pretrain.py", argv, {"WORLD_SIZE": "2"})
    assert line == (f"error: --diloco_islands 2: {out / 'checkpoints'} was saved by one island, "
                    "and a resume by 2 islands takes island directories; resume it as it was "
                    "launched (without --diloco_islands), or start the islands in a new "
                    f"--output_dir from its weights with --model_name_or_path {out / 'final'} "
                    "(its export)")
    assert sorted(p.name for p in out.iterdir()) == before


def test_zero2_islands_stay_identical(runs):
    """ZeRO-2 (fp32 partition per rank), default Nesterov outer step: identical islands after every
    outer step.
    """
    out = islands_run(runs, "diloco_zero2", config="zero2.json", extra=DILOCO)
    assert_islands_identical(out)
    metrics = island_metrics(out, 0)
    assert losses(metrics)[-1] < losses(metrics)[0] - 0.3
    assert all(m["outer_bytes_sent"] > 0 for m in metrics if "outer_step" in m)
