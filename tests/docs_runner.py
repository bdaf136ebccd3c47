"""The commands of README.md and docs/*.md, and the runner that checks and runs them
(tests/test_docs.py says which and how; this file is also the runner's script, run in one
interpreter so torch is imported once).

Every ```bash block is read; its lines (continuations joined, comments dropped, `&&` chains
split) are commands. `classify` checks that a command parses and says whether it is cheap
enough to run; `runner` runs the cheap ones in document order in a scratch copy of the
repository root, through `shardtrain.cli.main`, the function `python -m shardtrain` calls.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Command:
    where: str  # file:line of the command's first line
    argv: tuple[str, ...]

    @property
    def text(self) -> str:
        return shlex.join(self.argv)


def bash_blocks(path: Path) -> list[tuple[int, list[str]]]:
    """(line number of the first line, lines) of each ```bash block."""
    blocks, current, start, fence = [], None, 0, None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if fence is None and line.startswith("```"):
            fence = line.strip()
            current, start = ([] if fence == "```bash" else None), number + 1
        elif fence is not None and line.strip() == "```":
            if current is not None:
                blocks.append((start, current))
            fence, current = None, None
        elif current is not None:
            current.append(line)
    return blocks


def doc_commands() -> list[Command]:
    """Every command of every bash block, in document order, each distinct one once."""
    out, seen = [], set()
    for path in DOCS:
        for start, lines in bash_blocks(path):
            joined, first = "", None
            for offset, line in enumerate(lines):
                first = start + offset if first is None else first
                if line.rstrip().endswith("\\"):
                    joined += line.rstrip()[:-1] + " "
                    continue
                tokens = shlex.split(joined + line, comments=True)
                joined, where = "", f"{path.relative_to(ROOT)}:{first}"
                first = None
                while tokens:
                    cut = tokens.index("&&") if "&&" in tokens else len(tokens)
                    argv, tokens = tuple(tokens[:cut]), tokens[cut + 1:]
                    if argv and argv not in seen:
                        seen.add(argv)
                        out.append(Command(where, argv))
    return out


COMMANDS = doc_commands()


# ---------------------------------------------------------------------------- the runner


class Failed(Exception):
    pass


def shardtrain_argv(argv: tuple[str, ...]) -> list[str] | None:
    """The arguments of `shardtrain ...` or `python -m shardtrain ...`, else None."""
    if argv[0] == "shardtrain":
        return list(argv[1:])
    if argv[:3] == ("python", "-m", "shardtrain"):
        return list(argv[3:])
    return None


def check_train(args: list[str], world: int | None = None):
    """Load and validate a train command's config as the launcher does; the config."""
    from shardtrain import config

    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="default")
    parser.add_argument("--nproc", type=int, default=0)
    parser.add_argument("--dry-run-world", type=int, default=0)
    parser.add_argument("--max-restarts", type=int, default=0)
    known, overrides = parser.parse_known_args(args)
    cfg = config.load(known.config, overrides)
    cfg.validate(world or known.dry_run_world or known.nproc or 1)
    return known, cfg


def check_options(argv: list[str], help_text: str) -> None:
    """Every --option of the command appears in its --help, or is a config field override."""
    from shardtrain import config

    fields = {line.split()[0] for line in config.field_help()}
    for arg in argv:
        option = arg.split("=")[0]
        if not option.startswith("--") or option in fields:
            continue
        if not re.search(rf"(?<![\w.-]){re.escape(option)}(?![\w-])", help_text):
            raise Failed(f"option {option} is not in the command's --help")


def help_of(call) -> str:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        try:
            call()
        except SystemExit:
            pass
    return buffer.getvalue()


