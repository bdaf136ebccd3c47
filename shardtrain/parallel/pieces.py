"""A layout's state as checkpoint pieces, and its state read back from any checkpoint.

Saving: each rank describes what it holds (ckpt/regions.py) -- the model's tensors by their
single-process names (`model/<name>`) and the optimizer's per-element state
(`optim/<name>/<state>`: exp_avg, exp_avg_sq, momentum_buffer, always fp32 and dequantized)
-- and writes it as it is. A block of a tensor-parallel (or expert-parallel) split is a box
of the full tensor; a ZeRO shard is a flat range of such a box. Copies of the same region
(data-parallel replicas, tp ranks sharing a kv head, the pipeline's two copies of a tied
embedding) are written once, by one of the ranks holding them (ckpt/dcp.py: the ranks
exchange their plans over the mesh first, `gather_plans`).

Loading: every rank reads only the regions it holds -- its blocks of the tensors, under
ZeRO its runs of each parameter's block -- whatever layout wrote them, so a checkpoint
resumes in any layout, precision or ZeRO stage reading about its own share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from shardtrain.ckpt.files import Piece, Reader
from shardtrain.ckpt.regions import Region, block_region
from shardtrain.comm import Communicator
from shardtrain.config import ConfigError
from shardtrain.parallel.pipeline.state import StageShards, all_gather_objects

MASTER = "master"  # the shard optimizers' name for the fp32 weights (zero/optim.py)


def model_key(name: str) -> str:
    return f"model/{name}"


def optim_key(name: str, state: str) -> str:
    return f"optim/{name}/{state}"


def stash_key(name: str) -> str:
    """PipeDream-2BW's stashed weight version of `name` (pipeline/pipedream.py)."""
    return f"stash/{name}"


def box_of(shards: StageShards, name: str, local: torch.Size) -> tuple[tuple, tuple]:
    """(full shape, box) of the block `name` this rank holds, of local shape `local`: sliced
    over ep, then over tp (tensor/sharding.py)."""
    levels = [place(name) for _, place in shards.levels()]  # innermost (tp) first
    shape = tuple(local)
    for place in levels:
        if place.parts > 1:
            shape = place.full_shape(shape)
    box = tuple((0, n) for n in shape)
    for place in reversed(levels):
        if place.parts > 1:
            start = box[place.dim][0] + place.index * place.block()
            box = box[:place.dim] + ((start, place.block()),) + box[place.dim + 1:]
    return shape, box


def tensor_piece(shards: StageShards, key: str, name: str, t: torch.Tensor,
                 fetch: Callable[[], torch.Tensor] | None = None) -> Piece:
    """A whole local tensor (this rank's block of `name`) as a piece; `fetch` makes it when
    it is written, where `t` only gives its shape and dtype."""
    shape, box = box_of(shards, name, t.shape)
    dtype = torch.float32 if t.is_floating_point() else t.dtype
    return Piece(block_region(key, shape, box), dtype, fetch or (lambda: t))


def module_pieces(shards: StageShards, skip: Iterable[str] = ()) -> list[Piece]:
    """The stage's state-dict tensors (tied aliases once, under their first name)."""
    skip = set(skip) | set(shards.tied_to)
    return [tensor_piece(shards, model_key(k), k, v)
            for k, v in shards.model.state_dict().items() if k not in skip]


def torch_optimizer_pieces(shards: StageShards, optimizer: torch.optim.Optimizer) -> list[Piece]:
    """A torch optimizer's per-element state: its moments by their torch names (8-bit ones
    dequantized one at a time, as they are written)."""
    name_of = {p: n for n, p in shards.named.items()}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if hasattr(optimizer, "canonical_state"):  # 8-bit moments (train/adam8bit.py)
                out += [tensor_piece(shards, optim_key(name_of[p], k), name_of[p], p,
                                     lambda p=p, k=k: optimizer.canonical_state(p, k))
                        for k in (("exp_avg", "exp_avg_sq") if state else ())]
                continue
            out += [tensor_piece(shards, optim_key(name_of[p], k), name_of[p], v)
                    for k, v in state.items() if k != "step" and v.shape == p.shape]
    return out


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    steps = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
    return max(steps, default=0)


def gather_plans(plain: object, comms: list[Communicator], rank: int,
                 world_size: int) -> list:
    """Every rank's part of a save's plan exchange (ckpt/saveplan.py: its digests, or its
    plain save items as JSON text), in rank order: exchanged over each mesh dim in turn
    (after the last every rank knows every rank's)."""
    mine = {rank: plain}
    for comm in comms:
        merged: dict = {}
        for part in all_gather_objects(comm, mine):
            merged.update(part)
        mine = merged
    return [mine[r] for r in range(world_size)]


# ---------------------------------------------------------------------- loading

