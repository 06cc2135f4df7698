"""DiLoCo's command-line arguments (--diloco_*), checked, and the DiLoCoConfig they give."""

import os
from dataclasses import dataclass, field
from typing import Optional, Union

from dragon.checkpoint.store_copy import is_url
from dragon.diloco.landing import AUTO
from dragon.diloco.pace import AUTO as PACE_AUTO
from dragon.diloco.config import DiLoCoConfig
from dragon.errors import warn


def _help(text: str, **kwargs):
    return field(metadata={"help": text}, **kwargs)


MODES = ("sync", "delayed")
COMPRESSIONS = ("none", "bf16", "int8", "int4", "sparseloco")
SPARSELOCO_DENSITY = 64 / 4096  # SparseLoCo's k of a chunk of 4096
DELAYED_MOMENTUM = 0.3  # delayed mode's steadiest outer momentum at lr 1 (benchmarks/README.md)


@dataclass
class DiLoCoArguments:
    diloco_inner_steps: Optional[int] = _help(
        "H: inner steps per outer step. Setting it turns DiLoCo on (also with one island).",
        default=None,
    )
    diloco_islands: int = _help(
        "Islands; each trains on its own between outer steps (1 and no H: off).", default=1
    )
    diloco_outer_lr: float = _help("Outer learning rate.", default=0.7)
    diloco_outer_momentum: float = _help("Outer momentum (0: plain SGD).", default=0.9)
    diloco_nesterov: bool = _help("Nesterov outer momentum.", default=True)
    diloco_mode: str = _help(
        "sync, or delayed: the outer all-reduce overlaps the next H inner steps and is "
        "applied one outer step late.",
        default="sync",
    )
    diloco_compress: str = _help(
        "Pseudo-gradient on the wire: none (fp32), bf16, int8 (all-gathered), int4 (an "
        "all-to-all and an all-gather: bytes that do not grow with the islands) or sparseloco "
        "(SparseLoCo: the top --diloco_topk of every chunk of --diloco_sparseloco_chunk values, "
        "default 64 of 4096, in 2 bits, all-gathered; its error feedback, decayed by "
        "--diloco_sparseloco_decay, replaces outer momentum).", default="none"
    )
    diloco_int8_block: int = _help(
        "Values per int8 or int4 scale (0: one scale per tensor, int8 only).", default=1024
    )
    diloco_topk: float = _help(
        "Send only this fraction of each pseudo-gradient's entries, those of largest magnitude, "
        "as int32 indices and bf16 values; each rank keeps what it did not send for its next "
        "outer step (error feedback). 0: off.", default=0.0
    )
    diloco_sparseloco_chunk: int = _help(
        "--diloco_compress sparseloco: values per chunk, each chunk its own top-k (at most "
        "65536).", default=4096
    )
    diloco_sparseloco_decay: float = _help(
        "--diloco_compress sparseloco: the share of the error kept back that carries into the "
        "next outer step, in (0, 1].", default=0.95
    )
    diloco_fragments: int = _help(
        "Streaming DiLoCo: the weights in this many fragments (slices of BDH's neurons and of "
        "the vocabulary), fragment f synced at inner steps floor(f*H/F) + kH, each with its own "
        "outer optimizer. 1: the whole model every H steps.", default=1
    )
    diloco_fragment_delay: Optional[str] = _help(
        "Delayed mode with fragments: inner steps a fragment's exchange runs under before it "
        "lands, 1 to H//F, or auto (the default): at the first inner step but one after its "
        "exchange is done on every island, at most H steps after it synced.", default=None
    )
    diloco_fragment_alpha: float = _help(
        "Delayed mode with fragments: a landing fragment keeps this share of the local progress "
        "made while it was in flight (Streaming DiLoCo's merge; 0 takes the outer weights).",
        default=0.5
    )
    diloco_exchange_thread: bool = _help(
        "Delayed mode: run the outer exchange's collectives on a thread of their own, so that "
        "inner steps wait for the link only when a landing is due before the exchange is done "
        "(false: on the training thread, int4's all-to-all blocking, as before).", default=True
    )
    diloco_outer_on_cpu: bool = _help(
        "Keep theta_outer and the outer optimizer state on CPU.", default=False
    )
    diloco_checksum: bool = _help(
        "Log a fingerprint of the working weights after every outer step.", default=False
    )
    diloco_island_index: Optional[int] = _help(
        "This launch's island, when each island is a launch of its own (then also --diloco_store); "
        "default: one launch holds all islands, split into contiguous blocks of ranks.",
        default=None,
    )
    diloco_store: Optional[str] = _help(
        "HOST:PORT of the store where islands meet (with "
        "--diloco_island_index; island 0's rank 0 hosts it).",
        default=None,
    )
    diloco_store_external: bool = _help(
        "No island hosts the store: it runs on its own (python -m dragon.diloco.island_store).",
        default=False,
    )
    diloco_elastic: bool = _help(
        "Islands may die while the others train on: each outer step averages over the islands "
        "that reach it within --diloco_quorum_timeout (needs one launch per island).",
        default=False,
    )
    diloco_quorum_timeout: float = _help(
        "Elastic: seconds an outer step waits for the islands of the last one (the grace: in "
        "sync mode with one fragment an island later than that lands its pseudo-gradient in the "
        "next outer step, weighted 1/2). The first outer step waits at least 60 s for the "
        "islands that start together; a joiner is not waited for.", default=60.0
    )
    diloco_join: bool = _help(
        "With --diloco_elastic, join the live islands at their next outer step (theta_outer, outer "
        "optimizer state, step); --resume_from_checkpoint first restores this island's own.",
        default=False,
    )
    diloco_min_islands: int = _help("Elastic: fewer islands at an outer step end it.", default=1)
    diloco_island_steps: Optional[str] = _help(
        "Islands of unequal speed: the inner steps each island trains in every window of H, "
        "spread over the window (it rests through the others, so that no island waits for a "
        "slower one), e.g. 8,5; or auto: from each island's measured step time, the fastest "
        "training all H. The outer average weights each island by the tokens it trained. "
        "Default: every island trains every step.", default=None
    )

    def __post_init__(self):
        n, h = self.diloco_islands, self.diloco_inner_steps
        if n < 1:
            raise ValueError(f"--diloco_islands {n}: must be >= 1")
        if h is not None and h < 1:
            raise ValueError(f"--diloco_inner_steps {h}: must be >= 1")
        if n > 1 and h is None:
            raise ValueError(
                f"--diloco_islands {n} needs --diloco_inner_steps H (inner steps per outer step)"
            )
        if self.diloco_mode not in MODES:
            raise ValueError(f"--diloco_mode {self.diloco_mode!r}: valid are {', '.join(MODES)}")
        if self.diloco_compress not in COMPRESSIONS:
            raise ValueError(
                f"--diloco_compress {self.diloco_compress!r}: valid are {', '.join(COMPRESSIONS)}"
            )
        if self.diloco_int8_block < 0:
            raise ValueError(f"--diloco_int8_block {self.diloco_int8_block}: must be >= 0")
        if self.diloco_compress == "int4" and self.diloco_int8_block == 0:
            raise ValueError("--diloco_int8_block 0 (one scale per tensor) is for int8; int4 "
                             "needs values per scale (the default 1024)")
        topk = self.diloco_topk
        if not 0 <= topk < 1:
            raise ValueError(f"--diloco_topk {topk}: must be in [0, 1) (0.02 sends 2 %)")
        if self.diloco_compress == "sparseloco":
            self._check_sparseloco()
        if topk and self.diloco_compress not in ("none", "sparseloco"):
            raise ValueError(f"--diloco_topk {topk} sends its own code; drop --diloco_compress "
                             f"{self.diloco_compress}")
        if self.diloco_fragments != 1 or self.diloco_fragment_delay is not None:
            self._check_fragments()
        sparseloco = self.diloco_compress == "sparseloco"
        if (topk or sparseloco) and self.diloco_mode == "delayed" and self.diloco_elastic:
            what = "--diloco_compress sparseloco" if sparseloco else f"--diloco_topk {topk}"
            raise ValueError(f"{what} with --diloco_mode delayed and --diloco_elastic is not "
                             "supported; use --diloco_mode sync")
        if not self.diloco_outer_lr > 0:
            raise ValueError(f"--diloco_outer_lr {self.diloco_outer_lr}: must be > 0")
        if not 0 <= self.diloco_outer_momentum < 1:
            raise ValueError(
                f"--diloco_outer_momentum {self.diloco_outer_momentum}: must be in [0, 1)"
            )
        index = self.diloco_island_index
        if index is not None and not 0 <= index < n:
            raise ValueError(f"--diloco_island_index {index}: must be in [0, --diloco_islands {n})")
        if (index is None) != (self.diloco_store is None):
            raise ValueError(
                "--diloco_island_index and --diloco_store go together (one launch per island)"
            )
        if self.diloco_join and not self.diloco_elastic:
            raise ValueError("--diloco_join needs --diloco_elastic")
        if self.diloco_elastic:
            self._check_elastic()
        if self.diloco_island_steps is not None:
            self.island_steps()
        self._warn_delayed_momentum()

    def _warn_delayed_momentum(self) -> None:
        eager = self.diloco_mode == "delayed" and self.diloco_fragments == 1
        if eager and self.diloco_outer_momentum > DELAYED_MOMENTUM:
            # benchmarks/README.md has the measurements behind the advice
            warn(
                f"--diloco_mode delayed with --diloco_outer_momentum {self.diloco_outer_momentum}: "
                "momentum this high on one-step-late averages did worse in our benchmark; "
                f"--diloco_outer_lr 1 --diloco_outer_momentum {DELAYED_MOMENTUM} did best"
            )

    def _check_fragments(self) -> None:
        f, h, delay = self.diloco_fragments, self.diloco_inner_steps, self.diloco_fragment_delay
        if f < 1:
            raise ValueError(f"--diloco_fragments {f}: must be >= 1")
        if f == 1:
            raise ValueError(f"--diloco_fragment_delay {delay} needs --diloco_fragments > 1")
        if h is None or h < f:
            raise ValueError(f"--diloco_fragments {f}: needs --diloco_inner_steps of at least "
                             f"{f}, got {h} (fragment f syncs at inner steps floor(f*H/F) + kH)")
        if self.diloco_mode == "sync" and delay:
            raise ValueError(f"--diloco_fragment_delay {delay} overlaps the exchange with inner "
                             "steps: use it with --diloco_mode delayed")
        if self.diloco_mode == "delayed" and self.fragment_delay() != AUTO and not (
                1 <= self.fragment_delay() <= h // f):
            raise ValueError(f"--diloco_fragment_delay {delay}: must be auto or in [1, H//F = "
                             f"{h // f}] (a fragment lands before the next one syncs)")
        if self.fragment_delay() == AUTO and delay and not self.diloco_exchange_thread:
            raise ValueError("--diloco_fragment_delay auto needs the exchange thread: drop "
                             "--diloco_exchange_thread false, or give a delay in steps")
        if not 0 <= self.diloco_fragment_alpha <= 1:
            raise ValueError(
                f"--diloco_fragment_alpha {self.diloco_fragment_alpha}: must be in [0, 1]")

    def fragment_delay(self) -> Union[int, str]:
        """--diloco_fragment_delay as the outer loop takes it: "auto" (also when not given, with
        the exchange thread), or inner steps."""
        delay = self.diloco_fragment_delay
        if delay is None:
            return AUTO if self.diloco_exchange_thread else 1
        if str(delay) == AUTO:
            return AUTO
        try:
            return int(delay)
        except ValueError:
            raise ValueError(f"--diloco_fragment_delay {delay!r}: valid are auto or inner steps "
                             "(an integer)") from None

    def island_steps(self) -> Union[None, str, list[int]]:
        """--diloco_island_steps as the outer loop takes it: None, "auto" or one count per
        island, checked."""
        given, n, h = self.diloco_island_steps, self.diloco_islands, self.diloco_inner_steps
        if given is not None and h is None:
            raise ValueError(f"--diloco_island_steps {given} needs --diloco_inner_steps H")
        if given is None or given == PACE_AUTO:
            plan = given
        else:
            try:
                plan = [int(k) for k in given.split(",")]
            except ValueError:
                plan = []
            if len(plan) != n or not all(1 <= k <= (h or 0) for k in plan):
                raise ValueError(f"--diloco_island_steps {given!r}: valid are auto or {n} "
                                 f"counts, one per island, each in [1, H = {h}] (e.g. "
                                 f"{','.join([str(h)] * n)})")
        if plan is not None and self.diloco_elastic and self.diloco_mode == "delayed":
            raise ValueError(f"--diloco_island_steps {given} with --diloco_elastic needs "
                             "--diloco_mode sync (delayed mode's redo among survivors would not "
                             "keep the token weights)")
        return plan

    def _check_elastic(self) -> None:
        if self.diloco_island_index is None:
            raise ValueError(
                "--diloco_elastic needs one launch per island (--diloco_island_index, "
                "--diloco_store): a launcher ends every rank it started when one dies"
            )
        if not self.diloco_store_external:
            raise ValueError(
                "--diloco_elastic needs --diloco_store_external "
                "(python -m dragon.diloco.island_store): "
                "a store hosted by island 0 would end the run with it"
            )
        if not 1 <= self.diloco_min_islands <= self.diloco_islands:
            raise ValueError(
                f"--diloco_min_islands {self.diloco_min_islands}: must be in [1, "
                f"--diloco_islands {self.diloco_islands}]"
            )
        if not self.diloco_quorum_timeout > 0:
            raise ValueError(f"--diloco_quorum_timeout {self.diloco_quorum_timeout}: must be > 0")

    @property
    def enabled(self) -> bool:
        return self.diloco_inner_steps is not None

    def check_training(self, args) -> None:
        """Checks against TrainingArguments: checkpoints fall on outer steps only."""
        h = self.diloco_inner_steps
        if self.enabled and args.save_steps % h:
            raise ValueError(
                f"--save_steps {args.save_steps}: must be a multiple of --diloco_inner_steps {h} "
                "(checkpoints are taken at outer steps only)"
            )
        if self.diloco_island_steps is not None and args.carry_state:
            raise ValueError(f"--diloco_island_steps {self.diloco_island_steps} with "
                             "--carry_state: a resting step would break the carried streams; "
                             "drop one of them")

    def local_islands(self) -> list[int]:
        """The islands this launch runs."""
        if not self.enabled:
            return [0]
        if self.diloco_island_index is not None:
            return [self.diloco_island_index]
        return list(range(self.diloco_islands))

    def output_dir(self, root: str, island: int) -> str:
        """Island i's metrics.jsonl and checkpoints/: <root>/island<i> with several islands."""
        several = self.enabled and self.diloco_islands > 1
        return os.path.join(root, f"island{island}") if several else root

    def resume_path(self, resume: str, save_dir: str, island: int) -> str:
        """--resume_from_checkpoint for island `island`: 'latest'; a run's output directory of
        islands (a --checkpoint_copy_to store of them, by path or URL), whose island<i>; or the
        same tag in the island's checkpoints."""
        if not self.enabled or self.diloco_islands == 1 or resume == "latest":
            return resume
        own = self.output_dir(resume, island)
        if is_url(resume) or os.path.isdir(own):
            return own
        return os.path.join(save_dir, os.path.basename(os.path.normpath(resume)))

    def _check_sparseloco(self) -> None:
        if self.diloco_outer_momentum != 0:
            raise ValueError(
                f"--diloco_compress sparseloco with --diloco_outer_momentum "
                f"{self.diloco_outer_momentum}: its error feedback replaces outer momentum; "
                "add --diloco_outer_momentum 0")
        if not 1 <= self.diloco_sparseloco_chunk <= 65536:
            raise ValueError(f"--diloco_sparseloco_chunk {self.diloco_sparseloco_chunk}: must "
                             "be in [1, 65536]")
        if not 0 < self.diloco_sparseloco_decay <= 1:
            raise ValueError(f"--diloco_sparseloco_decay {self.diloco_sparseloco_decay}: must "
                             "be in (0, 1]")

    def sparse_density(self) -> float:
        """The share of values sent: --diloco_topk, or SparseLoCo's 64 of 4096 by default."""
        if self.diloco_compress == "sparseloco" and not self.diloco_topk:
            return SPARSELOCO_DENSITY
        return self.diloco_topk

    def config(self) -> Optional[DiLoCoConfig]:
        """The outer loop's own config; None when DiLoCo is off."""
        if not self.enabled:
            return None
        return DiLoCoConfig(
            inner_steps=self.diloco_inner_steps, mode=self.diloco_mode,
            compress="topk" if self.diloco_topk and self.diloco_compress == "none"
            else self.diloco_compress,
            int8_block=self.diloco_int8_block, topk=self.sparse_density(),
            sparse_chunk=self.diloco_sparseloco_chunk,
            error_decay=self.diloco_sparseloco_decay if self.diloco_compress == "sparseloco"
            else 1.0,
            outer_lr=self.diloco_outer_lr, outer_momentum=self.diloco_outer_momentum,
            nesterov=self.diloco_nesterov, outer_on_cpu=self.diloco_outer_on_cpu,
            checksum=self.diloco_checksum, elastic=self.diloco_elastic,
            quorum_timeout=self.diloco_quorum_timeout, min_islands=self.diloco_min_islands,
            join=self.diloco_join, fragments=self.diloco_fragments,
            fragment_delay=self.fragment_delay() if self.diloco_mode == "delayed" else 0,
            fragment_alpha=self.diloco_fragment_alpha,
            exchange_thread=self.diloco_exchange_thread, island_steps=self.island_steps(),
        )
