"""Streaming DiLoCo (Douillard et al., 2025) for BDH: the weights in F fragments that meet in
turn, so that the bytes of an outer step are spread over the window instead of sent at once.

The cut. BDH's layers share one block of weights, so a fragment cannot be a set of layers (the
paper's choice). A fragment here is a set of neurons: neuron n of every head is in fragment
n mod F, with its columns of `encoder` and `encoder_v` (nh, D, N) and its rows of `decoder`
(nh N, D); everything one neuron reads and writes travels together. Interleaved, not in runs,
so that the ranks that split the neurons (--neuron_parallel K, each holding a run of N/K) each
hold 1/F of every fragment and the cut is the same for every K: an island of K shares syncs
what an unsplit island syncs, each rank sending 1/K of it. `embed` (V, D) and `lm_head`
(D, V) are cut the same way along the vocabulary, tokens [f V/F, (f+1) V/F): every fragment is
then the same size (peak bandwidth 1/F of the whole) and each still holds whole units of the
model. A parameter BDH does not have (the transformer baselines) is cut into F equal runs of its
flattened values. Under ZeRO each rank holds its partition's share of every fragment, the same
share on every island.

The schedule. Fragment f syncs at inner steps floor(f H/F) + kH: its pseudo-gradient Delta_f =
theta_outer_f - theta_f is averaged over the islands (any codec of dragon.diloco.exchange, top-k
with its error feedback included) and fragment f's own outer optimizer steps theta_outer_f.
sync: the exchange blocks and theta_f becomes theta_outer_f. delayed: the exchange runs on the
exchange thread (dragon.diloco.background) under the next `fragment_delay` inner steps (at most
H//F, so one fragment is in flight at a time), or, with `auto`, until it is done on every island
and at most H steps (dragon.diloco.landing), and lands then: theta_f <- alpha theta_f +
(1 - alpha) theta_outer_f, the paper's merge of the local progress made meanwhile. The merge, not
the eager update of dragon's delayed mode, because the fragment lands inside its own window: eager
updates need the late average of the window before, and the merge keeps theta_outer one shared
value that every island steps with the same average (bit-identical theta_outer on every island
after every landing). The last step lands what is in flight and syncs every fragment at once,
blocking, so training ends with every island on the same weights. Elastic islands
(--diloco_elastic): each event of the schedule is a round among the islands that reach it
(dragon.diloco.fragment_rounds), in delayed mode with a fixed delay (auto: one step).

Metrics of a step where a fragment syncs or lands: outer_step (such steps so far),
outer_fragment (the one that syncs), outer_landed (the one that lands, the first if several do;
both F at the last step: all of them), outer_landed_after (delayed: inner steps since it synced),
outer_bytes_sent (what the exchanges started at this step send, the most of any rank of the
island), outer_peak_bytes (the most of any such step so far; the last step's sync of every
fragment is not in it), and, as in dragon.diloco.outer, outer_payload_bytes,
outer_compress_error, outer_grad_norm (of the averages that landed), outer_residual_norm,
outer_quorum (elastic), outer_seconds and the checksums.
"""

import math
import time
from typing import Optional

import torch

from dragon.diloco.exchange import Exchange, ExchangeSet, FinishedExchange, flatten
from dragon.diloco.fragment_rounds import ElasticFragments
from dragon.diloco.landing import AUTO, AutoLandings, InFlight
from dragon.diloco.outer import DiLoCo
from dragon.diloco.state import relay, saved_states

NEURON_SLICED = ("encoder", "encoder_v")  # (nh, D, N): the neuron is the last index
NEURON_ROWS = "decoder"  # (nh N, D): row h N + n is neuron n of head h
VOCAB_ROWS = "embed.weight"  # (V, D)
VOCAB_COLUMNS = "lm_head"  # (D, V)


INTERLEAVED, RUNS = "interleaved", "runs"  # neuron n in fragment n mod F, or n F / N (older)


