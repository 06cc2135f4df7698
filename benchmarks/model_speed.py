"""Speed and memory of BDH's attention forms, cached generation and the DeepSpeed engine.

    python benchmarks/model_speed.py            (2 CPU cores: 12-30 minutes)
    python benchmarks/model_speed.py --quick    (T up to 1024, 256 new tokens: 4-8 minutes)
    python benchmarks/model_speed.py --part generation    (table 2 only: 4-8 minutes)

Prints markdown tables, each ours next to its baseline from the same run:
1. forward+backward tokens/s of the quadratic and chunked forms against a plain implementation
   of the reference's definition (full T x T scores, masked), T = 256 ... 4096, and which form
   "auto" picks (the recurrent form is the decoding form: its backward would keep a state per
   position);
2. generation tokens/s with the state cache against full recompute (greedy, identical text);
3. peak memory of each (the process's peak resident set above what it held before);
4. achieved FLOP/s of the FLOPs each form really does (dragon.model.cost) against this
   machine's measured fp32 matmul FLOP/s;
5. one-process DeepSpeed ZeRO-0 step time against a plain PyTorch loop on the same model, and
   torch.compile against eager;
6. per-rank bytes of parameters and optimizer (fp32 master weights and states) under ZeRO-3
   against ZeRO-0 on 2 ranks.
Every measurement of 1-3 runs in a process of its own, so peaks do not mix.
"""

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dragon import BDHConfig, BDHForCausalLM  # noqa: E402
from dragon.model.attention import resolve_form  # noqa: E402
from dragon.model.cost import model_profile  # noqa: E402

DIMS = dict(n_layer=6, n_embd=256, n_head=4, mlp_internal_dim_multiplier=16, dropout=0.0)
TOKENS_PER_STEP = 1024  # batch = this / T (at least 1): small tensors keep allocator noise down
FORMS = ("reference", "quadratic", "chunked")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    llc = "/sys/devices/system/cpu/cpu0/cache/index3/size"
    cache = f", last-level cache {open(llc).read().strip()}" if os.path.exists(llc) else ""
    return f"{names[0] if names else platform.processor()} ({os.cpu_count()} cores{cache})"


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reference_logits(model: BDHForCausalLM, idx: torch.Tensor) -> torch.Tensor:
    """The reference's forward written plainly on our weights: every T x T score is computed."""
    layer, nh = model.layer, model.config.n_head
    B, T = idx.shape
    x = F.layer_norm(model.embed(idx), (model.config.n_embd,)).unsqueeze(1)
    phases = torch.arange(T, dtype=torch.float32, device=idx.device).view(1, 1, T, 1)
    phases = phases * layer.attn.freqs % 1 * 2 * math.pi
    cos, sin = torch.cos(phases).to(x.dtype), torch.sin(phases).to(x.dtype)
    mask = torch.ones(T, T, dtype=x.dtype, device=idx.device).tril(diagonal=-1)
    for _ in range(model.config.n_layer):
        x_sparse = F.relu(x @ layer.encoder)
        rot = torch.stack((-x_sparse[..., 1::2], x_sparse[..., ::2]), dim=-1).view(*x_sparse.size())
        q = x_sparse * cos + rot * sin
        y = F.layer_norm(((q @ q.mT) * mask) @ x, (x.size(-1),))
        xy = x_sparse * F.relu(y @ layer.encoder_v)
        y_mlp = xy.transpose(1, 2).reshape(B, 1, T, nh * layer.encoder.size(-1)) @ layer.decoder
        x = F.layer_norm(x + F.layer_norm(y_mlp, (x.size(-1),)), (x.size(-1),))
    return x.view(B, T, -1) @ model.lm_head


def train_flops_per_token(config: BDHConfig, form: str, T: int) -> float:
    if form == "reference":  # quadratic over every pair, as the reference computes it
        nh, D, N, V = config.n_head, config.n_embd, config.n_neurons, config.vocab_size
        return 3 * 2.0 * (config.n_layer * (3 * nh * D * N + nh * T * (N + D)) + D * V)
    return model_profile(config, T, form).train_flops_per_token