def classify(argv: tuple[str, ...], scratch: Path) -> tuple[str, str]:
    """Check that the command parses; ("run", "") when cheap, else ("skip", reason)."""
    from shardtrain import config
    from shardtrain.cli import main

    if argv[0] == "pip":
        return "skip", "installs packages"
    if argv[:3] == ("python", "-m", "pytest"):
        return "skip", "the whole test suite"
    if argv[0] == "python" and len(argv) > 1 and argv[1].startswith("benchmarks/"):
        import runpy

        script = scratch / argv[1]
        if not script.is_file():
            raise Failed(f"{argv[1]} does not exist")

        def script_help():
            # as `python SCRIPT` runs it: its own folder first on the path
            saved = sys.argv, list(sys.path)
            sys.argv, sys.path[:0] = [str(script), "--help"], [str(script.parent)]
            try:
                runpy.run_path(str(script), run_name="__main__")
            finally:
                sys.argv, sys.path[:] = saved

        check_options(list(argv[2:]), help_of(script_help))
        return "skip", "a benchmark: minutes of timed multi-process runs"
    if argv[0] == "torchrun":
        m = argv.index("-m")
        if argv[m + 1:m + 3] != ("shardtrain", "train"):
            raise Failed("only `torchrun ... -m shardtrain train ...` is checked")
        opts = argparse.ArgumentParser()
        opts.add_argument("--nnodes", type=int, default=1)
        opts.add_argument("--nproc-per-node", type=int, default=1)
        known, _ = opts.parse_known_args(list(argv[1:m]))
        world = known.nnodes * known.nproc_per_node
        check_train(list(argv[m + 3:]), world)
        return "skip", f"a torchrun launch of {world} processes on {known.nnodes} node(s)"
    if argv[0] == "examples/two_nodes.sh":  # [--replicas] PROCS_PER_NODE, train's arguments
        replicas = int(argv[1] == "--replicas")  # one group per node: what the script adds
        added = ["--fault.mode", "replicas", "--parallel.replicas", "2",
                 "--fault.advertise", "10.77.0.1"] if replicas else []
        check_train([*argv[2 + replicas:], *added], 2 * int(argv[1 + replicas]))
        return "skip", "two network namespaces need root: tests/test_two_nodes.py runs it"
    args = shardtrain_argv(argv)
    if args is None:
        raise Failed("is not a shardtrain, python or torchrun command this test can check; "
                     "put snippets that are not commands in a ```text block")
    if not args or "--help" in args or "-h" in args:
        return "run", ""
    sub = args[0]
    if sub in ("plan", "schedule"):  # pure Python, milliseconds
        return "run", ""
    if sub == "train":
        known, cfg = check_train(args[1:])
        nproc, steps = known.nproc or 1, cfg.train.steps
        # The tiny preset, or a config file of the tiny preset's model (a TOML example).
        if known.config != "tiny" and cfg.model != config.load("tiny").model:
            return "skip", f"the {known.config} preset: {steps} steps on {nproc} process(es), minutes"
        if known.dry_run_world:  # one process, at most 2 steps
            return "run", ""
        if nproc == 1 and steps <= 50 or nproc == 2 and steps <= 10:
            return "run", ""
        return "skip", (f"{nproc} processes for {steps} steps (the parity tests run this "
                        "layout); its config is validated")
    prefix = args[:2] if sub == "bench" else args[:1]
    check_options(args[len(prefix):], help_of(lambda: main([*prefix, "--help"])))
    if sub == "bench":
        return "skip", "a multi-process benchmark (seconds to minutes)"
    if sub in ("generate", "report", "export"):
        needed = args[1] if sub == "report" else args[args.index("--checkpoint") + 1]
        if (scratch / needed).exists():
            return "run", ""
        return "skip", f"needs {needed}, written by a command above that is not run here"
    raise Failed(f"unknown subcommand {sub!r}")


def run_one(argv: tuple[str, ...], runs: Path) -> None:
    """Run a cheap command. A train command (of the tiny preset: classify) gets the session's
    token cache (parity.tiny_data; outside a session a cache under `runs`) where it does not
    name its own."""
    from parity import tiny_data
    from shardtrain.cli import main

    args = shardtrain_argv(argv)
    if args[:1] == ["train"]:
        given = {a.split("=")[0] for a in args}
        data = tiny_data(runs)
        for field, value in zip(data[::2], data[1::2], strict=True):
            if field not in given:
                args += [field, value]
    try:
        rc = main(args)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    if rc:
        raise Failed(f"exited with {rc}")


def runner(spec: Path, scratch: Path, out: Path) -> None:
    os.chdir(scratch)
    results = {}
    for item in json.loads(spec.read_text()):
        argv = tuple(item["argv"])
        log = scratch / "runs" / ".log"
        log.parent.mkdir(exist_ok=True)
        start, cpu = time.perf_counter(), _cpu_seconds()
        status, reason = "ran", ""
        with open(log, "w+") as f, _fds_to(f):
            try:
                action, reason = classify(argv, scratch)
                if action == "run":
                    run_one(argv, scratch / "runs")
                else:
                    status = "skipped"
            except Failed as e:
                status, reason = "failed", str(e)
            except Exception:  # a ConfigError or a crash: the command does not run as written
                status, reason = "failed", "raised:\n" + traceback.format_exc()
            sys.stdout.flush()
            sys.stderr.flush()
        output = log.read_text()[-4000:]
        seconds = time.perf_counter() - start
        results[shlex.join(argv)] = {"status": status, "reason": reason, "output": output,
                                     "seconds": round(seconds, 2)}
        print(f"{status:8s} {seconds:6.1f}s (cpu {_cpu_seconds() - cpu:5.1f}s)  {item['where']}  "
              f"{shlex.join(argv)[:90]}", flush=True)
    out.write_text(json.dumps(results))


def _cpu_seconds() -> float:
    import resource

    own, children = (resource.getrusage(who) for who in
                     (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@contextlib.contextmanager
def _fds_to(f):
    """Point this process's stdout and stderr (and so its children's) at f."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(f.fileno(), 1)
    os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


if __name__ == "__main__":
    runner(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
