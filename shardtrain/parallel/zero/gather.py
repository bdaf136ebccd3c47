"""ZeRO-3's parameter life cycle: gathered just before a unit computes, freed right after.

At rest each unit keeps only its shard; its flat buffer's storage is resized to zero, and
the parameters stay views of that buffer (the trick of FSDP's FlatParameter, Zhao et al.
2023, sec. 3.2): re-growing the storage and all-gathering into it makes every parameter, and
every tensor autograd saved from it, valid again without touching the model.

Forward runs through a fixed sequence of events (embedding, block 0, ..., block L-1 with
the final norm, head), each a forward pre-hook: at event k its units must be ready, units not
needed by events k..k+prefetch are freed first, then the next `prefetch` events' units are
all-gathered asynchronously while event k computes (Rajbhandari et al. 2020, sec. 5.3; Ren
et al. 2021 call it prefetching). An event has one unit, except a block under expert
parallelism: its dense unit and its experts' unit (units.py), each gathered over its own
group, together, since the experts run inside the block. Backward visits the events in
reverse. Event k's backward starts when the gradient of its output arrives -- a tensor hook
on the input of event k + 1, or on the model's output for the last event -- and its units
are gathered there (they were freed after forward). The event before it is prefetched there
too, or, for an event with a midpoint (a transformer block: its MLP, which backward visits
first), once the gradient has passed the midpoint: a block's backward is most of the step's
activation peak, and its MLP half then runs without the next unit's buffer (nor the
collective filling it) alive, while its attention half still hides the gather. The engine
frees a unit once its gradients are complete and reduce-scattered; a tied token table's
unit, whose gradient completes only with the embedding's backward (the last), is freed
once the head's backward is done. A unit whose backward reads no parameter values (the
embedding's lookup tables: cost/units.py `backward_reads_params`) is not gathered for
backward at all; FSDP2 gathers every unit again, the vocabulary-sized table too. Under activation
checkpointing the recompute happens inside the block's backward, after its backward event,
so it finds the units gathered. Every rank of a group issues the same gathers in the same
order: the events are the same.

ZeRO-Infinity (`fetch_from`; offload.py): with the parameter shards offloaded, a unit's
`shard` is a staging buffer with no storage at rest. `start` fills it from the offloaded
master (host memory or NVMe) right before the unit's all-gather, so it arrives as far ahead
of use as the gather is prefetched, and its storage goes as soon as the gather is done: on
the device, a unit's shard exists only while the unit is in flight.

Under pipeline parallelism (`StepGatherer`) a stage runs m forwards and m backwards per step,
interleaved by the schedule: a unit is gathered at the first forward of its stage in the
step that uses it, `prefetch` events ahead as without a pipeline, and kept until the
step's gradients are reduced (model.py, "With pipeline parallelism" in docs/zero.md says
why), as torchtitan's FSDP under pipelining keeps them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardtrain.comm import Handle
from shardtrain.cost.units import backward_reads_params
from shardtrain.parallel.zero.events import forward_events, stage_events
from shardtrain.parallel.zero.units import FlatUnit


class UnitGatherer:
    """Gather and free units' parameters, each over its own group (`FlatUnit.comm`); every
    unit starts freed (its shard only)."""

    def __init__(self, units: list[FlatUnit]):
        self.units = units
        self.live: dict[FlatUnit, Handle | None] = {}  # gathered or gathering
        self.max_live = 0  # instrument: the most units held full at once
        # ZeRO-Infinity: source(unit, out) fills the unit's staging shard (fetch_from).
        self.source: Callable[[FlatUnit, torch.Tensor], None] | None = None
        for unit in units:
            self.free(unit)

    def fetch_from(self, source: Callable[[FlatUnit, torch.Tensor], None]) -> None:
        """The parameter shards live off the device (module docstring): every unit's
        `shard` becomes a fresh staging buffer [shard] without storage, which `source(unit,
        out)` fills before each gather (whatever storage the shard had is let go here)."""
        self.source = source
        for unit in self.units:
            unit.shard = unit.shard.new_empty(unit.shard_numel)
            unit.shard.untyped_storage().resize_(0)

    # ------------------------------------------------------------------ gather / free

    def start(self, unit: FlatUnit, phase: str) -> None:
        """Begin gathering `unit` (no-op if it is gathered or on its way, or for backward if
        its backward reads no parameter: cost/units.py `backward_reads_params`)."""
        if unit in self.live or phase == "backward" and not backward_reads_params(unit.key):
            return
        storage = unit.flat.untyped_storage()
        storage.resize_(unit.padded * unit.flat.element_size())
        if self.source is not None:  # staged from the offloaded master, just in time
            unit.shard.untyped_storage().resize_(unit.shard_numel * unit.shard.element_size())
            self.source(unit, unit.shard)
        self.live[unit] = unit.comm.gather_params(unit, unit.flat, unit.shard, phase=phase)
        self.max_live = max(self.max_live, len(self.live))

    def ready(self, unit: FlatUnit, phase: str) -> None:
        if phase == "backward" and not backward_reads_params(unit.key):
            return  # not gathered for backward (`start`)
        self.start(unit, phase)
        handle = self.live[unit]
        if handle is not None:
            handle.wait()
            self.live[unit] = None
            self._unstage(unit)

    def free(self, unit: FlatUnit) -> None:
        handle = self.live.pop(unit, None)
        if handle is not None:
            handle.wait()  # never free a buffer a collective still writes into
        unit.flat.untyped_storage().resize_(0)
        self._unstage(unit)

    def _unstage(self, unit: FlatUnit) -> None:
        """An offloaded unit's staging shard goes once its gather is done (it was read)."""
        if self.source is not None:
            unit.shard.untyped_storage().resize_(0)

    def free_all(self) -> None:
        for unit in list(self.live):
            self.free(unit)

    def backward_done(self, unit: FlatUnit) -> None:
        """`unit`'s gradients are complete (reducer.py): its parameters are not needed."""
        self.free(unit)


