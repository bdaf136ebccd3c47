"""The commands of README.md and docs/*.md run as written.

Every ```bash block of the README and of docs/*.md is read; its lines (continuations joined,
comments dropped, `&&` chains split) are commands. Each command is first checked to parse:
a `shardtrain train` (also under torchrun) has its config loaded and validated for its
world size, exactly as the launcher would before starting a process; every other
`shardtrain` or `benchmarks/` command has each of its options found in its own `--help`.
Then the cheap commands run, in document order, in a scratch copy of the repository root
(its entries linked, `runs/` fresh), with `--data.cache_dir` appended to train commands so
the token cache lands in the scratch directory too. Cheap means seconds: `--help`,
`shardtrain plan`, a `--config tiny` training of at most 50 steps on one process or at most
10 steps on two, and `generate` / `report` / `export` on what an earlier command wrote. The
rest (the default 400-step run, benchmarks, installs, larger launches) is skipped with its
reason.

To keep the whole check near a minute on a 2-core machine, the cheap commands run in one
interpreter (torch imported once) through `shardtrain.cli.main`, the function
`python -m shardtrain` calls: this file is also that runner's script.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEST_COMMAND = "pip install torch==2.13.0 -e '.[test]' && python -m pytest"


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


# ---------------------------------------------------------------------------- the tests


def test_readme_keeps_the_ci_command_and_stays_short():
    readme = (ROOT / "README.md").read_text()
    assert TEST_COMMAND in readme.splitlines()
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text().splitlines()
    assert len(readme.splitlines()) < 250


def test_links_between_docs_resolve():
    """Every relative link names an existing file, and its #anchor one of that file's headings."""
    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if "://" in target:
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{path.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{path.name}: {target} (no such heading)")
    assert not broken, broken


def _anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_docs_have_commands():
    assert len(COMMANDS) > 20
    assert any(c.argv[:2] == ("shardtrain", "train") for c in COMMANDS)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    """Runs every command (parse check, then the run if cheap) in one runner process."""
    work = tmp_path_factory.mktemp("docs")
    scratch = work / "repo"
    scratch.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in ("runs", ".git"):
            (scratch / entry.name).symlink_to(entry)
    spec = work / "commands.json"
    spec.write_text(json.dumps([asdict(c) for c in COMMANDS]))
    out = work / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__, str(spec), str(scratch), str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.where} {c.text[:60]}" for c in COMMANDS])
def test_doc_command(command: Command, results):
    result = results[command.text]
    if result["status"] == "failed":
        pytest.fail(f"{command.where}: `{command.text}` {result['reason']}\n{result['output']}")
    if result["status"] == "skipped":
        pytest.skip(f"{command.where}: {result['reason']}")


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
    if argv[0] == "examples/two_nodes.sh":  # PROCS_PER_NODE, then train's arguments
        check_train(list(argv[2:]), 2 * int(argv[1]))
        return "skip", "two network namespaces need root: tests/test_two_nodes.py runs it"
    args = shardtrain_argv(argv)
    if args is None:
        raise Failed("is not a shardtrain, python or torchrun command this test can check; "
                     "put snippets that are not commands in a ```text block")
    if not args or "--help" in args or "-h" in args:
        return "run", ""
    sub = args[0]
    if sub == "plan":
        return "run", ""
    if sub == "train":
        known, cfg = check_train(args[1:])
        nproc, steps = known.nproc or 1, cfg.train.steps
        if known.config != "tiny":
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


def run_one(argv: tuple[str, ...], scratch: Path, cache: Path) -> None:
    from shardtrain.cli import main

    args = shardtrain_argv(argv)
    if args[:1] == ["train"] and not any(a.startswith("--data.cache_dir") for a in args):
        args = [*args, "--data.cache_dir", str(cache)]
    try:
        rc = main(args)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    if rc:
        raise Failed(f"exited with {rc}")


def runner(spec: Path, scratch: Path, out: Path) -> None:
    os.chdir(scratch)
    cache = scratch / "runs" / ".cache"
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
                    run_one(argv, scratch, cache)
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
