"""Every check that can fail before a training run starts, run before any process or
directory is made: a bad config, source, tokenizer, layout, resume target, run dir (one
that holds another run's checkpoints: train/checkpoint/rundir.py) or disk is one line and
exit 2 with nothing written (cli.py `shardtrain train` calls `prepare_run`)."""

from __future__ import annotations

import os
from pathlib import Path

from shardtrain import config as config_mod
from shardtrain.config import Config, ConfigError


def prepare_run(cfg: Config, world_size: int, *, prepare_data: bool, local_ranks: int = 1,
                main: bool = True, claim: bool = True) -> None:
    """Every check that can fail before training starts, and the token cache built once.
    `local_ranks`: the ranks this machine runs (they share its memory on CPU); `main`: the
    one process of the job that may move a bad checkpoint, or with train.overwrite the
    earlier run, aside (train/checkpoint/checkpoint.py, rundir.py); `claim`: the run will
    write checkpoints into its run dir (not a dry run), which must not hold another run's."""
    import torch

    from shardtrain.data import check_source, check_vocab, load_dataset, load_tokenizer
    from shardtrain.parallel.ps.layout import check_servers
    from shardtrain.parallel.zero.offload import check_offload_space
    from shardtrain.train.checkpoint import checkpoint as ckpt
    from shardtrain.train.checkpoint.rundir import claim_run_dir, move_run_aside
    from shardtrain.train.finetune.finetune import resolve_init_from
    from shardtrain.train.observe.metrics import read_records
    from shardtrain.train.start.device import device_defaults
    from shardtrain.train.start.fits import check_fits

    try:
        resolve_init_from(cfg)  # before validation: the shape comes from model.init_from
    except ConfigError as e:  # a preset's value the user never typed: say where it came from
        raise config_mod.explain_origin(e, cfg) from None
    cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    device_defaults(cfg, "cuda" if cuda else "cpu")  # train.precision=auto: checked resolved
    cfg.validate(world_size)
    check_source(cfg.data)
    if cfg.data.tokenizer not in ("byte", "bpe"):
        load_tokenizer(cfg.data)  # a tokenizer.json path: fails fast if missing or invalid
    check_fits(cfg, world_size, device_kind="cuda" if cuda else "cpu", local_ranks=local_ranks)
    check_writable(Path(cfg.train.run_dir))
    check_offload_space(cfg)
    check_servers(cfg)
    move_aside = claim and claim_run_dir(cfg)
    resume = ckpt.resolve_resume(cfg, main=main)
    if resume is not None:
        ckpt.check_compatible(resume, cfg, world_size)
        if not move_aside:  # a torn last line is dropped at start; a bad one elsewhere stops
            read_records(Path(cfg.train.run_dir) / "metrics.jsonl")
    if cfg.train.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError("train.tensorboard=true needs the tensorboard package: "
                              "pip install 'shardtrain[tensorboard]'") from None
    if prepare_data:
        check_vocab(load_dataset(cfg.data, seq_len=cfg.train.seq_len), cfg.model.vocab_size)
    # Only now, every check passed: a rejected input leaves no empty run dir behind.
    if move_aside and main:
        move_run_aside(cfg.train.run_dir)
    Path(cfg.train.run_dir).mkdir(parents=True, exist_ok=True)


def check_writable(run_dir: Path) -> None:
    """The run dir, or the nearest directory above it that exists, is writable: checked
    without creating anything (the run dir is made once every check has passed)."""
    existing = run_dir.absolute()
    while not existing.exists():
        existing = existing.parent
    why = None
    if not existing.is_dir():
        why = f"{existing} is not a directory"
    elif not os.access(existing, os.W_OK | os.X_OK):
        why = f"{existing} is not writable"
    if why:
        raise ConfigError(f"train.run_dir={str(run_dir)!r} cannot be written ({why}); "
                          "choose a directory you can write to")
