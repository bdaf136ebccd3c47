import os
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

# tests/ helpers (dist.py, parity.py) import as top-level modules, here and in spawned workers.
sys.path.insert(0, str(Path(__file__).parent))

# One thread, as the spawned workers run (dist.py): with two, the tests' tiny models spend
# most of their kernel time in thread hand-offs (2-50x slower when the cores are busy).
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def tiny_text(tmp_path_factory) -> None:
    """The text the tiny preset trains on, once for the session, for parity.tiny's runs
    (here, in spawned ranks and in CLI subprocesses, through the environment):

    - a copy of the stdlib files the preset's `data.max_bytes` reads, in the same order, so
      each run's source fingerprint stats those files instead of walking the whole install
      (site-packages included): ~1 s per trainer built, times every rank of every run;
    - one token cache, so the text is tokenized once, not once per test directory.

    The copy yields the stdlib's documents exactly: the same files in the same order
    (checked here), read by the same code up to the same byte, so the runs see the same
    tokens as with `data.source = "stdlib"`."""
    from parity import CACHE_ENV, SOURCE_ENV
    from shardtrain import config
    from shardtrain.data.sources import source_files

    stdlib = config.load("tiny").data
    root = Path(sysconfig.get_paths()["stdlib"])
    corpus, copied, total = tmp_path_factory.mktemp("stdlib"), [], 0
    for path in source_files(stdlib):
        if total > stdlib.max_bytes:  # one file past the limit: the cut falls inside
            break
        copied.append(path.relative_to(root))
        (corpus / copied[-1]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, corpus / copied[-1])
        total += path.stat().st_size
    copy = config.load("tiny", ["--data.source", str(corpus)]).data
    assert [p.relative_to(corpus) for p in source_files(copy)] == copied
    os.environ[SOURCE_ENV] = str(corpus)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("token-cache"))
