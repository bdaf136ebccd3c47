"""Our pipeline against torch.distributed.pipelining's: same model, same split, same
micro-batches, same optimizer, the same schedule -- 1F1B against Schedule1F1B, ZB-H1 against
ScheduleInterleavedZeroBubble (with one stage per rank, torch's ZB-H1 order: Qi et al. 2024),
ZB-V against ScheduleZBVZeroBubble and DualPipeV against ScheduleDualPipeV (two stages per
rank in a V: rank r holds virtual stages r and 2p-1-r, as ours).

    python benchmarks/pp_vs_torch_pipelining.py [--schedule 1f1b|zb-h1|zbv|dualpipev]
        [--nproc 2] [--steps 20] [--section.field V ...]

With a schedule other than 1f1b ours also runs 1F1B in the same rotation and prints ours S /
ours 1f1b. The V schedules need the layers to split into 2 x nproc chunks (the default
model's 4 layers: --nproc 2; --model.n_layers 8 for --nproc 4).

Each of the `--nproc` processes is one pipeline stage (parallel.pp = nproc). Ours is the
trainer with parallel.pp and schedule 1f1b; torch's wraps the very stage modules our
partition cuts from the plain model (`split_stages`: the same layers per stage,
initialised by name from the same seed) in `PipelineStage` and drives them with
`Schedule1F1B` over Gloo, then clips the global gradient norm and steps the same optimizer:
the trainer's work. Both read their own copy of the token sampler, so step k of each sees
the same micro-batches. One step of each in turn, alternating which goes first, so machine
noise and drift hit both alike. Prints both first-step losses (they must agree), tokens/s
of each (the last stage's timing) and, as the last line, one JSON object with the ratio
(ours / torch; > 1 means ours is faster). A figure, never a test.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV,
                                          ScheduleInterleavedZeroBubble,
                                          ScheduleZBVZeroBubble)

from interleave import interleaved_tokens_per_s
from teardown import run_then_leave
from shardtrain import config
from shardtrain.data import TokenSampler
from shardtrain.launch import ProcessInfo, init_distributed, launch_local
from shardtrain.comm import build_mesh
from shardtrain.mesh import MeshShape
from shardtrain.model.transformer import build_model
from shardtrain.parallel.pipeline.schedules import V_SHAPED, placement
from shardtrain.parallel.pipeline.stage import split_stages
from shardtrain.parallel.tensor.vocab import cross_entropy
from shardtrain.train.optim import build_optimizer
from shardtrain.train.trainer import Trainer


class TorchStage(nn.Module):
    """One chunk of our stage as torch's pipelining wants it: a module whose own parameters
    are the chunk's (its layers, the embedding on the first, norm and head on the last), so
    torch's weight passes and scaling see the right ones."""

    def __init__(self, stage: nn.Module, chunk: nn.Module):
        super().__init__()
        owned = [stage.layers[str(i)] for i in chunk.indices]
        owned += [getattr(stage, n) for n in ("tok_emb", "pos_emb") if chunk.first and
                  hasattr(stage, n)] + ([stage.norm, stage.head] if chunk.last else [])
        self.owned = nn.ModuleList(owned)
        self.__dict__["chunk"] = chunk  # runs the modules above: not a second owner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.chunk(x)  # tokens or [B, S, C] -> [B, S, C] or logits [B, S, V]


