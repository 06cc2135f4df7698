"""One rank of K that split a BDH model's neurons, for tests/test_neurons.py.

    python neuron_split.py RANK K PORT OUT_PT

Every rank builds the same whole model (tests/test_neurons.py's tiny config, seed 0), keeps its
share of the neurons (dragon.parallel.neurons.split_neurons) and runs, in each attention form
and at T a multiple of the chunk and not, a forward with labels and a backward; the shards'
gradients are gathered back to whole tensors. Then a stream continued through the state cache
and a greedy generate(). Rank 0 saves it all.
"""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from dragon.model.bdh import BDHConfig, BDHForCausalLM
from dragon.parallel.neurons import gather_neurons, split_neurons

CONFIG = dict(n_layer=2, n_embd=32, n_head=2, mlp_internal_dim_multiplier=16, dropout=0.0,
              vocab_size=64, attention_chunk_size=8)
CASES = [(form, T) for form in ("quadratic", "chunked", "recurrent") for T in (16, 13)]


def whole_model() -> BDHForCausalLM:
    torch.manual_seed(0)
    return BDHForCausalLM(BDHConfig(**CONFIG)).eval()


def tokens(T: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(T)
    return torch.randint(0, CONFIG["vocab_size"], (2, T), generator=generator)


def run_cases(model, gather) -> dict:
    """Per (form, T): the logits, the loss and every parameter's gradient (whole)."""
    out = {}
    for form, T in CASES:
        model.config.attention = form
        model.zero_grad()
        ids = tokens(T)
        result = model(input_ids=ids, labels=ids)
        result.loss.backward()
        grads = gather({name: p.grad for name, p in model.named_parameters()})
        out[(form, T)] = {"logits": result.logits.detach(), "loss": result.loss.item(),
                          "grads": grads}
    model.config.attention = "auto"
    with torch.no_grad():
        ids = tokens(21)
        first = model(input_ids=ids[:, :9], use_cache=True)
        rest = model(input_ids=ids[:, 9:], cache=first.cache)
        out["carried"] = torch.cat([first.logits, rest.logits], dim=1)
        out["generated"] = model.generate(ids[:, :5], max_new_tokens=12, do_sample=False)
    return out


def main() -> None:
    rank, k, port, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=k, timeout=timedelta(seconds=120))
    model = whole_model()
    split_neurons(model, dist.group.WORLD, rank, k)
    out = run_cases(model, lambda grads: gather_neurons(grads, model.config, dist.group.WORLD, k))
    if rank == 0:
        torch.save(out, path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