def train_step(model: BDHForCausalLM, ids: torch.Tensor, form: str) -> None:
    """One forward+backward of `form` on ids ("reference": reference_logits on model's weights)."""
    if form == "reference":
        logits = reference_logits(model, ids).float()
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    else:
        loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    model.zero_grad(set_to_none=True)


def measure_training(form: str, T: int, reps: int) -> dict:
    """tokens/s (median of reps) and peak memory of forward+backward of one form at length T."""
    torch.manual_seed(0)
    attention = "quadratic" if form == "reference" else form
    model = BDHForCausalLM(BDHConfig(**DIMS, attention=attention))
    B = max(1, TOKENS_PER_STEP // T)
    ids = torch.randint(0, 256, (B, T))
    before = rss_bytes()
    times = []
    for _ in range(reps + 1):  # the first is warm-up
        start = time.perf_counter()
        train_step(model, ids, form)
        times.append(time.perf_counter() - start)
    tps = B * T / statistics.median(times[1:])
    return {
        "tokens_per_second": tps,
        "peak_bytes": peak_rss_bytes() - before,
        "flops": tps * train_flops_per_token(model.config, form, T),
    }


@torch.no_grad()
def measure_generation(use_cache: bool, new_tokens: int) -> dict:
    torch.manual_seed(0)
    model = BDHForCausalLM(BDHConfig(**DIMS)).eval()
    prompt = torch.randint(0, 256, (1, 16))
    before = rss_bytes()
    start = time.perf_counter()
    out = model.generate(
        prompt,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        use_cache=use_cache,
    )
    seconds = time.perf_counter() - start
    return {
        "tokens_per_second": new_tokens / seconds,
        "peak_bytes": peak_rss_bytes() - before,
        "text": out[0].tolist(),
    }


@torch.no_grad()
def bf16_error(T: int = 4096) -> dict:
    """Relative L2 error of bf16 logits against fp32 at length T, chunked (fp32 state) and
    quadratic.
    """
    torch.manual_seed(0)
    model = BDHForCausalLM(BDHConfig(**DIMS)).eval()
    ids = torch.randint(0, 256, (1, T))
    errors = {}
    for form in ("chunked", "quadratic"):
        model.config.attention = form
        ref = model.float()(ids, use_cache=False).logits
        low = model.bfloat16()(ids, use_cache=False).logits.float()
        errors[form] = ((low - ref).norm() / ref.norm()).item()
    return errors


def matmul_flops(n: int = 2048, reps: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = min(_timed(lambda: a @ b) for _ in range(reps))
    return 2 * n**3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def worker(kind: str, *params: str) -> dict:
    """Run one measurement in a fresh process (this script with --worker), return its JSON."""
    cmd = [sys.executable, __file__, "--worker", kind, *params]
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def engine_overhead(steps: int = 8) -> dict:
    """Step time of a one-process DeepSpeed ZeRO-0 engine and of a plain loop, steps alternating."""
    import deepspeed

    from dragon.parallel.distributed import init_distributed

    init_distributed(120)
    torch.manual_seed(0)
    config = BDHConfig(**DIMS)
    plain, wrapped = BDHForCausalLM(config), BDHForCausalLM(config)
    wrapped.load_state_dict(plain.state_dict())
    ds_config = {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 0},
    }
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(
        model=wrapped, optimizer=torch.optim.AdamW(wrapped.parameters(), lr=1e-3), config=ds_config
    )
    ids = torch.randint(0, 256, (2, 512))

    def plain_step():
        plain(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def engine_step():
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    times = {"plain": [], "deepspeed": []}
    for i in range(steps + 1):
        for name, fn in (("plain", plain_step), ("deepspeed", engine_step))[:: 1 if i % 2 else -1]:
            seconds = _timed(fn)
            if i:
                times[name].append(seconds)
    return {k: statistics.median(v) for k, v in times.items()}


def compile_speed(steps: int = 6) -> dict:
    """Forward+backward step time of the model eager and under torch.compile, T=512, batch 2."""
    torch.manual_seed(0)
    eager = BDHForCausalLM(BDHConfig(**DIMS))
    compiled = BDHForCausalLM(BDHConfig(**DIMS))
    compiled.load_state_dict(eager.state_dict())
    compiled.compile()
    ids = torch.randint(0, 256, (2, 512))

    def step(model):
        return lambda: model(ids, labels=ids).loss.backward()

    first = _timed(step(compiled))  # compiles
    times = {"eager": [], "compiled": []}
    for i in range(steps + 1):
        for name, model in (("eager", eager), ("compiled", compiled)):
            seconds = _timed(step(model))
            if i:
                times[name].append(seconds)
    return {"compile_seconds": first, **{k: statistics.median(v) for k, v in times.items()}}


def zero_bytes(stage: int, bf16: bool) -> dict:
    """Bytes this rank holds for parameters and the optimizer (fp32 master weights and states)
    after one step, under ZeRO `stage` on the launched ranks."""
    import deepspeed

    from dragon.parallel.distributed import init_distributed
    from dragon.parallel.master_weights import MasterWeights

    init_distributed(120)
    torch.manual_seed(0)
    model = BDHForCausalLM(BDHConfig(**DIMS))
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "train_batch_size": torch.distributed.get_world_size(),
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=ds_config
    )
    ids = torch.randint(0, 256, (1, 32))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    # This rank's weights, its fp32 master weights (dragon.parallel.master_weights knows where each
    # DeepSpeed
    # optimizer keeps them) and its optimizer states; each storage counted once (ZeRO-0 fp32: the
    # weights are the masters).
    stored = [getattr(p, "ds_tensor", p.data) for p in engine.module.parameters()]
    stored += MasterWeights(engine).tensors()
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    stored += [
        t for state in inner.state.values() for t in state.values() if isinstance(t, torch.Tensor)
    ]
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in stored if t.numel()
    }
    return {"bytes": sum(storages.values())}


