"""A process pool whose workers never run the entry script again.

Starting a worker, multiprocessing's spawn re-runs the parent's main script in the child as
`__mp_main__`, so that functions the script defines can be unpickled there
(multiprocessing/spawn.py: `get_preparation_data` names the script, `prepare` runs it). A
script without an `if __name__ == "__main__":` guard, as some installers write a console
script (`import sys; from shardtrain.cli import main; sys.exit(main())`), so runs the whole
CLI again in every worker: a tokenization worker started a second `shardtrain train`, which
waited on the token cache's lock held by its own parent, and the build never ended (issue 39).

Why hide the main module rather than trust it to have a guard: the workers here run
functions of shardtrain's own modules and need nothing of `__main__`, so while a worker
starts, `sys.modules["__main__"]` is a bare stand-in with neither a file nor a module name,
and spawn has nothing to re-run, whatever the entry script is (`python -m shardtrain`,
a console script with or without a guard, a user's script calling the library). (The
other way, workers started by subprocess from a module of ours, would re-implement the pool;
forkserver re-runs the script the same way.) For the
pool here the swap lasts one `Process.start()` (the pickling of the process object and the
exec); launch.py hides it while torch's elastic agent starts (and restarts) the ranks,
which are forkserver children and re-ran the script the same way.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from multiprocessing.context import SpawnContext, SpawnProcess
from typing import Any

_STAND_IN = types.ModuleType("__main__")  # no __file__, __spec__ None: spawn re-runs nothing
_SWAP = threading.Lock()
_hidden = [0, None]  # [how many callers are inside hidden_main, the real main module]


@contextmanager
def hidden_main() -> Iterator[None]:
    """Processes spawned (or forkserver-started) inside do not re-run the entry script (see
    the module's doc). Nests, and overlaps across threads: the last one out restores it."""
    with _SWAP:
        if _hidden[0] == 0:
            _hidden[1] = sys.modules["__main__"]
            sys.modules["__main__"] = _STAND_IN
        _hidden[0] += 1
    try:
        yield
    finally:
        with _SWAP:
            _hidden[0] -= 1
            if _hidden[0] == 0:
                sys.modules["__main__"] = _hidden[1]


class _Process(SpawnProcess):
    def start(self) -> None:
        with hidden_main():
            super().start()


class _Context(SpawnContext):
    # spawn, not fork: the parent may hold threads (tokenizers' pool, torch's) a fork copies
    # in whatever state they were.
    Process = _Process


def process_pool(n: int, initializer: Callable[..., None], initargs: tuple[Any, ...]
                 ) -> ProcessPoolExecutor:
    """`n` spawned worker processes, each running `initializer(*initargs)` first, none
    re-running the entry script."""
    return ProcessPoolExecutor(n, mp_context=_Context(), initializer=initializer,
                               initargs=initargs)
