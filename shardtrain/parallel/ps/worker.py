"""The worker side of a parameter server: push gradients as backward produces them, pull
the new weights as the next forward needs them.

Push (wait-free back-propagation, Zhang et al. 2017): a post-accumulate-grad hook counts
each partition's parameters on the step's last backward; once a partition's gradient is
complete it is copied to host memory (on a GPU asynchronously, into a pinned buffer) and
queued; it is encoded (codec.py) when its push starts. At most `credit` pushes are in
flight; the queue hands out the earliest layers first (`priority=layer`, ByteScheduler,
Peng et al. 2019) or in the order backward produced them (`none`: FIFO, last layers first).
When backward is done the rest drains and a header closes the push: [clock, version
computed on, the local gradient norm].

Pull: the receives of every partition are posted into the parameters themselves (a
partition is a contiguous slice of one parameter; on a GPU into host buffers copied in on
arrival: the parameter server's traffic is a deliberate CPU side channel over Gloo, see
groups.py), and a thread takes the servers' replies
in the order they arrive (each announced by a [partition, version] message), stamping the
arrival time and releasing the partition. Forward pre-hooks make each module wait only for
its own partitions, so the next forward runs on the first layers while later ones still
arrive. `timeline` holds each step's arrivals: [(partition, seconds since the push ended)].
"""

from __future__ import annotations

import heapq
import threading
import time
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

from shardtrain.comm import Communicator
from shardtrain.comm.threads import device_thread
from shardtrain.parallel.ps.codec import PushCodec
from shardtrain.parallel.ps.layout import HEAD, INIT, PULL, PSLayout

WIRE = torch.device("cpu")  # where pushed and pulled bytes live (groups.py: Gloo)