def element_fragments(name: str, shape: tuple, start: int, numel: int, neurons: int,
                      fragments: int, cut: str = INTERLEAVED) -> torch.Tensor:
    """The fragment of each of `numel` values of parameter `name` (of `shape`) from flattened
    offset `start` on, as int8 (`neurons`: per head on this rank)."""
    e = torch.arange(start, start + numel, dtype=torch.int64)
    leaf = name.split(".")[-1]
    if leaf in NEURON_SLICED or leaf == NEURON_ROWS:
        neuron = e % shape[-1] if leaf in NEURON_SLICED else (e // shape[-1]) % neurons
        if cut == INTERLEAVED:  # a share of N/K neurons starts at a multiple of F
            return (neuron % fragments).to(torch.int8)
        unit, units = neuron, neurons
    elif name.endswith(VOCAB_ROWS):
        unit, units = e // shape[-1], shape[0]
    elif leaf == VOCAB_COLUMNS:
        unit, units = e % shape[-1], shape[-1]
    else:
        unit, units = e, math.prod(shape)
    return (unit * fragments // units).to(torch.int8)


def fragment_ids(segments: list, shapes: dict, numels: list[int], fragments: int,
                 cut: str = INTERLEAVED) -> torch.Tensor:
    """The fragment of every value of this rank's master tensors, one int8 vector over them all
    (dragon.diloco.master_weights.MasterWeights.segments says where each piece sits; padding
    belongs to fragment 0)."""
    neurons = next((s[-1] for n, s in shapes.items() if n.split(".")[-1] == "encoder"), 1)
    ids = torch.zeros(sum(numels), dtype=torch.int8)
    base = 0
    for pieces, numel in zip(segments, numels):
        for name, at, offset, count in pieces:
            ids[base + offset:base + offset + count] = element_fragments(
                name, shapes[name], at, count, neurons, fragments, cut)
        base += numel
    return ids


class FragmentedDiLoCo(ElasticFragments, DiLoCo):
    """The outer loop of one rank with --diloco_fragments F > 1 (see the module's docstring);
    call maybe_outer_step(step) after every inner step, as with DiLoCo. `ids`: the fragment of
    each of this rank's values (default: BDH's cut, from the weights' segments and shapes)."""

    def __init__(self, weights, config, topology, outer_optimizer=None,
                 ids: Optional[torch.Tensor] = None):
        super().__init__(weights, config, topology, outer_optimizer)
        self.F, self.delay = config.fragments, config.fragment_delay
        self.alpha = config.fragment_alpha if self.mode == "delayed" else 0.0
        self.cut = INTERLEAVED
        if ids is None:
            ids = fragment_ids(weights.segments(), weights.shapes(), self.numels, self.F)
        self.ids = ids  # one byte a value; a fragment's mask is made when it is used
        whole = flatten(self.outer_params)
        # theta_outer as one flat tensor per fragment, each with its own outer optimizer
        self.outer_params = [whole[self.mask(f)].to(self.device) for f in range(self.F)]
        self.optimizers = [self._make_optimizer([p]) for p in self.outer_params]
        self.optimizer = self.previous = None  # delayed mode merges; it keeps no share of its own
        self.in_flight: dict[int, InFlight] = {}
        self.auto = None  # --diloco_fragment_delay auto: the landings agreed in the store
        if self.delay == AUTO:
            if self.background is not None:
                self.auto = AutoLandings(topology, self.background, self.H)
            self.delay = 1  # one island has no link to wait for

    def mask(self, fragment: int) -> torch.Tensor:
        """Which of this rank's values (over all its master tensors) are in `fragment`."""
        return self.ids == fragment

    def _outer_flat(self) -> torch.Tensor:
        whole = torch.zeros(sum(self.numels))
        for f, p in enumerate(self.outer_params):
            whole[self.mask(f)] = p.detach()
        return whole

    def offset(self, fragment: int) -> int:
        return fragment * self.H // self.F

    def syncing(self, step: int, final: bool) -> list[int]:
        """The fragments that sync after inner step `step` (at the last step, all)."""
        if final:
            return list(range(self.F))
        return [f for f in range(self.F) if step >= max(self.offset(f), 1)
                and step % self.H == self.offset(f)]

    def landing(self, step: int, final: bool) -> list[int]:
        if self.auto is not None and not final:
            for f, x in self.in_flight.items():
                self.auto.decide(f, x, step)
        return sorted(f for f, x in self.in_flight.items()
                      if final or (x.lands_at is not None and x.lands_at <= step))

    def is_due(self, step: int, final: bool) -> bool:
        return bool(self.syncing(step, final) or self.landing(step, final))

    def _outer_step(self, step: int, final: bool, joining=None) -> dict:
        if self.config.elastic:
            return self._elastic_step(step, final, joining)
        start = time.perf_counter()
        self.outer_step += 1
        landed = self.landing(step, final)
        flights = [self.in_flight.pop(f) for f in landed]
        arrived = [x.exchange for x in flights]
        averages = {f: self._step_fragment(f, x.result()) for f, x in zip(landed, arrived)}
        self._waited([x.exchange for x in flights if x.lands_at == x.synced_at + self.H])
        self._write_fragments(landed, self.alpha)
        syncing = self.syncing(step, final)
        started = self._start(syncing, self.group, self.islands, step=0 if final else step)
        if self.mode == "sync" or final:  # blocking: each lands now, theta_f = theta_outer_f
            arrived += started
            averages.update({f: self._step_fragment(f, x.result())
                             for f, x in zip(syncing, started)})
            self._write_fragments(syncing, 0.0)
        else:
            lands_at = None if self.auto else step + self.delay
            self.in_flight.update({f: InFlight(x, lands_at, step)
                                   for f, x in zip(syncing, started)})
        metrics = {"outer_step": self.outer_step}
        if syncing:  # one fragment a step; F: all of them (the last step)
            metrics["outer_fragment"] = self.F if final else syncing[0]
        if averages:
            metrics["outer_landed"] = self.F if final else min(averages)
        if flights and not final:
            metrics["outer_landed_after"] = step - flights[0].synced_at
        applied = [ExchangeSet(arrived, self._placed(averages))] if averages else []
        metrics.update(self._exchange_metrics(ExchangeSet(started), applied, final))
        metrics["outer_seconds"] = time.perf_counter() - start
        return metrics

    # ----------------------------------------------------------- pieces

    def _start(self, fragments: list[int], group, islands: int, contributors=None,
               keep_back: bool = True, step: int = 0, kept: Optional[list] = None
               ) -> list[Exchange]:
        """Start the exchanges of theta_outer_f - theta_f (plus what top-k kept back) of these
        fragments among `islands`, in flight after inner step `step` (0: none lands later);
        `keep_back`: top-k keeps what it did not send at once (an elastic round does so once it
        succeeds); `kept`: gets a copy of each pseudo-gradient (an elastic island redoes a failed
        exchange from it)."""
        if not fragments:
            return []
        local, started = flatten(self.weights.tensors()), []
        for f in fragments:
            delta = self._delta(f, local)
            if kept is not None:
                kept.append(delta.clone())
            then = self.auto.poster(f, step) if self.auto and step else None
            started.append(self.exchange(delta, group, islands, contributors, [delta.numel()],
                                         then))
            if keep_back and self.residual is not None:
                self.residual[self.mask(f)] = delta - started[-1].sent
        return started

    def _delta(self, fragment: int, local: torch.Tensor) -> torch.Tensor:
        """theta_outer_f - theta_f, plus what top-k kept back of fragment f (`local`: this rank's
        weights, flat)."""
        mask = self.mask(fragment)
        delta = self.outer_params[fragment].to("cpu", torch.float32) - local[mask]
        if self.residual is not None:
            delta += self.residual[mask]
        return delta

    def _decided(self, fragment: int, x: InFlight) -> InFlight:
        """x with its landing step decided (auto: waiting for its exchange, as a save does)."""
        if self.auto is not None:
            self.auto.decide(fragment, x, self.background.clock, waiting=True)
        return x

    def outer_optimizer_state(self) -> list:
        return [o.state_dict() for o in self.optimizers]

    def load_outer_optimizer_state(self, state: list) -> None:
        for optimizer, saved in zip(self.optimizers, state):
            optimizer.load_state_dict(saved)

    def _step_fragment(self, fragment: int, average: torch.Tensor) -> torch.Tensor:
        """Fragment `fragment`'s outer optimizer steps on theta_outer_f with `average`."""
        p = self.outer_params[fragment]
        p.grad = average.to(p.device)
        self.optimizers[fragment].step()
        p.grad = None
        return average

    def _write_fragments(self, fragments: list[int], alpha: float) -> None:
        """theta_f <- alpha theta_f + (1 - alpha) theta_outer_f for these fragments, into the
        master and working weights."""
        if not fragments:
            return
        flat = flatten(self.weights.tensors())
        for f in fragments:
            outer = self.outer_params[f].to("cpu", torch.float32)
            if alpha:
                outer = alpha * flat[self.mask(f)] + (1 - alpha) * outer
            flat[self.mask(f)] = outer
        self._write(flat.split(self.numels))

    def _placed(self, averages: dict) -> torch.Tensor:
        """The averages that landed, in their places among all of this rank's values (0
        elsewhere)."""
        whole = torch.zeros(sum(self.numels))
        for f, average in averages.items():
            whole[self.mask(f)] = average
        return whole

    # ----------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """theta_outer and the outer optimizer of every fragment, the averages in flight (waited
        for here: the save point is the same on every island) and where they land."""
        return {
            "outer_step": self.outer_step, "mode": self.mode, "numels": self.numels,
            "fragments": self.F, "cut": self.cut,
            "segments": self.weights.segments(),  # the partition, for a resume on another
            "neuron_share": self.weights.neuron_share(),
            "outer_params": [p.detach().cpu().clone() for p in self.outer_params],
            "optimizers": self.outer_optimizer_state(),
            "residual": None if self.residual is None else self.residual.clone(),
            "in_flight": {f: self._saved_flight(f, x) for f, x in self.in_flight.items()},
            "peak_bytes": self.peak_bytes,
        }

    def _saved_flight(self, fragment: int, x: InFlight) -> tuple:
        """(its average, where it lands, where it synced, the kept pseudo-gradient, whether it is
        this island's own) of an exchange in flight; the average is "lost" when an elastic
        island died during it (its landing redoes it from the kept pseudo-gradients)."""
        try:
            average = self._decided(fragment, x).exchange.result().clone()
        except RuntimeError:
            average = "lost"
        return average, x.lands_at, x.synced_at, x.delta, x.contributed

    def _load(self, state: dict) -> None:
        if (state.get("fragments", 1), state["numels"], state["mode"]) != (
                self.F, self.numels, self.mode):
            raise ValueError(
                f"DiLoCo state of {state.get('fragments', 1)} fragments, mode {state['mode']} "
                f"does not fit --diloco_fragments {self.F}, mode {self.mode} on this layout; "
                f"resume with --diloco_fragments {state.get('fragments', 1)} --diloco_mode "
                f"{state['mode']} on the ZeRO stage and island size it was saved with")
        if state.get("cut", RUNS) != self.cut:  # saved before the cut was interleaved
            self.cut = state.get("cut", RUNS)
            self.ids = fragment_ids(self.weights.segments(), self.weights.shapes(), self.numels,
                                    self.F, self.cut)
        with torch.no_grad():
            for p, saved in zip(self.outer_params, state["outer_params"]):
                p.copy_(saved)
            if self.residual is not None:
                self.residual.copy_(state["residual"])
        self.load_outer_optimizer_state(state["optimizers"])
        self.outer_step, self.peak_bytes = state["outer_step"], state["peak_bytes"]
        self.in_flight = {f: InFlight(FinishedExchange(
            None if isinstance(average, str) else average),
                                       at, *synced)
                          for f, (average, at, *synced) in state["in_flight"].items()}

    def _relaid_state(self, tag_dir: str) -> Optional[dict]:
        """This rank's state from the fragment states the ranks of another partition of the
        weights saved: every fragment's vectors put back in place over each saved rank's values,
        laid out again for this rank's (dragon.diloco.state.relay), and cut by this rank's ids."""
        saved = saved_states(tag_dir)
        if not saved:
            return None
        shapes, first = self.weights.shapes(), saved[0]
        cut = first.get("cut", RUNS)
        ids = fragment_ids(self.weights.segments(), shapes, self.numels, self.F, cut)
        old = [fragment_ids(s["segments"], shapes, s["numels"], self.F, cut) for s in saved]
        at = {id(s): i for i, s in enumerate(saved)}

        def moved(vectors_of) -> list[Optional[torch.Tensor]]:
            """Per fragment, vectors_of(state) (F masked vectors, None where a fragment has
            none) laid out for this rank."""
            def placed(state: dict) -> list[torch.Tensor]:
                flat = torch.zeros(sum(state["numels"]))
                for f, vector in enumerate(vectors_of(state)):
                    if vector is not None:
                        flat[old[at[id(state)]] == f] = vector.float()
                return list(flat.split(state["numels"]))
            whole = torch.cat(relay(saved, self.weights.segments(), self.numels, placed,
                                    self.weights.neuron_share(), self.weights.config))
            present = [v is not None for v in vectors_of(first)]
            return [whole[ids == f] if present[f] else None for f in range(self.F)]

        optimizers = [dict(o) for o in first["optimizers"]]  # a fragment not stepped yet: none
        buffers = moved(lambda s: [o["state"].get(0, {}).get("momentum_buffer")
                                   for o in s["optimizers"]])
        for optimizer, buffer in zip(optimizers, buffers):
            if buffer is not None:
                optimizer["state"] = {0: dict(optimizer["state"][0], momentum_buffer=buffer)}
        def flights(i: int):  # item i of each fragment's saved flight, where it is a vector
            return lambda s: [_vector(s["in_flight"].get(f, ()), i) for f in range(self.F)]

        landing, kept = moved(flights(0)), moved(flights(3))
        residual = None
        if first.get("residual") is not None:
            residual = torch.cat(relay(saved, self.weights.segments(), self.numels,
                                       lambda s: list(s["residual"].split(s["numels"])),
                                       self.weights.neuron_share(), self.weights.config))
        return dict(first, numels=self.numels, segments=self.weights.segments(),
                    neuron_share=self.weights.neuron_share(), optimizers=
                    optimizers, outer_params=moved(lambda s: s["outer_params"]), residual=residual,
                    in_flight={f: ("lost" if isinstance(v[0], str) else landing[f], *v[1:3],
                                   kept[f], *v[4:]) for f, v in first["in_flight"].items()})

    def restart(self) -> None:
        """Start afresh from the current weights (a checkpoint saved without DiLoCo)."""
        self._adopt_island0_weights()
        whole = flatten(self.weights.tensors())
        with torch.no_grad():
            for f, p in enumerate(self.outer_params):
                p.copy_(whole[self.mask(f)])
        if self.residual is not None:
            self.residual.zero_()
        self.optimizers = [self._make_optimizer([p]) for p in self.outer_params]
        self.in_flight, self.outer_step = {}, 0


def _vector(saved: tuple, i: int) -> Optional[torch.Tensor]:
    return saved[i] if len(saved) > i and torch.is_tensor(saved[i]) else None
