"""--streaming across data ranks, on real files and the real `datasets` streaming: a stream of at
least as many shards as ranks split by shards (each rank opens its own files, together every
block once), and --carry_state's rows (each a stretch of its rank's documents, carried exactly,
resumed exactly). The 2-rank jobs that kill and resume them are in tests/test_stream.py."""

import json
import os
from collections import Counter

import datasets
import pytest
import torch

from dragon.data.streaming import StreamingBatches, build_streams
from dragon.data.text import DataArguments, load_text, pack

datasets.disable_progress_bars()


def ids(rows) -> list[list[int]]:
    return [list(map(int, r)) for r in rows]


def read(batches, n) -> list[torch.Tensor]:
    return [next(batches) for _ in range(n)]


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_of_a_sharded_stream_read_their_own_files_and_together_all(
        tmp_path, four_shards, monkeypatch, world):
    """4 file shards on 2 and 4 data ranks: each rank opens only its own files while it reads,
    its blocks are those files' blocks as the materialised path packs them, and the ranks'
    blocks with the held-out head are every block once."""
    import builtins

    args = DataArguments(train_file=str(four_shards), streaming=True, block_size=15,
                         validation_blocks=5, cache_dir=str(tmp_path / "cache"))
    train, valid, tok = build_streams(args, world=world)
    assert train.by_shards and "4 shards split among" in train.describe()
    files = sorted(four_shards.glob("*.jsonl"))
    opened, real_open = [], builtins.open

    def counting_open(path, *a, **kw):
        if str(path).endswith(".jsonl"):
            opened.append(os.path.basename(str(path)))
        return real_open(path, *a, **kw)

    read_by, every = {}, []
    for r in range(world):
        mine = files[r * 4 // world:(r + 1) * 4 // world]
        expected = ids(pack(load_text(DataArguments(train_file=",".join(map(str, mine)))),
                            tok, 15)["input_ids"])
        opened.clear()
        monkeypatch.setattr(builtins, "open", counting_open)
        stream, stride = train.for_rank(r, world)
        got = ids(row["input_ids"] for row in stream)
        monkeypatch.setattr(builtins, "open", real_open)
        assert stride == 1 and set(opened) == {f.name for f in mine}, (r, opened)
        assert got == (expected[5:] if r == 0 else expected), r
        assert ids(next(StreamingBatches(train, 3, r, world))) == got[:3]
        read_by[r] = got
        every += expected
    assert ids(valid["input_ids"]) == every[:5]
    together = ids(valid["input_ids"]) + [b for r in range(world) for b in read_by[r]]
    assert Counter(map(tuple, together)) == Counter(map(tuple, every))
    assert len(set(map(tuple, every))) == len(every)  # distinct blocks: no overlap is possible


@torch.no_grad()
def test_carried_rows_of_a_sharded_stream_are_stretches_of_their_documents(tmp_path,
                                                                            four_shards):
    """--carry_state --streaming on 4 shards and 2 data ranks, 2 micro-batches of 2 rows: row j
    of rank 1 reads documents j, 4 + j, ... of its shards, cut into consecutive blocks one a step;
    rank 0's rows start after the documents of the held-out head (its first blocks); and the
    states carried through 12 steps give the logits and losses of one forward over each row's
    stretch (atol=rtol=1e-5, tests/test_carry.py's bound)."""
    from dragon import BDHConfig, BDHForCausalLM
    from dragon.run.carry import CarriedState

    args = DataArguments(train_file=str(four_shards), streaming=True, block_size=15,
                         validation_blocks=5, cache_dir=str(tmp_path / "cache"))
    train, valid, tok = build_streams(args, world=2, carry=True)
    files = sorted(four_shards.glob("*.jsonl"))
    docs = {r: load_text(DataArguments(train_file=",".join(map(str, files[2 * r: 2 * r + 2]))))[
        "text"] for r in (0, 1)}
    head = [t for doc in docs[0][:train.held_out_documents] for t in tok.encode(doc)]
    assert ids(valid["input_ids"]) == [head[16 * i: 16 * (i + 1)] for i in range(5)]
    assert len(head) >= 5 * 16 > len(head) - len(tok.encode(docs[0][train.held_out_documents - 1]))
    torch.manual_seed(0)
    model = BDHForCausalLM(BDHConfig(n_layer=2, n_embd=32, n_head=2,
                                     mlp_internal_dim_multiplier=8, dropout=0.0)).eval()
    for r in (0, 1):
        mine = docs[r][train.held_out_documents if r == 0 else 0:]
        rows = train.rows_for_rank(r, 2, tok, 15, micro_batch_size=2, grad_accum=2)
        carried = CarriedState(slots=2, n_layer=2, steps_per_epoch=None)
        steps, logits, step_losses = [], [], []
        for step in range(12):
            carried.begin_step(step)
            batches = [next(rows) for _ in range(2)]
            outs = [model(b, labels=b, cache=carried.caches[a]) for a, b in enumerate(batches)]
            carried.end_step()
            steps.append(torch.cat(batches))
            logits.append(torch.cat([o.logits for o in outs]))
            step_losses.append([o.loss for o in outs])
        for j in range(4):
            stretch = [t for doc in mine[j::4] for t in tok.encode(doc)][: 12 * 16]
            assert [ids(s)[j] for s in steps] == [stretch[16 * k: 16 * (k + 1)]
                                                  for k in range(12)], (r, j)
        whole = torch.cat(steps, dim=1)  # each row's 12 blocks, one after another
        once = model(whole).logits
        torch.testing.assert_close(torch.cat(logits, dim=1), once, atol=1e-5, rtol=1e-5)
        for k, (first, second) in enumerate(step_losses):
            part = once[:, 16 * k: 16 * (k + 1)]
            expect = [torch.nn.functional.cross_entropy(
                part[a * 2: a * 2 + 2, :-1].reshape(-1, 256),
                whole[a * 2: a * 2 + 2, 16 * k + 1: 16 * (k + 1)].reshape(-1)) for a in (0, 1)]
            torch.testing.assert_close(torch.stack([first, second]), torch.stack(expect),
                                       atol=1e-5, rtol=1e-5)


def test_carried_rows_of_long_documents_resume_exactly(tmp_path):
    """Documents many blocks long (a row holds several blocks before it reads again): rows saved
    between steps (through torch.save) and read by a new reader continue as the uninterrupted
    rows, inside the first pass and past the stream's end."""
    root = tmp_path / "long"
    root.mkdir()
    for k in range(2):
        (root / f"{k}.jsonl").write_text("".join(json.dumps(
            {"text": f"shard {k} document {i}: " + "abcdefgh" * (20 + 7 * i)}) + "\n"
            for i in range(6)))
    args = DataArguments(train_file=str(root), streaming=True, block_size=15,
                         validation_blocks=3, cache_dir=str(tmp_path / "cache"))
    train, _, tok = build_streams(args, world=2, carry=True)
    for rank in (0, 1):
        whole = train.rows_for_rank(rank, 2, tok, 15, micro_batch_size=2, grad_accum=1)
        expected = [next(whole) for _ in range(120)]
        for consumed in (3, 77):
            first = train.rows_for_rank(rank, 2, tok, 15, micro_batch_size=2, grad_accum=1)
            read(first, consumed)
            torch.save(first.state_dict(), tmp_path / "rows.pt")
            again = train.rows_for_rank(rank, 2, tok, 15, micro_batch_size=2, grad_accum=1)
            again.load_state_dict(torch.load(tmp_path / "rows.pt", weights_only=False))
            assert all(torch.equal(a, b) for a, b in zip(read(again, 20),
                                                          expected[consumed:consumed + 20]))
        assert whole.epoch >= 1  # past the stream's end