def local_tensor(shards: StageShards, reader: Reader, key: str, name: str,
                 like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """This rank's block of the checkpoint's tensor `key` (placed as `name`), read alone,
    in `dtype` (default: like's)."""
    shape, box = box_of(shards, name, like.shape)
    _check_shape(reader, key, shape)
    return reader.block(key, shape, box).view(like.shape).to(dtype or like.dtype)


def _check_shape(reader: Reader, key: str, want: tuple[int, ...]) -> None:
    if reader.has(key) and reader.shape(key) != tuple(want):
        raise ConfigError(f"{reader.directory}: {key} has shape {reader.shape(key)} there and "
                          f"{tuple(want)} in this run's model (another lora.rank or targets?); "
                          "resume with the checkpoint's settings")


def local_model_state(shards: StageShards, reader: Reader, skip: Iterable[str] = ()
                      ) -> dict[str, torch.Tensor]:
    """This rank's slices of the checkpoint's model tensors, by the stage's state-dict keys
    (those in `skip` left out, and a tied name whose first name is: under ZeRO-3 the tied
    head is the embedding's unit parameter, its storage freed outside a gather)."""
    skip = set(skip)
    return {k: local_tensor(shards, reader, model_key(shards.tied_to.get(k, k)), k, v)
            for k, v in shards.model.state_dict().items()
            if k not in skip and shards.tied_to.get(k, k) not in skip}


def load_torch_optimizer(shards: StageShards, optimizer: torch.optim.Optimizer,
                         reader: Reader, steps: int) -> None:
    """Fill a torch optimizer's state from the checkpoint (none saved: left fresh)."""
    name_of = {p: n for n, p in shards.named.items()}
    states: dict[int, dict[str, torch.Tensor]] = {}
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = name_of[p]
            keys = [k for k in reader.keys(f"optim/{name}/")]
            if keys:
                # as saved, fp32: the optimizer casts what it keeps in another dtype (a
                # 16-bit parameter's moments stay fp32: train/optim.py Optimizer16)
                states[index] = {k.rsplit("/", 1)[1]: local_tensor(shards, reader, k, name, p,
                                                                   torch.float32)
                                 for k in keys}
            index += 1
    if hasattr(optimizer, "load_canonical"):
        optimizer.load_canonical(states, steps)
        return
    for state in states.values():  # torch keeps a (non-capturable) step count on the host
        state["step"] = torch.tensor(float(steps), device="cpu")
    optimizer.load_state_dict({"state": states,
                               "param_groups": optimizer.state_dict()["param_groups"]})


def zero_pieces(shards: StageShards, units: list, state_of: Callable[[int], dict],
                names: Iterable[str]) -> list[Piece]:
    """ZeRO's master and optimizer shards: per unit, each parameter's run in the shard is a
    flat range of the parameter's block. `state_of(k)`: unit k's fp32 state (`shard_state`:
    "master" and the moments `names`), computed once per unit when the pieces are written
    (8-bit moments are dequantized then)."""
    cache: dict[int, dict] = {}

    def fetch(k: int, state: str, a: int, b: int) -> Callable[[], torch.Tensor]:
        def get() -> torch.Tensor:
            if k not in cache:
                cache.clear()  # one unit's state at a time
                cache[k] = state_of(k)
            return cache[k][state][a:b]
        return get

    out = []
    for k, u in enumerate(units):
        lo = u.rank * u.shard_numel
        for i, a, b in u.shard_runs(lambda i: True):
            name, p = u.names[i], u.params[i]
            shape, box = box_of(shards, name, p.shape)
            start = a + lo - u.offsets[i]  # the run, relative to the parameter
            for state in (MASTER, *names):
                key = model_key(name) if state == MASTER else optim_key(name, state)
                out.append(Piece(Region(key, shape, box, start, start + b - a), torch.float32,
                                 fetch(k, state, a, b)))
    return out


def zero_load(shards: StageShards, units: list, reader: Reader, names: Iterable[str],
              optimizer) -> None:
    """Fill every unit's master and optimizer shard (`names`: its moment names) from the
    checkpoint, reading only this rank's runs of each parameter."""
    for k, u in enumerate(units):
        state = {MASTER: _shard_values(shards, reader, u, model_key)}
        for moment in names:
            state[moment] = _shard_values(shards, reader, u, lambda n: optim_key(n, moment))
        optimizer.load_shard_state(k, state)


def zero_like_pieces(shards: StageShards, units: list, tensors: list[torch.Tensor],
                     key_of: Callable[[str], str]) -> list[Piece]:
    """Pieces of per-unit tensors laid out like the master shards ([shard] each, fp32),
    under key_of(parameter name): each parameter's run, as `zero_pieces` writes a master."""
    out = []
    for u, t in zip(units, tensors, strict=True):
        lo = u.rank * u.shard_numel
        for i, a, b in u.shard_runs(lambda i: True):
            shape, box = box_of(shards, u.names[i], u.params[i].shape)
            start = a + lo - u.offsets[i]
            out.append(Piece(Region(key_of(u.names[i]), shape, box, start, start + b - a),
                             torch.float32, lambda t=t, a=a, b=b: t[a:b]))
    return out


def zero_like_load(shards: StageShards, units: list, reader: Reader,
                   key_of: Callable[[str], str], tensors: list[torch.Tensor]) -> bool:
    """The inverse of `zero_like_pieces`; False (nothing changed) where the checkpoint has
    none of these keys."""
    if not any(reader.has(key_of(n)) for u in units for n in u.names):
        return False
    for u, t in zip(units, tensors, strict=True):
        t.copy_(_shard_values(shards, reader, u, key_of))
    return True


def _shard_values(shards: StageShards, reader: Reader, u, key_of: Callable[[str], str]
                  ) -> torch.Tensor:
    """Unit u's shard [shard] (fp32) of the tensors `key_of(name)`: each parameter's run in
    the shard is a flat range of the parameter's block (zeros where the checkpoint has no
    such tensor: a moment not yet created)."""
    out = torch.zeros(u.shard_numel, device=u.shard.device)
    lo = u.rank * u.shard_numel
    for i, a, b in u.shard_runs(lambda i: True):
        name, key = u.names[i], key_of(u.names[i])
        shape, box = box_of(shards, name, u.params[i].shape)
        if not reader.has(key):
            continue
        _check_shape(reader, key, shape)
        start = a + lo - u.offsets[i]  # the run, relative to the parameter's block
        out[a:b] = reader.region(key, Region(key, shape, box, start, start + b - a)).to(out)
    return out
