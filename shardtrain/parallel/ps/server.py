"""The server loop: receive pushes, apply updates with the optimizer on this server's shard,
reply with the new weights (Li et al. 2014; seed 001: W_new = W - lr dW for SGD).

The server posts, for every worker, the receives of its next push (one per partition of
this shard) up front, so every worker's transfers proceed at once (the incast of seed 001);
a push is complete when the worker's header arrives, and the server takes headers from any
worker in arrival order. Then, by mode:

- async: the worker's gradient is one optimizer step at once, and the reply goes back to
  that worker: it computes its next step on whatever version is current.
- ssp with staleness s (Ho et al. 2013): pushes are summed per clock (a worker's step
  count), and clock c's update -- the average of the N workers' gradients, one optimizer
  step -- is applied once all N pushed c, in clock order. A worker that pushed clock c gets
  its reply once the version (updates applied) is at least c + 1 - s: no worker starts a
  step more than s steps ahead of the slowest. s = 0 is sync.

Aggregating per clock (rather than applying each worker's gradient as it arrives, as in Ho et
al.'s additive SGD tables) makes ssp with s = 0 the same update as all-reduce data
parallelism under any optimizer (AdamW's moments see the averaged gradient). Clipping: sync
and ssp clip the averaged gradient by its global norm (the servers sum their squares);
async clips each worker's gradient by the norm the worker measured (sent in the header).

Each applied push is recorded (`records`): worker, clock, the version it computed on, the
version it was applied at; staleness = applied_at - computed_on.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from shardtrain.comm import Communicator
from shardtrain.config import OptimConfig
from shardtrain.parallel.ps.codec import PushCodec
from shardtrain.parallel.ps.layout import HEAD, INIT, PULL, STATE, PSLayout
from shardtrain.parallel.zero.optim import moment_names, update_shard


class ParameterServer:
    def __init__(self, comm: Communicator, servers: Communicator, layout: PSLayout, index: int,
                 params: list[torch.Tensor] | None, optim: OptimConfig, *, codec: PushCodec,
                 mode: str, staleness: int, priority: str, steps: int,
                 lr_of: Callable[[int], float], max_norm: float = float("inf"),
                 state_requests: int = 0, device: torch.device | None = None):
        """`comm`: the world (workers and servers); `servers`: the servers' group (clip
        norms); `params`: the model's initial parameters, or None (they come from a worker or a
        checkpoint); `steps`:
        the pushes each worker makes; `state_requests`: the checkpoints worker 0 will ask
        this server's state for (the loop serves them before it ends)."""
        self.comm, self.servers, self.layout, self.index = comm, servers, layout, index
        self.codec, self.optim, self.steps, self.lr_of = codec, optim, steps, lr_of
        self.mode, self.s = mode, (0 if mode == "sync" else staleness)
        self.max_norm, self.state_requests = max_norm, state_requests
        self.parts = layout.on_server(index)
        # Updated in priority order (earliest layers first) or in the order backward
        # produced them (last layers first: FIFO, the order without a scheduler).
        if priority == "none":
            self.parts = self.parts[::-1]
        self.device = device or (params[0].device if params else torch.device("cpu"))
        # fp32 [numel] each: the given starting weights, or zeros until `receive_weights`
        # or `load_state` fills them.
        self.master = [params[p.param].detach().reshape(-1)[p.lo:p.hi].float().clone()
                       if params is not None else torch.zeros(p.numel, device=device)
                       for p in self.parts]
        names = moment_names(optim)
        self.moments = [[torch.zeros_like(m) for _ in names] for m in self.master]
        self.version = 0  # updates applied in this run (the clocks of sync and ssp)
        self.base = 0  # updates applied before it (a resumed run): Adam's step count goes on
        self.records: list[dict] = []
        self._sends: list = []

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        """Serve until every worker made its `steps` pushes (and got their replies)."""
        n = self.layout.workers
        pushed = [0] * n
        posted = {w: self._post(w) for w in range(n)}
        clocks: dict[int, dict[int, tuple]] = {}  # clock -> worker -> (grads, computed_on, t)
        waiting: list[tuple[int, int]] = []  # (worker, clock) whose reply is due later
        head = torch.zeros(3, dtype=torch.float64, device=self.device)
        served = 0
        while sum(pushed) < n * self.steps or served < self.state_requests:
            w = self.comm.irecv(head, None, tag=HEAD).wait()
            clock, computed_on, norm = int(head[0]), int(head[1]), float(head[2])
            if clock < 0:  # a checkpoint: worker w wants this server's state
                self.comm.isend(self.state_tensor(), w, tag=STATE).wait()
                served += 1
                continue
            grads = self._receive(posted.pop(w))
            pushed[w] += 1
            if pushed[w] < self.steps:
                posted[w] = self._post(w)
            arrived = time.perf_counter()
            if self.mode == "async":
                coef = self._coef(torch.tensor(norm * norm, dtype=torch.float64,
                                                device=self.device))
                self._apply(grads, coef, self.lr_of(clock), [(w, clock, computed_on, arrived)],
                            reply=[w])
                continue
            clocks.setdefault(clock, {})[w] = (grads, computed_on, arrived)
            waiting.append((w, clock))
            while len(clocks.get(self.version, ())) == n:
                self._apply_clock(clocks.pop(self.version), waiting)
            self._reply([w for w, c in self._due(waiting, self.version)])
        for work in self._sends:
            work.wait()
        self._sends.clear()

    def _due(self, waiting: list[tuple[int, int]], version: int) -> list[tuple[int, int]]:
        """Remove and return the waiting replies that `version` releases."""
        due = [(w, c) for w, c in waiting if version >= c + 1 - self.s]
        waiting[:] = [x for x in waiting if x not in due]
        return due

    def _apply_clock(self, pushes: dict[int, tuple], waiting: list[tuple[int, int]]) -> None:
        """Clock `version`'s update: the average of the workers' gradients, summed in worker
        order (deterministic); replies released by it go out partition by partition."""
        clock = self.version
        workers = sorted(pushes)
        grads = [torch.stack([pushes[w][0][k] for w in workers]).sum(0) / len(workers)
                 for k in range(len(self.parts))]
        sq = sum((g.double().square().sum() for g in grads),
                 torch.zeros((), dtype=torch.float64, device=self.device))
        due = [w for w, _ in self._due(waiting, clock + 1)]
        self._apply(grads, self._coef(sq), self.lr_of(clock),
                    [(w, clock, pushes[w][1], pushes[w][2]) for w in workers], reply=due)

    def _coef(self, sq: torch.Tensor) -> float:
        """The clip coefficient of a gradient whose squared norm on this shard is `sq`
        (sync/ssp: summed over the servers; async: the worker's own, already global)."""
        if self.mode != "async":
            sq = sq.to(self.device, torch.float32)
            self.servers.all_reduce(sq, "sum", tag="ps:grad_norm")
        if self.max_norm == float("inf"):
            return 1.0
        total = sq.float().sqrt()
        return float((self.max_norm / (total + 1e-6)).clamp(max=1.0))

    @torch.no_grad()
    def _apply(self, grads: list[torch.Tensor], coef: float, lr: float,
               pushes: list[tuple[int, int, int, float]], reply: list[int]) -> None:
        """One optimizer step of every partition, in priority order, each sent to `reply`
        as soon as it is updated."""
        for w, clock, computed_on, arrived in pushes:
            self.records.append({"worker": w, "clock": clock, "computed_on": computed_on,
                                 "applied_at": self.version,
                                 "staleness": self.version - computed_on, "arrived": arrived})
        self.version += 1
        for k, part in enumerate(self.parts):
            grad = grads[k] * coef if coef != 1.0 else grads[k]
            update_shard(self.master[k], self.moments[k], grad,
                         [(0, part.numel)] if part.decay else [], lr, self.base + self.version,
                         self.optim)
            self._send_part(k, reply)

    def _reply(self, workers: list[int]) -> None:
        for k in range(len(self.parts)):
            self._send_part(k, workers)

    def _send_part(self, k: int, workers: list[int]) -> None:
        if not workers:
            return
        part = self.parts[k]
        ident = torch.tensor([part.index, self.version], dtype=torch.int64, device=self.device)
        weights = self.master[k].clone()  # the master changes at the next update
        for w in workers:
            self._sends.append(self.comm.isend(ident, w, tag=PULL))
            self._sends.append(self.comm.isend(weights, w, tag=self.layout.pull_tag[part.index]))
        self._sends = [s for s in self._sends if not s.done()]

    def _post(self, w: int) -> list[tuple]:
        """Post the receives of worker w's next push."""
        out = []
        for k, part in enumerate(self.parts):
            buf = self.codec.empty(part.index, self.device)
            out.append((part.index, buf, self.comm.irecv(
                buf, w, tag=self.layout.push_tag[part.index])))
        return out

    def _receive(self, posted: list[tuple]) -> list[torch.Tensor]:
        grads = []
        for j, buf, work in posted:
            work.wait()
            grads.append(self.codec.decode(j, buf))
        return grads

    # ------------------------------------------------------------------ state

    @torch.no_grad()
    def receive_weights(self, src: int) -> None:
        """The starting weights of this shard, from worker `src` (PSWorker.send_weights)."""
        order = sorted(range(len(self.parts)), key=lambda k: self.parts[k].index)
        flat = torch.empty(sum(self.parts[k].numel for k in order), device=self.device)
        self.comm.irecv(flat, src, tag=INIT).wait()
        offset = 0
        for k in order:
            self.master[k].copy_(flat[offset:offset + self.parts[k].numel])
            offset += self.parts[k].numel

    def state_tensor(self) -> torch.Tensor:
        """[version, then per partition in index order: master, moments...] fp32, the
        message a checkpoint carries (`unpack_state` reads it)."""
        order = sorted(range(len(self.parts)), key=lambda k: self.parts[k].index)
        pieces = [torch.tensor([float(self.base + self.version)], device=self.device)]
        for k in order:
            pieces += [self.master[k], *self.moments[k]]
        return torch.cat(pieces)

    @torch.no_grad()
    def load_state(self, saved: list[dict]) -> None:
        """Resume from the state files of any number of servers (`unpack_state`'s dicts):
        each partition copies the ranges of its parameter that the files hold, so the
        server count and partition size may change between runs."""
        names = ("master", *moment_names(self.optim))
        self.base, self.version = saved[0]["version"], 0
        for part, master, moments in zip(self.parts, self.master, self.moments):
            for state in saved:
                for (param, lo, hi), tensors in state["parts"].items():
                    a, b = max(lo, part.lo), min(hi, part.hi)
                    if param != part.param or a >= b:
                        continue
                    for name, t in zip(names, (master, *moments)):
                        t[a - part.lo:b - part.lo] = tensors[name][a - lo:b - lo]


def unpack_state(flat: torch.Tensor, layout: PSLayout, server: int, optim: OptimConfig) -> dict:
    """A server's state message -> {"version", "parts": {(param, lo, hi): {name: [n]}}}."""
    names = ("master", *moment_names(optim))
    out, offset = {"version": int(flat[0]), "parts": {}}, 1
    for part in layout.on_server(server):
        entry = {}
        for name in names:
            entry[name] = flat[offset:offset + part.numel].clone()
            offset += part.numel
        out["parts"][(part.param, part.lo, part.hi)] = entry
    return out


def state_numel(layout: PSLayout, server: int, optim: OptimConfig) -> int:
    return 1 + (1 + len(moment_names(optim))) * sum(p.numel for p in layout.on_server(server))
