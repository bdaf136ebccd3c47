"""Compiled transformer blocks (train.compile): each block's forward through torch.compile.

Per block, as torchtitan compiles its Llama (one graph per block, not the whole model): the
blocks are identical, so the first block's graph serves every other (torch.compile treats a
module's parameters as graph inputs), and the code outside the blocks -- embedding, head,
loss, the pipeline executor, the hooks layouts put on the blocks -- stays eager.

What is compiled is `block.forward`, not `block` (`nn.Module.compile` would compile the
module's `__call__`, hooks included): the forward pre-hooks that ZeRO-3 puts on each block
to gather its parameters (zero/gather.py) run outside the graph, before it, as they do
eagerly; its one hook inside the block (on the MLP's norm: where backward prefetches the
next unit) is one graph break. Compiling comes before activation checkpointing
(parallelize.py): a full checkpoint then wraps the compiled forward and its recomputation
in backward calls the same graph. Compiled the other way round, the checkpoint is inside
the graph, where no break is allowed, and that hook would leave the whole block eager.
Selective checkpointing's wrapped attention core is traced inside the block's graph.

Parts of a block that exchange data with other ranks run eagerly, between compiled pieces
(`torch.compiler.disable`): a context-parallel attention core (ring or Ulysses: its
`attend`, context/core.py) and a mixture-of-experts layer (model/moe.py; under expert
parallelism its all-to-alls). Their collectives are Python calls through the Communicator
(ledger, timers, tags), which dynamo would otherwise trace into and split into many small
graphs; the MoE layer's routing has data-dependent group sizes, and torch's grouped matmul
has no fp32 trace rule on the CPU. Each is one graph break: the block becomes two graphs.
The per-document attention of packed documents (model/attention.py, `per_document`) is
left eager too: its loop runs over the batch's document spans, Python ints that a graph
would bake in, recompiling for every batch (one more graph break in such a block).

Tensor and sequence parallelism need no island: their collectives are custom ops
(parallel/tensor/ops.py) that dynamo records as single nodes, and their autograd functions
and region hooks trace, so each block stays one graph with its collectives in it (forward
and backward), the Communicator called from inside the graph as eagerly (the same ledger
records). Disabling at the boundary instead would cost a graph break at each region's entry
and exit: five graphs per block, not one.

Shapes are static (`dynamic=False`): a training step's blocks always see [micro_batch,
seq_len, dim] (the tokens a rank holds under cp or sp). Forward-only calls -- evaluation,
and sampling, whose context grows by one token per call -- run the same forward eagerly:
each new length would otherwise be a new graph, compiled once and used once.

Which layouts compose is decided before any work: config/layout.py, `check_compile`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardtrain.model import attention
from shardtrain.model.moe import MoE
from shardtrain.parallel.context.apply import context_cores


class CompiledForward:
    """A block's forward: compiled while autograd records (training), eager otherwise."""

    def __init__(self, forward: Callable[..., torch.Tensor]):
        self.eager = forward
        self.compiled = torch.compile(forward, dynamic=False)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if torch.is_grad_enabled():
            return self.compiled(*args, **kwargs)
        return self.eager(*args, **kwargs)


def compile_blocks(blocks: nn.ModuleList) -> None:
    """Compile each block's forward, in place (parameter names and hooks unchanged), with
    an MoE layer and a context-parallel core's exchanges left eager; compilation itself
    happens at each graph's first call."""
    if not hasattr(attention.per_document, "_torchdynamo_disable"):  # once per process
        attention.per_document = torch.compiler.disable(attention.per_document)
    for block in blocks:
        if isinstance(block.mlp, MoE):
            block.mlp.forward = torch.compiler.disable(block.mlp.forward)
        for core in context_cores(block):  # a core several blocks share: wrapped once
            if not hasattr(core.attend, "_torchdynamo_disable"):
                core.attend = torch.compiler.disable(core.attend)
        block.forward = CompiledForward(block.forward)
