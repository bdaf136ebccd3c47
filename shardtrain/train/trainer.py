"""The training loop: one code path for one process or many.

Each optimizer step processes `train.global_batch` sequences: this rank's share, cut into
micro-batches that `Parallelized.forward_backward` runs through the pipeline schedule (one
stage without pipeline parallelism), gradients accumulated (the loss of each micro-batch
divided by their number) with gradient communication only after the last; then clipping,
the optimizer step, metrics (read from the device on logged steps only: train/pending.py),
periodic eval and checkpoints.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from shardtrain import config as config_mod
from shardtrain.config import Config
from shardtrain.config.ps import parse_slow_ranks
from shardtrain.config.replicas import data_parallel
from shardtrain.data import check_vocab, eval_batches, load_dataset, make_sampler
from shardtrain.data.fsutil import write_atomic
from shardtrain.mesh import ParallelMesh
from shardtrain.parallel.parallelize import parallelize
from shardtrain.cost.counts import model_flops_per_token
from shardtrain.ckpt.files import Reader
from shardtrain.train.checkpoint import checkpoint as ckpt
from shardtrain.train.checkpoint.agree import Agreement
from shardtrain.train.guard import BadStepGuard, hang_here, kill_here, nan_loss
from shardtrain.train.finetune.finetune import build_skeleton, nf4_bytes, resolve_init_from, start_values
from shardtrain.train.observe.profile import StepProfiler
from shardtrain.train.observe.tracking import open_trackers
from shardtrain.train.checkpoint.interrupt import Interrupt
from shardtrain.train.observe.records import format_record
from shardtrain.train.observe.metrics import (MetricsWriter, device_peak_flops, moe_totals, step_fields,
                                      peak_memory, reset_peak_memory)
from shardtrain.train.optim import build_optimizer, lr_at
from shardtrain.train.pace import Pace, busy_seconds
from shardtrain.train.replicas import TrainReplicas
from shardtrain.train.pending import PendingRecords, StepTimer
from shardtrain.train.start.device import device_defaults
from shardtrain.train.finetune.sample import end_export, end_sample
from shardtrain.train.checkpoint.saver import Saver
from shardtrain.train.observe.straggler import slow_down


@dataclass
class TrainResult:
    history: list[dict[str, Any]] = field(default_factory=list)  # one record per step run
    eval_loss: float | None = None
    sample: str | None = None
    interrupted: str | None = None  # the line to print when a signal stopped the run

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.history]


class Trainer:
    def __init__(self, cfg: Config, mesh: ParallelMesh, device: torch.device):
        self.cfg, self.mesh, self.device = cfg, mesh, device
        t = cfg.train
        self.is_main = mesh.rank == 0
        self.dp = mesh.comm("dp")
        resolve_init_from(cfg)  # model.init_from: the shape from its config.json (idempotent)
        dp = data_parallel(cfg, self.dp.size)  # over every replica group
        cfg.resolve_microbatches(dp)  # a no-op on a validated config
        device_defaults(cfg, device.type)  # train.precision=auto; TF32 (idempotent)
        self.data = load_dataset(cfg.data, seq_len=t.seq_len)
        check_vocab(self.data, cfg.model.vocab_size)
        self.model = build_skeleton(cfg)  # shapes only (LoRA applied): parallelize materialises
        before = reset_peak_memory(device)  # the build's own peak (parallel/build.py)
        make = lambda m: build_optimizer(m, cfg.optim, t.lr, t.seed)  # noqa: E731
        self.parallel = parallelize(self.model, mesh, cfg, device=device, make_optimizer=make,
                                    values=lambda shards: start_values(cfg, shards))
        self.build_memory = {"build_base_bytes": before,
                             "build_peak_bytes": peak_memory(device)["peak_mem_bytes"]}
        slow_down(self.parallel.module, parse_slow_ranks(t.slow_ranks).get(mesh.rank, 1.0))
        self.accum = t.accumulation_steps(dp)
        self.sampler = make_sampler(cfg.data, self.data, seq_len=t.seq_len,
                                    global_batch=t.global_batch, micro_batch=t.micro_batch,
                                    dp_rank=self.dp.rank, dp_size=self.dp.size, seed=t.seed,
                                    groups=cfg.parallel.replicas)
        self.replicas = TrainReplicas(cfg, mesh, self.parallel, self.sampler)  # before resume
        if self.is_main and (mix := self.sampler.describe(self.data.names, t.steps)):
            print(mix, flush=True)  # a data.sources mixture as it will be sampled
        if self.is_main and self.data.summary:
            print(self.data.summary, flush=True)  # chat: conversations, rows, counted share
        self.step = 0
        self.resume_bytes: dict[str, int] = {}
        job = Agreement("resume", mesh.rank, mesh.world_size + cfg.parallel.ps_servers)
        resume = ckpt.resolve_resume(cfg, main=self.is_main, agreement=job)  # servers too
        if resume is not None:
            ckpt.check_compatible(resume, cfg, mesh.world_size)
            meta = ckpt.read_meta(resume)
            reader = Reader(resume)
            self.parallel.load_state(reader)  # from any layout (parallel/pieces.py)
            # what this rank read of the checkpoint (its files; the values of the chunks
            # read), against what it needed of it
            self.resume_bytes = {"read": reader.bytes_read, "values": reader.values_read,
                                 "needed": reader.bytes_needed}
            self.parallel.load_optimizer_files(lambda name: ckpt.load_state(resume, name))
            self.step = meta["step"]
            self.sampler.load_state_dict(meta["sampler"])
        self.replicas.attach(self)  # what a rejoining group receives from a live peer
        self.tokens_per_step = t.global_batch * t.seq_len
        self.flops_per_step = model_flops_per_token(cfg.model, t.seq_len) * self.tokens_per_step
        self.peak_flops = device_peak_flops(device, t.peak_flops, t.precision)  # None: unknown
        self.saver = Saver(cfg, mesh, resumed=resume)  # knows the run's last checkpoint
        self.guard = BadStepGuard(t.max_bad_steps, t.precision,  # (no cycle through self)
                                  last_good=lambda saver=self.saver: saver.committed)
        self.pace = Pace(cfg, mesh)  # compute and wait per rank, stragglers named (pace.py)
        self.metrics = MetricsWriter(t.run_dir, enabled=self.is_main,
                                     **self.replicas.kept_records(resume is not None, self.step),
                                     trackers=open_trackers(cfg) if self.is_main else ())
        self.profiler = StepProfiler(t, mesh.rank, device)  # train.profile_steps (profile.py)
        self.timer = StepTimer(device)
        self.pending = PendingRecords(self.timer)  # records not read yet (pending.py)

    # ------------------------------------------------------------------ one step

    def train_step(self) -> dict[str, Any]:
        """One optimizer step and its record, read now (a host sync; `run` reads logged ones)."""
        self.advance()
        return self.pending.flush()[-1]

    def advance(self) -> dict[str, Any]:
        """One optimizer step. Its record's device values (loss, gradient norm, MoE totals)
        and times wait in `pending` until a flush fills them in; the step's one read is
        the skip decision (parallel/precision.py, train/syncs.py)."""
        t, o = self.cfg.train, self.cfg.optim
        self.replicas.begin(self)  # the quorum; torchft may load a peer's state (the step)
        lr = lr_at(self.step, base_lr=t.lr, warmup=o.warmup_steps, total=t.steps,
                   min_ratio=o.min_lr_ratio)
        start = self.timer.mark()
        hang_here(t.inject_hang, self.mesh.rank, self.step + 1)  # test hooks (guard.py)
        self.parallel.zero_grad()
        with nan_loss(self.parallel.module, t.inject_nan, self.mesh.rank, self.step + 1):
            micro_batches = self.sampler.next_step()
            # The loss is the mean over the global batch's counted targets (chat: the
            # assistant's tokens), a count every rank's sampler knows (data/sampler.py).
            mean_loss = self.parallel.forward_backward(micro_batches, self.sampler.loss_tokens)
        mean_loss, *mtp = mean_loss if mean_loss.dim() else [mean_loss]  # MTP: main, depths
        grad_norm = self.parallel.clip_grad_norm(o.grad_clip or float("inf"))
        applied = self.replicas.commit()  # False: a group failed inside the step
        if applied:
            self.parallel.step(lr)  # not applied if the loss or gradients were not finite
        end = self.timer.mark()
        self.step += applied
        moe = [moe_totals(self.parallel.module, self.cfg.model, self.mesh, self.device)] \
            if self.cfg.model.n_experts else []
        compute = busy_seconds(self.parallel.timeline)  # after the decision: marks passed
        comm = self.mesh.ledger.totals(self.mesh.ledger.mark())
        record = {
            "step": self.step, "loss": None, "lr": lr, "grad_norm": None,
            "tokens": self.step * self.tokens_per_step, "loss_tokens": self.sampler.loss_tokens,
            "tokens_per_s": None, "step_time_s": None, "mfu": None, "loss_scale": self.parallel.loss_scale,
            "skipped": self.parallel.skipped, "bad_step": self.parallel.bad,
            "comm_bytes": comm["sent_bytes"], "comm_calls": comm["calls"],
            **self.memory_ledger(), **self.replicas.record(applied),
        }

        def finish(record: dict[str, Any], read: list[float], elapsed: float) -> None:
            record["loss"], record["grad_norm"] = read[0], read[1]
            record["tokens_per_s"] = self.tokens_per_step / elapsed
            record["step_time_s"] = elapsed
            record["mfu"] = None if self.peak_flops is None else \
                self.flops_per_step / (elapsed * self.mesh.world_size * self.peak_flops)
            record.update(step_fields(read[2:], self.cfg.model))  # MTP's, MoE's
            record.update(self.pace.measure(record["step"], elapsed, compute))  # logged: gathers

        self.pending.add(record, [mean_loss, grad_norm, *mtp, *moe], start, end, finish)
        return record

    @torch.no_grad()
    def evaluate(self, n_batches: int = 0) -> float:
        """Mean token loss over `n_batches` held-out batches (0: train.eval_batches), split
        across data-parallel ranks; each batch weighs its share of counted targets, so chat
        data averages over the assistant's tokens."""
        t = self.cfg.train
        batches = eval_batches(self.data.eval, seq_len=t.seq_len, batch_size=t.micro_batch,
                               n_batches=n_batches or t.eval_batches,
                               eos_id=self.data.document_eos)
        totals = torch.zeros(2, device=self.device)  # [weighted loss sum, weight sum]
        # Every dp rank runs as many forwards (ZeRO-3's forward gathers parameters
        # collectively): a rank out of batches repeats the first one and counts it 0 times.
        mine = batches[self.dp.rank::self.dp.size]
        with self.parallel.evaluating():
            for i in range(-(-len(batches) // self.dp.size)):
                loss, weight = self.parallel.forward_loss(mine[i] if i < len(mine)
                                                          else batches[0])
                count = torch.full((), weight * (i < len(mine)), device=self.device)
                totals += torch.stack([loss * count, count])
        # Over dp x cp under context parallelism: each cp rank's loss covers its slice.
        self.mesh.comm(self.mesh.replica_dim).all_reduce(totals, "sum", tag="metric")
        self.replicas.metric_sum(totals)  # and over the live replica groups
        return (totals[0] / totals[1]).item()

    # ------------------------------------------------------------------ the run

    def run(self, interrupt: Interrupt | None = None) -> TrainResult:
        """Train to train.steps; SIGINT or SIGTERM (`interrupt`) stop it at an agreed, saved step."""
        t = self.cfg.train
        result = TrainResult()
        if self.is_main:
            write_atomic(Path(t.run_dir) / "config.toml", config_mod.to_toml(self.cfg))
        bar = tqdm(total=t.steps, initial=self.step, disable=not (self.is_main and t.progress),
                   unit="step", dynamic_ncols=True)
        while self.step < t.steps:
            with self.profiler.step(self.step + 1):
                record = self.advance()
            result.history.append(record)  # filled in by the flush that reads it
            final = self.step == t.steps
            evaluated = bool(t.eval_every and self.step % t.eval_every == 0) or final
            every = self.cfg.checkpoint.every
            saved = bool(every and self.step % every == 0) or final
            # The same steps on every rank (the pace gather is a collective).
            logged = self.step % t.log_every == 0 or evaluated or saved or record["bad_step"]
            read = self.pending.flush() if logged else []
            if evaluated:
                record["eval_loss"] = result.eval_loss = self.evaluate()
                # Perplexity: exp of the mean per-token loss (capped: exp overflows past ~709).
                record["eval_perplexity"] = math.exp(min(record["eval_loss"], 700.0))
            self.metrics.write(*read)
            self.guard.check(record)  # too many non-finite steps: stop, naming the checkpoint
            if saved:
                self.save()
            if interrupt is not None and not final and interrupt.stop_after(self.step):
                self.metrics.write(*self.pending.flush())
                if not saved:
                    self.save()
                self.saver.wait()
                self.metrics.close()
                bar.close()
                result.interrupted = interrupt.describe(self.step, str(self.saver.committed))
                return result
            kill_here(t.inject_kill, self.mesh.rank, self.step)  # a test hook (guard.py)
            bar.update(1)
            if logged:
                bar.set_postfix(loss=f"{record['loss']:.3f}",
                                tok_s=f"{record['tokens_per_s']:.0f}")
            if self.is_main and (self.step % t.log_every == 0 or final or "eval_loss" in record
                                 or record["bad_step"]):
                if not t.progress:
                    print(format_record(record), flush=True)
                elif "eval_loss" in record:
                    bar.write(format_record(record))
        bar.close()
        self.saver.wait()  # an asynchronous save still writing
        self.metrics.close()
        self.profiler.close()
        # Each rank's own memory ledger (metrics.jsonl carries rank 0's).
        ledger = self.memory_ledger()
        write_atomic(Path(t.run_dir) / f"memory_rank{self.mesh.rank}.json",
                     json.dumps(ledger, indent=1))
        self.write_timeline()
        if t.sample_tokens:
            result.sample = self.sample(t.sample_prompt, t.sample_tokens)
        if t.export_hf:
            end_export(self, t.export_hf)
        return result

    def write_timeline(self) -> Path | None:
        """This rank's timeline of the last training step (the executor's actions with
        their start and end; format in parallel/pipeline/executor.py) as
        <run_dir>/timeline_rank{R}.json; None before the first step."""
        timeline = self.parallel.timeline
        if timeline is None:
            return None
        path = Path(self.cfg.train.run_dir) / f"timeline_rank{self.mesh.rank}.json"
        write_atomic(path, json.dumps({**timeline, "step": self.step}))
        return path

    def save(self) -> None:
        """Checkpoint this step (train/checkpoint/saver.py: sharded, synchronous or not)."""
        p = self.cfg.parallel
        self.saver.save(self.step, self.parallel, sampler_state=self.sampler.state_dict(),
                        layout={"zero": p.zero, "pp": p.pp, "tp": p.tp, "cp": p.cp, "ep": p.ep,
                                "dp": data_parallel(self.cfg, self.dp.size),
                                "replicas": p.replicas, "ps_servers": p.ps_servers},
                        tokenizer_file=getattr(self.data.tokenizer, "path", None))

    def memory_ledger(self) -> dict[str, int]:
        """This rank's model-state bytes, peak memory, QLoRA's NF4 and activation offload's."""
        return {**self.parallel.memory(), **peak_memory(self.device), **self.build_memory,
                **self.parallel.activation_ledger(),
                "nf4_base_bytes": nf4_bytes(self.parallel.module)}

    def sample(self, prompt: str, n_tokens: int) -> str | None:
        """Generated text on rank 0 (None elsewhere), through the parallel model or from the
        final checkpoint: never a gathered model (train/finetune/sample.py). Every rank calls it."""
        return end_sample(self, prompt, n_tokens)

