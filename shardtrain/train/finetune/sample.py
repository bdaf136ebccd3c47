"""The end of a run -- its sample and its export -- without gathering the model.

Gathering the whole model onto one rank is what a layout exists to avoid, so the end of a
run never does it (ARCHITECTURE.md, "Nothing gathers the whole model on a training path"):

- The sample runs through the parallel model where every rank holds whole layers (no
  tensor, pipeline, context or expert split): a replicated layout's rank 0 has the model
  already; under ZeRO-3 every rank of the group generates the same tokens in lockstep, its
  forward gathering one unit at a time as in training (zero/gather.py). Where the layers
  are split, rank 0 builds the plain model from the run's final checkpoint, one tensor at a
  time from disk (train/finetune/export.py), if the model has at most `train.sample_max_params`
  parameters; a larger one is skipped with one line saying so.
- `train.export_hf` streams the final checkpoint into a Hugging Face directory on rank 0
  (train/finetune/export.py `export_checkpoint`: one weight in memory at a time).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from shardtrain.cost.counts import param_counts
from shardtrain.data.tokenizer import prompt_ids
from shardtrain.model.generate import generate

if TYPE_CHECKING:
    from shardtrain.train.trainer import Trainer


def layers_whole(trainer: Trainer) -> bool:
    """Whether every rank holds whole layers (it may still shard them over dp: ZeRO-3)."""
    p = trainer.cfg.parallel
    return p.tp == p.pp == p.cp == p.ep == 1


def end_sample(trainer: Trainer, prompt: str, n_tokens: int) -> str | None:
    """The generated text on rank 0 (None elsewhere, or when skipped). Every rank calls it."""
    cfg, tok = trainer.cfg, trainer.data.tokenizer
    if layers_whole(trainer):
        if cfg.parallel.zero == 3 or trainer.is_main:  # ZeRO-3's forward is a collective
            # Under the run's precision policy, as training ran: ZeRO-3 holds the weights
            # autocast rounds in the compute dtype (parallel/zero/units.py).
            with trainer.parallel.policy.autocast(trainer.device):
                out = generate(trainer.parallel.module, prompt_ids(tok, prompt), n_tokens,
                               seed=cfg.train.seed)
            return tok.decode(out[len(tok.head):]) if trainer.is_main else None
        return None
    if not trainer.is_main:
        return None
    n_params = param_counts(cfg.model).total
    if n_params > cfg.train.sample_max_params:
        print(f"no sample: the layers are split over ranks and the model's {n_params:,} "
              f"parameters exceed train.sample_max_params={cfg.train.sample_max_params:,}; "
              f"sample with shardtrain generate --checkpoint {final_checkpoint(trainer)}",
              flush=True)
        return None
    from shardtrain.train.finetune.export import load_checkpoint_model

    model, _ = load_checkpoint_model(final_checkpoint(trainer))
    out = generate(model.to(trainer.device), prompt_ids(tok, prompt), n_tokens,
                   seed=cfg.train.seed)
    return tok.decode(out[len(tok.head):])


def end_export(trainer: Trainer, out: str) -> Path | None:
    """train.export_hf: the final checkpoint streamed into a Hugging Face directory on
    rank 0 (None elsewhere)."""
    if not trainer.is_main:
        return None
    from shardtrain.train.finetune.export import export_checkpoint

    path = export_checkpoint(final_checkpoint(trainer), out)
    print(f"exported the model as a Hugging Face directory: {path}", flush=True)
    return path


def final_checkpoint(trainer: Trainer) -> Path:
    """The checkpoint this run committed at its last step (Saver.wait has returned), or
    resumed from when it had no step left to run: never merely the newest in the run dir."""
    return trainer.saver.committed
