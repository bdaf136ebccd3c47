"""Token-cache builds never hang a machine silently (issue 39): tokenization workers do not
re-run the entry script, whatever it is, and a run waiting on another's build says whose
lock it waits on and gives up after data.lock_timeout_s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from shardtrain.config import ConfigError, DataConfig
from shardtrain.data.cache import cache_path, load_tokens
from shardtrain.data.fsutil import build_once
from shardtrain.data.tokenize import BATCH_CHARS
from shardtrain.data.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parent.parent


def test_an_unguarded_console_script_builds_the_cache_with_workers(tmp_path):
    """A console script as some installers write it, without an `if __name__ == "__main__"`
    guard. multiprocessing's spawn re-ran it in each tokenization worker: a second CLI run
    that waited forever on the cache lock its own parent held. The tiny preset reads 2 MB of
    the standard library, two 1 M-character batches: with data.num_proc = 2 a pool runs.
    Two ranks, too: forkserver children re-ran the script the same way (each rank's CLI
    then failed, starting processes while bootstrapping)."""
    script = tmp_path / "bin" / "shardtrain"
    script.parent.mkdir()
    script.write_text("import sys\nfrom shardtrain.cli import main\nsys.exit(main())\n")
    cache = tmp_path / "cache"
    argv = [sys.executable, str(script), "train", "--config", "tiny", "--nproc", "2",
            "--train.steps", "1", "--train.run_dir", str(tmp_path / "run"),
            "--data.cache_dir", str(cache), "--data.num_proc", "2", "--train.peak_flops", "1e12"]
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    # A session of its own: on a hang, the stuck workers go with the run.
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"no end in 240 s (workers re-running the script?):\n{out}")
    assert proc.returncode == 0, out
    tokens, = cache.glob("tokens-*.uint16")
    assert tokens.stat().st_size > 2 * BATCH_CHARS  # more than one batch: the pool did the work
    assert "waiting for" not in out  # nothing waited on the lock


def test_a_waiting_build_names_the_lock_and_its_holder_and_gives_up(tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text("some text " * 100)
    cfg = DataConfig(source=str(src), cache_dir=str(tmp_path / "cache"), lock_timeout_s=0.5)
    tokenizer = ByteTokenizer()
    target = cache_path(cfg, tokenizer)
    lock = target.with_name(target.name + ".lock")
    holding, release = threading.Event(), threading.Event()

    def stuck_build(tmp: Path) -> None:  # another builder of the same cache, stuck
        holding.set()
        release.wait(60)

    holder = threading.Thread(target=build_once, args=(target, stuck_build),
                              kwargs={"timeout_s": 60})
    holder.start()
    try:
        assert holding.wait(60)
        with pytest.raises(ConfigError) as e:
            load_tokens(cfg, tokenizer)
    finally:
        release.set()
        holder.join()
    assert str(e.value).startswith(f"{lock}: still held by PID {os.getpid()} on ")
    assert "data.lock_timeout_s=0.5 s" in str(e.value) and "stop it" in str(e.value)
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"shardtrain: waiting for {lock}, held by PID {os.getpid()} on "), err
    assert lock.read_text() == ""  # the holder's PID left with its lock
    with pytest.raises(ConfigError, match=r"data.lock_timeout_s=0(\.0)? must be positive"):
        DataConfig(lock_timeout_s=0).validate()