class PSWorker:
    def __init__(self, module: nn.Module, comm: Communicator, layout: PSLayout, *,
                 codec: PushCodec, priority: str = "layer", credit: int = 4):
        self.module, self.comm, self.layout, self.codec = module, comm, layout, codec
        self.priority, self.credit = priority, max(1, credit)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._parts_of: dict[nn.Parameter, list[int]] = {p: [] for p in self.params}
        for part in layout.parts:
            self._parts_of[self.params[part.param]].append(part.index)
        self._ready = [threading.Event() for _ in layout.parts]
        for e in self._ready:
            e.set()  # version 0: every rank built the same initial weights
        self.clock = 0  # pushes made
        self.last_norm = 0.0  # this worker's gradient norm at its last push
        self.version = 0  # the server version of the weights held
        self.timeline: list[list[tuple[int, float]]] = []
        self._sync = True
        # (key, partition, (gradient in host memory, the event its copy completes: _to_wire))
        self._queue: list[tuple[int, int, tuple]] = []
        self._host: dict[int, torch.Tensor] = {}  # on a GPU: pinned buffers per partition
        self._in_flight: list = []
        self._pushed: set[int] = set()
        self._seq = 0
        self._puller: threading.Thread | None = None
        self._error: BaseException | None = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        for mod in module.modules():
            own = [p for p in mod.parameters(recurse=False) if p in self._parts_of]
            if own:
                parts = [j for p in own for j in self._parts_of[p]]
                self._hooks.append(mod.register_forward_pre_hook(
                    lambda _m, _a, parts=parts: self.wait_parts(parts)))
        self._pending = {}
        self._reset_pending()

    # ------------------------------------------------------------------ push

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally: nothing is pushed inside this context."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _reset_pending(self) -> None:
        self._pending = {j: 0 for j in range(len(self.layout.parts))}
        for parts in self._parts_of.values():
            for j in parts:
                self._pending[j] += 1

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._sync:
            return
        for j in self._parts_of[param]:
            self._pending[j] -= 1
            if self._pending[j] == 0:
                self._enqueue(j)
        self._pump()

    def _enqueue(self, j: int) -> None:
        part = self.layout.parts[j]
        grad = self.params[part.param].grad
        wire = self._to_wire(j, grad.reshape(-1)[part.lo:part.hi]) if grad is not None else \
            (torch.zeros(part.numel, device=WIRE), None)
        key = j if self.priority == "layer" else self._seq
        self._seq += 1
        heapq.heappush(self._queue, (key, j, wire))
        self._pushed.add(j)

    def _to_wire(self, j: int, grad: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Partition j's gradient [n] in host memory, and the event the host waits on before
        it reads the bytes. On CPU the view itself (the codec copies it when the push
        starts: the gradient is final once its hook ran); on a GPU an asynchronous copy
        into the partition's pinned host buffer, so backward never waits for it."""
        if grad.device == WIRE:
            return grad, None
        buf = self._host.get(j)
        if buf is None or buf.dtype != grad.dtype:
            buf = self._host[j] = torch.empty(grad.numel(), dtype=grad.dtype, device=WIRE,
                                              pin_memory=True)
        buf.copy_(grad, non_blocking=True)  # reused: the last step's push encoded it
        copied = torch.cuda.Event()
        copied.record()
        return buf, copied

    def _pump(self) -> None:
        """Retire completed pushes; start queued ones while credit remains."""
        self._in_flight = [w for w in self._in_flight if not w.done()]
        while self._queue and len(self._in_flight) < self.credit:
            _, j, (flat, copied) = heapq.heappop(self._queue)
            if copied is not None:
                copied.synchronize()  # the codec and Gloo read the bytes on the host
            payload = self.codec.encode(j, flat)
            dst = self.layout.server_rank(self.layout.parts[j].server)
            self._in_flight.append(self.comm.isend(payload, dst, tag=self.layout.push_tag[j]))

    def finish(self) -> None:
        """After the step's last backward: push what is left (partitions of parameters
        that got no gradient push zeros), close the push with its header, post the pulls."""
        for j in range(len(self.layout.parts)):
            if j not in self._pushed:
                self._enqueue(j)
        while self._queue or self._in_flight:
            if len(self._in_flight) >= self.credit or not self._queue:
                self._in_flight.pop(0).wait()
            self._pump()
        self._pushed.clear()
        self._reset_pending()
        norm = self.last_norm = self.local_grad_norm()
        head = torch.tensor([self.clock, self.version, norm], dtype=torch.float64,
                            device=WIRE)
        for work in [self.comm.isend(head, self.layout.server_rank(s), tag=HEAD)
                     for s in range(self.layout.servers)]:
            work.wait()
        self.clock += 1
        self._start_pull()

    @torch.no_grad()
    def local_grad_norm(self) -> float:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return 0.0
        return float(torch.stack(torch._foreach_norm(grads)).float().square().sum().sqrt())

    # ------------------------------------------------------------------ pull

    def _start_pull(self) -> None:
        works = {}
        for part in self.layout.parts:
            self._ready[part.index].clear()
            flat = self.params[part.param].data.view(-1)[part.lo:part.hi]
            buf = flat if flat.device == WIRE else torch.empty(part.numel, device=WIRE)
            works[part.index] = (self.comm.irecv(buf, self.layout.server_rank(part.server),
                                                 tag=self.layout.pull_tag[part.index]), buf, flat)
        arrivals: list[tuple[int, float]] = []
        self.timeline.append(arrivals)
        # Its copies reach the parameters' GPU, the one current here (comm/threads.py).
        self._puller = device_thread(partial(self._pull, works, arrivals), name="ps-pull")
        self._puller.start()

    def _pull(self, works: dict, arrivals: list[tuple[int, float]]) -> None:
        start = time.perf_counter()
        ident = torch.zeros(2, dtype=torch.int64, device=WIRE)
        try:
            for _ in range(len(works)):
                self.comm.irecv(ident, None, tag=PULL).wait()
                j, version = int(ident[0]), int(ident[1])
                work, buf, param = works[j]
                work.wait()
                if buf is not param:
                    param.copy_(buf)
                arrivals.append((j, time.perf_counter() - start))
                self.version = version
                self._ready[j].set()
        except BaseException as e:  # raised again by the forward that waits
            self._error = e
            for e in self._ready:
                e.set()

    def wait_parts(self, parts: list[int]) -> None:
        for j in parts:
            self._ready[j].wait()
        if self._error is not None:
            raise self._error

    def settle(self) -> None:
        """Wait for every pulled partition (the full current weights are then held)."""
        self.wait_parts(list(range(len(self.layout.parts))))
        if self._puller is not None:
            self._puller.join()
            self._puller = None

    @torch.no_grad()
    def send_weights(self) -> None:
        """Give every server the starting weights of its shard (worker 0, before step 1)."""
        for s in range(self.layout.servers):
            flat = torch.cat([self.params[p.param].detach().reshape(-1)[p.lo:p.hi].float()
                              for p in self.layout.on_server(s)]).to(WIRE)
            self.comm.isend(flat, self.layout.server_rank(s), tag=INIT).wait()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