class StepGatherer(UnitGatherer):
    """ZeRO-3 under pipeline parallelism: each unit is gathered at the stage's first
    forward of the step that needs it, the next `prefetch` events' units (events.py, over
    the stage's chunks in order) gathered ahead while an event computes, as without a
    pipeline; they stay gathered through the step's micro-batches (later forwards find
    them so), freed by `free_all` once the step's gradients are reduced (model.py). A
    forward-only run (evaluation, under no_grad) frees them after the stage's last chunk.
    Every rank of a dp group runs the same stage: the same gathers, in order."""

    def __init__(self, units: list[FlatUnit], chunks: list[nn.Module], *, prefetch: int = 1):
        super().__init__(units)
        self.prefetch = prefetch
        events = stage_events(chunks, units)
        self.events = [event_units for _, event_units in events]
        for k, (module, _) in enumerate(events):
            module.register_forward_pre_hook(self._pre_forward_hook(k))
        chunks[-1].register_forward_hook(self._after_last_chunk)

    def _pre_forward_hook(self, k: int):
        def hook(module: nn.Module, args: tuple) -> None:
            for event_units in self.events[k:k + self.prefetch + 1]:
                for unit in event_units:  # a no-op once gathered
                    self.start(unit, "forward")
            for unit in self.events[k]:
                self.ready(unit, "forward")
        return hook

    def _after_last_chunk(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not torch.is_grad_enabled():
            self.free_all()


class ParamGatherer(UnitGatherer):
    def __init__(self, model: nn.Module, units: list[FlatUnit], *, prefetch: int,
                 events: list[tuple[nn.Module, list[FlatUnit]]],
                 midpoints: dict[int, nn.Module]):
        """`events`: (module whose forward pre-hook starts the event, units it computes
        with), in forward order; the first module is the model itself. `midpoints`: event
        index -> a module inside it whose input's gradient marks the middle of the event's
        backward, where the units before it are prefetched."""
        super().__init__(units)
        self.prefetch = prefetch
        self.events = [event_units for _, event_units in events]
        self.midpoints = set(midpoints)
        # The last event (the output head) starts backward holding its weight and that
        # weight's whole gradient, a vocabulary-sized pair: the next event's prefetch
        # waits until both are released (`backward_done`) rather than adding to them.
        self.deferred = len(self.events) - 1
        # A tied token table's unit computes in the first event (the embedding) and the
        # last (the head), and its gradient completes only at the end of backward
        # (zero/reducer.py): it is freed, and the deferred prefetch started, as soon as the
        # head's backward is done, not when it is reduced.
        self.shared = [u for u in self.events[self.deferred] if u in self.events[0]]
        # Events whose backward hook this forward placed: the head runs again for each
        # multi-token prediction depth (model/mtp.py), its backward start is its first call's.
        self.hooked: set[int] = set()
        for k, (module, _) in enumerate(events):
            module.register_forward_pre_hook(self._pre_forward_hook(k))
        for k, module in midpoints.items():
            module.register_forward_pre_hook(self._midpoint_hook(k))
        model.register_forward_hook(self._end_of_forward)

    @classmethod
    def for_model(cls, model: nn.Module, units: list[FlatUnit], *, prefetch: int
                  ) -> ParamGatherer:
        """The events of the whole transformer (events.py): the embedding's units, each
        block's, the head's; each block's midpoint is its MLP's norm."""
        events = forward_events(model, units)
        midpoints = {k: m.mlp_norm for k, (m, _) in enumerate(events) if hasattr(m, "mlp_norm")}
        return cls(model, units, prefetch=prefetch, events=events, midpoints=midpoints)

    # ------------------------------------------------------------------ hooks

    def _units(self, first: int, end: int) -> list[FlatUnit]:
        return [u for event_units in self.events[max(0, first):end] for u in event_units]

    def _pre_forward_hook(self, k: int):
        def hook(module: nn.Module, args: tuple) -> None:
            upcoming = self._units(k, k + self.prefetch + 1)
            for unit in list(self.live):
                if unit not in upcoming:
                    self.free(unit)
            for unit in upcoming:
                self.start(unit, "forward")
            for unit in self.events[k]:
                self.ready(unit, "forward")
            if k > 0 and torch.is_grad_enabled() and k not in self.hooked:
                self.hooked.add(k)
                _on_grad(args[0], lambda: self._pre_backward(k - 1))
        return hook

    def _end_of_forward(self, module: nn.Module, args: tuple, output) -> None:
        self.free_all()
        self.hooked.clear()
        if torch.is_grad_enabled():  # whichever logits' gradient comes first (MTP: a depth's)
            for logits in _logits(output):
                _on_grad(logits, lambda: self._pre_backward(len(self.events) - 1))

    def _midpoint_hook(self, k: int):
        # Kept out of a compiled block's graph: traced, its closure's event index k becomes a
        # guard, and the blocks, which share one graph, recompile block after block (under
        # full checkpointing the recompute reaches it once no gather is left in flight).
        @torch._dynamo.disable
        def hook(module: nn.Module, args: tuple) -> None:
            if torch.is_grad_enabled():
                _on_grad(args[0], lambda: self._prefetch_backward(k))
        return hook

    def _pre_backward(self, k: int) -> None:
        if k + 1 == self.deferred and self.shared:  # the head's backward is done
            for unit in self.shared:
                self.free(unit)
            self._prefetch_backward(self.deferred)
        for unit in self.events[k]:
            self.start(unit, "backward")
        if k not in self.midpoints and k != self.deferred:
            self._prefetch_backward(k)
        for unit in self.events[k]:
            self.ready(unit, "backward")

    def backward_done(self, unit: FlatUnit) -> None:
        super().backward_done(unit)
        if unit in self.events[self.deferred] and unit not in self.shared:
            self._prefetch_backward(self.deferred)

    def _prefetch_backward(self, k: int) -> None:
        """Start gathering the units of the `prefetch` events whose backward follows
        event k's."""
        for unit in reversed(self._units(k - self.prefetch, k)):
            self.start(unit, "backward")


def _logits(output) -> list[torch.Tensor]:
    """The model's output tensors: the logits, or an MTPOutput's main and depth logits."""
    return [output] if isinstance(output, torch.Tensor) else [output.logits, *output.depths]


def _on_grad(tensor: torch.Tensor, fn) -> None:
    """Call fn() when the gradient of `tensor` has been computed (before it flows on)."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        fn()
        return grad

    if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
        tensor.register_hook(hook)
