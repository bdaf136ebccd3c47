"""Train a BERT masked-language model with shardtrain's data parallelism over a ring
all-reduce: the example that closes the course notes (seed 001, "Training BERT model with
distributed data parallel via Ring AllReduce"), on any nn.Module -- here `transformers`'
BertForMaskedLM, not shardtrain's own transformer.

One node, two processes (Gloo on CPU, NCCL on GPUs):

    torchrun --standalone --nproc-per-node 2 examples/bert_ddp.py --steps 50

Two nodes with four processes each (world size 8); run on both machines, with
MASTER=the first node's address:

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-id bert_job --rdzv-backend c10d \
        --rdzv-endpoint $MASTER:29500 examples/bert_ddp.py --steps 50

What happens: a WordPiece tokenizer is trained on the embedded corpus (the Python standard
library's source, shardtrain's default data) by rank 0 and shared through a file; each step
draws `--batch` sequences of masked-LM inputs (BERT's recipe: 15% of the tokens chosen, 80%
of those replaced by [MASK], 10% by a random token, 10% kept) from a generator seeded by the
step, so every rank draws the same global batch and keeps its rows rank::world. The model
is built with the same seed on every rank; `DataParallel` (shardtrain/parallel/data/ddp.py)
hooks its parameters and averages gradients over a Communicator whose all-reduce is the
ring algorithm (shardtrain/comm/algorithms/): the bytes go through shardtrain's ledger.

`--compare-ddp` trains a second copy with torch's DistributedDataParallel on the same
batches and prints both loss curves (tests/test_bert_example.py checks they agree).
Dropout is off so that the two runs are comparable step for step.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from shardtrain.config import DataConfig
from shardtrain.data.fsutil import build_once
from shardtrain.data.sources import iter_documents
from shardtrain.launch import ProcessInfo, init_distributed
from shardtrain.comm import build_mesh
from shardtrain.mesh import MeshShape
from shardtrain.parallel.data.ddp import DataParallel

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def train_tokenizer(path: Path, vocab_size: int, max_bytes: int):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    def build(tmp: Path) -> None:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=False)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                            show_progress=False)
        tok.train_from_iterator(iter_documents(data), trainer)
        tok.save(str(tmp))

    data = DataConfig(max_bytes=max_bytes)
    build_once(path, build, timeout_s=data.lock_timeout_s)
    return Tokenizer.from_file(str(path))


def token_stream(tok, max_bytes: int) -> torch.Tensor:
    docs = list(iter_documents(DataConfig(max_bytes=max_bytes)))
    return torch.tensor([i for e in tok.encode_batch(docs) for i in e.ids], dtype=torch.long)


def mlm_batch(stream: torch.Tensor, step: int, batch: int, seq_len: int, vocab: int,
              ids: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch: input ids [B, S] ([CLS] text [SEP]) and labels [B, S]
    (-100 where the loss ignores the position)."""
    gen = torch.Generator().manual_seed(1000 + step)
    body = seq_len - 2
    starts = torch.randint(0, stream.numel() - body, (batch,), generator=gen)
    text = torch.stack([stream[s:s + body] for s in starts.tolist()])  # [B, S-2]
    chosen = torch.rand(text.shape, generator=gen) < 0.15
    labels = torch.where(chosen, text, torch.full_like(text, -100))
    roll = torch.rand(text.shape, generator=gen)
    random_ids = torch.randint(len(SPECIALS), vocab, text.shape, generator=gen)
    inputs = torch.where(chosen & (roll < 0.8), torch.full_like(text, ids["[MASK]"]), text)
    inputs = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_ids, inputs)
    cls = torch.full((batch, 1), ids["[CLS]"])
    sep = torch.full((batch, 1), ids["[SEP]"])
    ignore = torch.full((batch, 1), -100)
    return torch.cat([cls, inputs, sep], 1), torch.cat([ignore, labels, ignore], 1)


def build_bert(vocab: int, seq_len: int, seed: int, device: torch.device):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=128,
                     max_position_embeddings=seq_len, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(cfg).to(device)


def train(model, zero_grad, finish, batches, lr: float) -> list[torch.Tensor]:
    """This rank's loss at each step (the caller averages over ranks)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for inputs, labels in batches:
        zero_grad()
        loss = model(input_ids=inputs, labels=labels).loss
        loss.backward()
        finish()  # gradients averaged over the ranks
        opt.step()
        losses.append(loss.detach())
    return losses


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--max-bytes", type=int, default=1_000_000, help="corpus bytes read")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer-dir", default=os.path.expanduser("~/.cache/shardtrain/bert"))
    ap.add_argument("--compare-ddp", action="store_true", help="also train with torch DDP")
    ap.add_argument("--json", default="", help="write the loss curves here (rank 0)")
    args = ap.parse_args(argv)

    info = ProcessInfo.from_env()
    device = torch.device("cuda", info.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    init_distributed(info, device, timeout_s=300)
    mesh = build_mesh(MeshShape(dp=info.world_size), rank=info.rank,
                      node_size=info.local_world_size, algorithm="ring", device=device)
    comm = mesh.comm("dp")
    if args.batch % info.world_size:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the world size {info.world_size}")

    tok_file = Path(args.tokenizer_dir) / f"wordpiece-{args.vocab}-{args.max_bytes}.json"
    if info.rank == 0:
        train_tokenizer(tok_file, args.vocab, args.max_bytes)
    comm.barrier()
    tok = train_tokenizer(tok_file, args.vocab, args.max_bytes)  # built: just read
    vocab = tok.get_vocab_size()
    stream = token_stream(tok, args.max_bytes)
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    batches = []
    for step in range(args.steps):  # this rank's rows of each global batch
        inputs, labels = mlm_batch(stream, step, args.batch, args.seq_len, vocab, ids)
        batches.append((inputs[info.rank::info.world_size].contiguous().to(device),
                        labels[info.rank::info.world_size].contiguous().to(device)))

    def mean_over_ranks(losses: list[torch.Tensor]) -> list[float]:
        t = torch.stack(losses)
        comm.all_reduce(t, "avg", tag="metric")
        return t.tolist()

    model = build_bert(vocab, args.seq_len, args.seed, device)
    # Our DDP: .grad tensors become views into flat buckets, all-reduced (ring) as they fill.
    reducer = DataParallel(model, comm, bucket_mb=1.0)
    mesh.ledger.mark()
    curve = train(model, reducer.zero_grad, reducer.finish, batches, args.lr)
    records = [r for r in mesh.ledger.mark() if r.tag == "grad"]
    sent = mesh.ledger.totals(records)["sent_bytes"]
    algorithms = sorted({r.algorithm for r in records})
    results = {"shardtrain_ring": mean_over_ranks(curve)}
    if args.compare_ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ref = build_bert(vocab, args.seq_len, args.seed, device)
        ddp = DDP(ref) if info.world_size > 1 else ref
        curve = train(ddp, lambda: ddp.zero_grad(set_to_none=True), lambda: None, batches, args.lr)
        results["torch_ddp"] = mean_over_ranks(curve)
    if info.rank == 0:
        for name, curve in results.items():
            print(f"{name:16s} " + " ".join(f"{x:.4f}" for x in curve), flush=True)
        print(f"gradient all-reduce ({', '.join(algorithms)}): {sent / 2**20:.1f} MiB sent "
              "by rank 0", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({**results, "algorithms": algorithms,
                                                   "grad_sent_bytes": sent}))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
