"""One island of a two-island DiLoCo run on toy weights, for tests/test_diloco.py.

    python diloco_islands.py ISLAND HOST:PORT OUT_JSON
        [elastic|late|late_final|decider_dies|failed_alone|join_fails|restarted|rejoin]

Two processes (islands 0 and 1, one rank each) meet through a real ProcessGroupGloo built by
dragon.parallel.topology.enter_island (one launch per island). The "inner optimizer" is a gradient
step on a quadratic with an island-specific centre, so each island's progress depends on the
weights it starts from and the delayed schedule matters. Each scenario records, after every outer
step, the island's weights, theta_outer and the metrics, for the test to check against a hand
simulation.

`elastic` (a standalone store at HOST:PORT): an elastic run in sync mode, then one in delayed
mode; in each, island 1 leaves after outer step 1 (its exchange done), and island 0 trains on
beside a one-island DiLoCo started from its state at that point (theta_outer, outer optimizer,
what was in flight) on the same inner steps; it records both. Then island 1 tries to join the
ended delayed run.

`late` (a standalone store): elastic islands in sync mode, quorum timeout 1 s; island 1 reaches
outer step 2 three seconds late and lands there in outer step 3, for which island 0 trains slowly
(4 s). Each records every outer step it took, with its step.

`late_final`: as `late`, but island 1 is late for outer step 3, and the next one is the run's
last, which lets no joiner in: island 0 trains slowly (5 s) for it, so that island 1 has announced
itself before it forms. Island 1 records the one line it was stopped with.

`decider_dies`: island 0 arrives first at outer step 2 and is SIGKILLed while it decides who
takes the step; island 1 takes the decision over and trains on alone.

`failed_alone`: island 1's exchange of outer step 2 completes on island 0 but fails on island 1
alone; island 1 joins outer step 3 as a joiner.

`join_fails`: island 1 joins island 0 at outer step 2; the join round completes on island 0 but
fails on island 1 alone; island 1's retry gets no quorum, and it joins outer step 3.

`restarted`: island 1 arrives at outer step 2, is let in, and is SIGKILLed before its group forms;
island 0's group for the step waits for it (20 s) and fails. `rejoin`: island 1 started again
with --diloco_join while island 0 waits, so the step it finds the live islands at is the one its
dead launch arrived at: it joins a later one.
"""

import copy
import json
import os
import signal
import sys
import time
from types import SimpleNamespace

import torch

from dragon.run.diloco_args import DiLoCoArguments
from dragon.diloco.quorum import Quorum, step_key
from dragon.diloco.outer import DiLoCo
from dragon.errors import RunStopped
from dragon.parallel.topology import Topology, enter_island

SHAPES = [(20, 30), (400,)]  # two tensors, 1000 values
INNER_STEPS, OUTER_STEPS, INNER_LR = 3, 4, 0.3
SCENARIOS = [
    dict(diloco_mode="sync", diloco_compress="none"),
    dict(diloco_mode="delayed", diloco_compress="none"),
    dict(diloco_mode="sync", diloco_compress="bf16"),
    dict(diloco_mode="sync", diloco_compress="int8", diloco_int8_block=256),
    dict(diloco_mode="sync", diloco_compress="int8", diloco_int8_block=0),
    dict(diloco_mode="delayed", diloco_compress="int8", diloco_int8_block=256),
    dict(diloco_mode="delayed", diloco_compress="none", diloco_topk=0.05),
    # plain averaging
    dict(
        diloco_mode="delayed",
        diloco_compress="none",
        diloco_outer_lr=1.0,
        diloco_outer_momentum=0.0,
    ),
    # unequal islands: island 1 trains 1 step of every 3, and weighs a quarter in the average
    dict(diloco_mode="sync", diloco_compress="none", diloco_island_steps="3,1"),
    dict(diloco_mode="delayed", diloco_compress="int8", diloco_int8_block=256,
         diloco_island_steps="3,1"),
]


def initial_weights():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g) for shape in SHAPES]


def centre(island):
    g = torch.Generator().manual_seed(100 + island)
    return [torch.randn(shape, generator=g) * (1 + island) for shape in SHAPES]


class Weights:
    """Plain fp32 tensors standing in for an engine's master weights."""

    replicas, excluded = 1, []

    def __init__(self, tensors):
        self.ts = tensors

    def tensors(self):
        return self.ts

    def publish(self):
        pass

    def fingerprint(self):
        return [
            float(sum(t.double().sum() for t in self.ts)),
            float(sum(t.double().pow(2).sum() for t in self.ts)),
        ]


def inner_steps(weights, c) -> None:
    for _ in range(INNER_STEPS):
        with torch.no_grad():
            for w, ci in zip(weights.tensors(), c):
                w.sub_(INNER_LR * (w - ci))


def record_of(weights, outer, metrics) -> dict:
    return {
        "weights": [w.flatten().tolist() for w in weights.tensors()],
        "outer": [p.tolist() for p in outer.theta_outer().split(
            [w.numel() for w in weights.tensors()])],
        "metrics": metrics,
    }