def zero_bytes_on_two_ranks(stage: int, bf16: bool) -> int:
    cmd = [
        "torchrun",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(29650 + stage + 10 * bf16),
        __file__,
        "--worker",
        "zero_bytes",
        str(stage),
        str(int(bf16)),
    ]
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return max(r["bytes"] for r in rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T up to 1024 and 256 new tokens only")
    parser.add_argument(
        "--reps", type=int, default=3, help="timed steps per measurement (after a warm-up)"
    )
    parser.add_argument(
        "--part",
        choices=("all", "generation"),
        default="all",
        help="generation: only the cached-against-recompute table, 256 and 1,024 new tokens",
    )
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, *params = args.worker
        if kind == "train":
            result = measure_training(params[0], int(params[1]), int(params[2]))
        elif kind == "generate":
            result = measure_generation(params[0] == "1", int(params[1]))
        elif kind == "engine":
            result = engine_overhead()
        elif kind == "compile":
            result = compile_speed()
        elif kind == "bf16":
            result = bf16_error()
        else:
            result = zero_bytes(int(params[0]), params[1] == "1")
        print(json.dumps(result), flush=True)  # under torchrun each rank prints its own line
        return
    report(args)


def generation_table(new_tokens: tuple[int, ...]) -> None:
    """Cached generation measured before and after the recompute one: a memory-bound step moves
    with the neighbours' use of the memory bus, so both figures and their ratios are shown."""
    print(
        "\n| new tokens | cached tokens/s (before, after) | recompute tokens/s | speed-up | "
        "cached peak | recompute peak | same text |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in new_tokens:
        before = worker("generate", "1", str(n))
        full = worker("generate", "0", str(n))
        after = worker("generate", "1", str(n))
        speeds = [r["tokens_per_second"] for r in (before, after)]
        ratios = ", ".join(f"{v / full['tokens_per_second']:.0f}x" for v in speeds)
        print(
            f"| {n} | {speeds[0]:.1f}, {speeds[1]:.1f} | {full['tokens_per_second']:.2f} | "
            f"{ratios} | {before['peak_bytes'] / 2**20:.0f} MiB | "
            f"{full['peak_bytes'] / 2**20:.0f} MiB | "
            f"{before['text'] == full['text'] == after['text']} |",
            flush=True,
        )


def report(args) -> None:
    config = BDHConfig(**DIMS)
    print(
        f"`python {' '.join(sys.argv)}` on {cpu_name()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; BDH {DIMS} (N={config.n_neurons} per head, "
        f"{model_profile(config, 1).parameters:,} parameters), fp32"
    )
    if args.part == "generation":
        generation_table((256, 1024))
        return
    lengths = (256, 512, 1024) if args.quick else (256, 512, 1024, 2048, 4096)
    new_tokens = (256,) if args.quick else (256, 1024)
    peak = matmul_flops()
    print(f"{TOKENS_PER_STEP} tokens a step; measured fp32 matmul peak {peak / 1e9:.1f} GFLOP/s\n")
    print(
        "| T | reference tokens/s | quadratic | chunked | auto picks | "
        "peak memory reference / quadratic / chunked | MFU reference / quadratic / chunked |"
    )
    print("|---|---|---|---|---|---|---|")
    for T in lengths:
        r = {form: worker("train", form, str(T), str(args.reps)) for form in FORMS}
        base = r["reference"]["tokens_per_second"]
        speed = [
            f"{r[f]['tokens_per_second']:.0f} ({r[f]['tokens_per_second'] / base:.2f}x)"
            for f in FORMS[1:]
        ]
        memory = " / ".join(f"{r[f]['peak_bytes'] / 2**20:.0f}" for f in FORMS)
        mfu = " / ".join(f"{r[f]['flops'] / peak:.0%}" for f in FORMS)
        pick = resolve_form("auto", T, config.attention_chunk_size, False)
        print(
            f"| {T} | {base:.0f} | {' | '.join(speed)} | {pick} | {memory} MiB | {mfu} |",
            flush=True,
        )
    generation_table(new_tokens)
    e = worker("engine")
    print(
        "\n| one process, T=512, batch 2 | plain PyTorch loop | DeepSpeed ZeRO-0 | ratio |\n"
        "|---|---|---|---|\n"
        f"| s/step (median of 8) | {e['plain']:.3f} | {e['deepspeed']:.3f} | "
        f"{e['deepspeed'] / e['plain']:.3f}x |"
    )
    c = worker("compile")
    print(
        "\n| one process, T=512, batch 2 | eager | torch.compile | compiled / eager |\n"
        "|---|---|---|---|\n"
        f"| s/step (median of 6; compiling took {c['compile_seconds']:.0f} s) | {c['eager']:.3f} | "
        f"{c['compiled']:.3f} | {c['compiled'] / c['eager']:.2f}x |"
    )
    if not args.quick:
        err = worker("bf16")
        print(
            "\nbf16 against fp32 logits at T=4096 (relative L2 error): "
            "chunked with its fp32 state "
            f"{err['chunked']:.2e}, quadratic {err['quadratic']:.2e}"
        )
    print("\n| 2 ranks, per rank | ZeRO-0 | ZeRO-3 | ratio |\n|---|---|---|---|")
    for bf16 in (False, True):
        z0, z3 = zero_bytes_on_two_ranks(0, bf16), zero_bytes_on_two_ranks(3, bf16)
        print(
            f"| parameters + optimizer, {'bf16' if bf16 else 'fp32'} | {z0 / 2**20:.1f} MiB | "
            f"{z3 / 2**20:.1f} MiB | {z3 / z0:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