class TorchPipeline:
    """One optimizer step with torch's Schedule1F1B, then what the trainer does after the
    backwards: the global gradient norm over the stages, clipping, the optimizer step and
    the mean loss sent from the last stage to all."""

    def __init__(self, cfg: config.Config, rank: int, pp: int, microbatches: int,
                 sampler: TokenSampler, schedule: str):
        model = build_model(cfg.model, seed=None)  # meta: this stage alone is materialised
        module, chunks = split_stages(model, cfg, stage=rank)
        module.to_empty(device="cpu")
        module.tie_weights()
        module.init_weights(cfg.train.seed)
        self.module, self.rank, self.pp, self.sampler = module, rank, pp, sampler
        self.place = placement(schedule, pp, len(chunks))
        stages = [PipelineStage(TorchStage(module, chunk), self.place.virtual(rank, c),
                                self.place.last + 1, torch.device("cpu"))
                  for c, chunk in enumerate(chunks)]
        self.m = microbatches
        # The V's two stages of a rank may share no parameter but a tied embedding: we
        # divide the summed gradients by m once, torch does not scale (scale_grads=False).
        runtime = {"zb-h1": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
                   "dualpipev": ScheduleDualPipeV}
        if schedule in runtime:  # runtime schedules: they take a list of this rank's stages
            self.schedule = runtime[schedule](stages, microbatches, loss_fn=cross_entropy,
                                              scale_grads=False)
        else:
            self.schedule = Schedule1F1B(stages[0], microbatches, loss_fn=cross_entropy,
                                         scale_grads=False)
        first, last = self.place.where(0)[0], self.place.where(self.place.last)[0]
        self.ends = (rank == first, rank == last)
        self.optimizer = build_optimizer(module, cfg.optim, cfg.train.lr)
        self.clip = cfg.optim.grad_clip or float("inf")

    def step(self) -> float:
        self.optimizer.zero_grad(set_to_none=False)
        inputs, targets = (torch.cat(t) for t in zip(*self.sampler.next_step()))  # [B, S]
        losses: list[torch.Tensor] = []
        feeds, ends = self.ends  # (holds the first virtual stage, holds the last)
        self.schedule.step(*([inputs] if feeds else []),
                           **({"target": targets, "losses": losses} if ends else {}))
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        for g in grads:
            g.div_(self.m)
        norm = torch.stack([g.square().sum() for g in grads]).sum()
        dist.all_reduce(norm)
        scale = torch.clamp(self.clip / (norm.sqrt() + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale)
        self.optimizer.step()
        loss = torch.stack(losses).mean() if losses else torch.zeros(())
        dist.broadcast(loss, src=self.place.where(self.place.last)[0])
        return loss.item()


def worker(cfg_text: str, steps: int, baseline_text: str | None) -> dict:
    cfg = config.loads(cfg_text)
    info = ProcessInfo.from_env()
    init_distributed(info, torch.device("cpu"), cfg.comm.timeout_s)
    return run_then_leave(measure, cfg, info, steps, baseline_text)  # teardown.py


def measure(cfg: config.Config, info: ProcessInfo, steps: int,
            baseline_text: str | None) -> dict:
    """`baseline_text`: ours again under another schedule (1F1B), timed in the rotation."""
    device = torch.device("cpu")
    mesh = build_mesh(MeshShape(pp=info.world_size), rank=info.rank)
    ours = Trainer(cfg, mesh, device)
    t = cfg.train
    sampler = TokenSampler(ours.data.train, seq_len=t.seq_len, global_batch=t.global_batch,
                           micro_batch=t.micro_batch, dp_rank=0, dp_size=1, seed=t.seed)
    theirs = TorchPipeline(cfg, info.rank, info.world_size, ours.accum, sampler,
                           cfg.parallel.schedule)
    losses: dict[str, list[float]] = {"ours": [], "torch_pipelining": [], "ours_1f1b": []}
    runners = {
        "ours": lambda: losses["ours"].append(ours.train_step()["loss"]),
        "torch_pipelining": lambda: losses["torch_pipelining"].append(theirs.step()),
    }
    if baseline_text is not None:
        baseline = Trainer(config.loads(baseline_text), mesh, device)
        runners["ours_1f1b"] = lambda: losses["ours_1f1b"].append(baseline.train_step()["loss"])
    result = interleaved_tokens_per_s(
        runners, steps=steps, tokens_per_step=t.global_batch * t.seq_len)
    return {"tokens_per_s": result, "first_loss": {k: v[0] for k, v in losses.items() if v},
            "microbatches": ours.accum}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2, help="pipeline stages (parallel.pp)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each pipeline")
    parser.add_argument("--schedule", choices=("1f1b", "zb-h1", *V_SHAPED), default="1f1b")
    args, overrides = parser.parse_known_args()

    def load(schedule: str, run_dir: str) -> config.Config:
        cfg = config.load("default", ["--train.global_batch", "16", "--train.micro_batch", "2",
                                      "--train.progress", "false", "--train.run_dir", run_dir,
                                      "--parallel.pp", str(args.nproc), "--parallel.schedule",
                                      schedule, "--parallel.virtual_stages",
                                      "2" if schedule in V_SHAPED else "1", *overrides])
        cfg.validate(args.nproc)
        return cfg

    cfg = load(args.schedule, "runs/bench-pp")
    baseline = None if args.schedule == "1f1b" else \
        config.to_toml(load("1f1b", "runs/bench-pp-1f1b"))
    # the worker by its module's name: the ranks cannot unpickle a function of __main__
    from pp_vs_torch_pipelining import worker as entry

    results = launch_local(args.nproc, entry, config.to_toml(cfg), args.steps, baseline)
    place = placement(args.schedule, args.nproc, cfg.parallel.virtual_stages)
    last = results[place.where(place.last)[0]]  # the last stage ends each step: its timing
    tokens, first = last["tokens_per_s"], last["first_loss"]
    ratio = tokens["ours"] / tokens["torch_pipelining"]
    same = abs(first["ours"] - first["torch_pipelining"]) <= 1e-5 * abs(first["ours"])
    print(f"first-step loss: ours {first['ours']:.6f}, torch {first['torch_pipelining']:.6f} "
          f"({'equal' if same else 'DIFFERENT'} at rtol 1e-5)")
    print(f"ours              {tokens['ours']:10.0f} tokens/s")
    print(f"torch pipelining  {tokens['torch_pipelining']:10.0f} tokens/s")
    extra = {}
    if baseline is not None:
        extra = {"ours_1f1b_tokens_per_s": round(tokens["ours_1f1b"]),
                 "ours_over_ours_1f1b": round(tokens["ours"] / tokens["ours_1f1b"], 3)}
        print(f"ours 1f1b         {tokens['ours_1f1b']:10.0f} tokens/s "
              f"(ours {args.schedule} / ours 1f1b {extra['ours_over_ours_1f1b']:.3f})")
    print(json.dumps({"schedule": args.schedule, "pp": args.nproc,
                      "microbatches": last["microbatches"], **extra,
                      "ours_tokens_per_s": round(tokens["ours"]),
                      "torch_pipelining_tokens_per_s": round(tokens["torch_pipelining"]),
                      "ratio": round(ratio, 3), "first_loss_ours": round(first["ours"], 6),
                      "first_loss_torch": round(first["torch_pipelining"], 6),
                      "first_loss_equal": same}))


if __name__ == "__main__":
    main()