def elastic_options(island: int, store: str) -> dict:
    return dict(diloco_islands=2, diloco_island_index=island, diloco_store=store,
                diloco_store_external=True, diloco_elastic=True)


def elastic(island: int, mode: str, topology, options: dict) -> list[dict]:
    """Island 0's record of each outer step: itself and the one-island copy ("alone")."""
    args = DiLoCoArguments(diloco_inner_steps=INNER_STEPS, diloco_mode=mode,
                           diloco_outer_momentum=0.3, diloco_quorum_timeout=1, **options)
    weights = Weights(initial_weights())
    outer, alone, c, record = DiLoCo(weights, args.config(), topology), None, centre(island), []
    for k in range(1, OUTER_STEPS + 1):
        final = k == OUTER_STEPS
        inner_steps(weights, c)
        metrics = outer.maybe_outer_step(k * INNER_STEPS, final)
        entry = record_of(weights, outer, metrics)
        if alone is not None:
            inner_steps(alone.weights, c)
            entry["alone"] = record_of(alone.weights, alone, alone.maybe_outer_step(k, final))
        record.append(entry)
        if k == 1 and island == 1:
            outer.state_dict()  # waits for its exchange in flight: it leaves after it
            return record
        if k == 1:
            one = DiLoCoArguments(diloco_inner_steps=1, diloco_mode=mode, diloco_outer_momentum=0.3)
            alone = DiLoCo(Weights([w.clone() for w in weights.tensors()]), one.config(),
                           Topology())
            alone.load_state_dict(copy.deepcopy(outer.state_dict()))  # shares no tensor
    outer.close(ended_at=OUTER_STEPS * INNER_STEPS)
    return record


def elastic_runs(island: int, store: str) -> dict:
    """Sync, then delayed (each run's quorums in a store namespace of its own), then island 1
    joining the delayed run after it ended: what it was told."""
    options = elastic_options(island, store)
    topology = enter_island(SimpleNamespace(**options), 60)
    base, records = topology.store, {}
    for mode in ("sync", "delayed", "join"):
        base.set(f"{island}-{mode}", "1")
        base.wait([f"{1 - island}-{mode}"])  # both islands start the next part together
        if mode == "join":
            break
        topology.store = torch.distributed.PrefixStore(mode, base)
        records[mode] = elastic(island, mode, topology, options)
    if island == 1:
        args = DiLoCoArguments(diloco_inner_steps=INNER_STEPS, diloco_mode="delayed",
                               diloco_outer_momentum=0.3, diloco_join=True, **options)
        try:
            DiLoCo(Weights(initial_weights()), args.config(), topology).join()
        except RunStopped as e:
            records["join"] = e.exit_status()
    return records


def late(island: int, store: str, late_for: int = 2) -> list[dict]:
    """Island 1 reaches outer step `late_for` late; island 0 trains slowly for the next one."""
    slow = {(1, (late_for - 1) * INNER_STEPS): 4, (0, late_for * INNER_STEPS): 3}
    if late_for == OUTER_STEPS - 1:  # its announcement comes before the last quorum forms
        slow[0, late_for * INNER_STEPS] = 5
    return elastic_sync(island, store, slow)


def decider_dies(island: int, store: str) -> list[dict]:
    """Island 0 arrives first at outer step 2 and is SIGKILLed deciding who takes it."""
    decide = Quorum._decide

    def dying(self, key, final, arrived):
        if key == step_key(2, 0):
            os.kill(os.getpid(), signal.SIGKILL)
        decide(self, key, final, arrived)

    if island == 0:
        Quorum._decide = dying
    return elastic_sync(island, store, {(1, INNER_STEPS): 0.5})


def failed_alone(island: int, store: str) -> list[dict]:
    """Island 1's exchange of outer step 2 completes on island 0 but raises on island 1 alone,
    as when its last message is lost to it."""
    if island == 1:
        _fail_once(lambda outer, joiners: outer.outer_step == 2)
    return elastic_sync(island, store, {})


def join_fails(island: int, store: str) -> list[dict]:
    """Island 1 joins island 0 (alone from the start) at outer step 2; its join round completes
    on island 0 but raises on island 1 alone. Island 0 waits 13 s before its window 3, so that
    island 1, whose retry of step 2 gets no quorum, joins step 3."""
    if island == 1:
        _fail_once(lambda outer, joiners: outer.topology.island in joiners)
        return elastic_sync(island, store, {}, join=True)
    return elastic_sync(island, store, {(0, INNER_STEPS): 4, (0, 2 * INNER_STEPS): 13})


def _fail_once(when) -> None:
    """The first round of this island where when(outer loop, joiners) holds completes, then
    raises here alone."""
    attempt, failed = DiLoCo._attempt, []

    def failing(self, step, final, sync, members, group, joiners, late):
        done = attempt(self, step, final, sync, members, group, joiners, late)
        if when(self, joiners) and not failed:
            failed.append(True)
            raise RuntimeError("test: the round failed on this island alone")
        return done

    DiLoCo._attempt = failing


def restarted(island: int, store: str) -> list[dict]:
    """Island 1 is SIGKILLed at outer step 2 once the step's members (itself among them) are
    decided, before its group forms."""
    wait = Quorum._wait_for_decision

    def dying(self, key, *args):
        wait(self, key, *args)
        if key == step_key(2, 0):
            os.kill(os.getpid(), signal.SIGKILL)

    if island == 1:
        Quorum._wait_for_decision = dying
    return elastic_sync(island, store, {(1, INNER_STEPS): 0.5}, timeout_s=20)


def elastic_sync(island: int, store: str, slow: dict, join: bool = False,
                 timeout_s: float = 60) -> list[dict]:
    """Elastic islands in sync mode, quorum timeout 1 s, each window of island i after step s
    started `slow[i, s]` seconds late (`join`: this island joins the live islands first): the
    record of every outer step taken, with its step."""
    options = elastic_options(island, store)
    topology = enter_island(SimpleNamespace(**options), timeout_s)
    # Both islands start together (a joiner waits for none): the quorum timeout of 1 s is
    # shorter than the skew of two interpreters' start on a loaded machine.
    topology.store.set(f"test-started/{island}", "1")
    if not join:
        topology.store.wait([f"test-started/{1 - island}"])
    time.sleep(slow.get((island, -1), 0))  # (island, -1): seconds it starts late
    args = DiLoCoArguments(diloco_inner_steps=INNER_STEPS, diloco_outer_momentum=0.3,
                           diloco_quorum_timeout=1, diloco_join=join, **options)
    weights, c, record, step = Weights(initial_weights()), centre(island), [], 0
    began = time.monotonic()
    outer, last = DiLoCo(weights, args.config(), topology), OUTER_STEPS * INNER_STEPS
    started_in = time.monotonic() - began  # the first outer step's quorum, waited for
    if join:
        step, metrics = outer.join()
        record.append({**record_of(weights, outer, metrics), "step": step})
    while step < last:
        time.sleep(slow.get((island, step), 0))
        inner_steps(weights, c)
        step += INNER_STEPS
        try:
            metrics = outer.maybe_outer_step(step, final=step == last)
        except RunStopped as e:
            record.append({"stopped": e.exit_status(), "step": step})
            return record
        step = max(step, outer.joined_step)  # landed late: on at the live islands' step
        record.append({**record_of(weights, outer, metrics), "step": step,
                       "started_in": started_in})
    outer.close(ended_at=last)
    return record


def main():
    island, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    parts = {"elastic": elastic_runs, "late": late,
             "late_final": lambda island, store: late(island, store, OUTER_STEPS - 1),
             "decider_dies": decider_dies, "failed_alone": failed_alone,
             "restarted": restarted, "join_fails": join_fails,
             "late_start": lambda island, store: elastic_sync(island, store, {(1, -1): 4}),
             "rejoin": lambda island, store: elastic_sync(island, store, {}, join=True)}
    if sys.argv[4:5] and sys.argv[4] in parts:
        with open(out, "w") as f:
            json.dump(parts[sys.argv[4]](island, store), f)
        return
    topology = enter_island(
        SimpleNamespace(
            diloco_islands=2,
            diloco_island_index=island,
            diloco_store=store,
            diloco_store_external=False,
            diloco_elastic=False,
        ),
        60,
    )
    c = centre(island)
    results = []
    for scenario in SCENARIOS:
        args = DiLoCoArguments(
            diloco_islands=2,
            diloco_inner_steps=INNER_STEPS,
            diloco_island_index=island,
            diloco_store=store,
            **scenario,
        )
        weights = Weights(initial_weights() if island == 0 else [torch.zeros(s) for s in SHAPES])
        outer = DiLoCo(
            weights, args.config(), topology
        )  # island 1 starts from zeros: the broadcast gives it theta_0
        record = []
        step = 0
        for k in range(1, OUTER_STEPS + 1):
            for _ in range(INNER_STEPS):
                step += 1
                if outer.trains(step):  # unequal islands: island 1 rests through some steps
                    with torch.no_grad():
                        for w, ci in zip(weights.tensors(), c):
                            w.sub_(INNER_LR * (w - ci))
                metrics = outer.maybe_outer_step(step, final=step == INNER_STEPS * OUTER_STEPS)
                assert bool(metrics) == (step % INNER_STEPS == 0), (step, metrics)
            record.append(
                {
                    "weights": [w.flatten().tolist() for w in weights.tensors()],
                    "outer": [p.tolist() for p in outer.theta_outer().split(
            [w.numel() for w in weights.tensors()])],
                    "metrics": metrics,
                }
            )
        results.append({"scenario": scenario, "outer_steps": record})
    topology.barrier()
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
