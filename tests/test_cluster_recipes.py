"""The cluster recipes (examples/slurm/, examples/k8s/; docs/launching.md) launch what they
say: every `shardtrain train` they start parses and validates for the world it runs in, as
tests/test_docs.py checks the README's commands (docs_runner.check_train), and the
replicas-mode recipes give each group its index and the lighthouse the config names.

The shell each recipe runs is really run, by bash, with `srun`, `scontrol`, `torchrun` and
`torchft_lighthouse` replaced by stubs that record their arguments and environment (srun
runs the command it was given), so loops, variables and arrays are expanded as on a
cluster. A Kubernetes container's command and args are taken from the manifest (a `bash
-c` script run the same way); its env fills `$(VAR)` references as the kubelet would.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from docs_runner import ROOT, check_options, check_train

SLURM = sorted((ROOT / "examples" / "slurm").glob("*.sbatch"))
K8S = sorted((ROOT / "examples" / "k8s").glob("*.yaml"))
# What the launcher gives each replica group (launch.py's names; docs/launching.md#the-
# environment-of-a-replica-group): the group's index and the lighthouse's address.
GROUP_ENV = ("SHARDTRAIN_REPLICA", "TORCHFT_LIGHTHOUSE")

RECORDER = """import json, os, sys
with open(os.environ["RECIPE_LOG"], "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in %r}}) + "\\n")
""" % (GROUP_ENV,)
STUBS = {
    "torchrun": 'exec "$RECIPE_PYTHON" "$RECIPE_RECORDER" torchrun "$@"',
    "torchft_lighthouse": '"$RECIPE_PYTHON" "$RECIPE_RECORDER" torchft_lighthouse "$@"\n'
                          "exec sleep 60",  # a server: the recipe stops it on exit
    "srun": 'while [ $# -gt 0 ] && [ "$1" != torchrun ]; do shift; done\nexec "$@"',
    "scontrol": 'for i in $(seq 0 $((SLURM_JOB_NUM_NODES - 1))); do echo "node$i"; done',
}


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("stubs")
    (where / "recorder.py").write_text(RECORDER)
    for name, body in STUBS.items():
        path = where / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(0o755)
    return where


def run_shell(args: list[str], stubs: Path, env: dict[str, str]) -> list[dict]:
    """Run `args` (a recipe under bash) against the stubs; the launches they recorded."""
    log = stubs / "launches.jsonl"
    log.unlink(missing_ok=True)
    full = {**os.environ, **env, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
            "RECIPE_LOG": str(log), "RECIPE_PYTHON": sys.executable,
            "RECIPE_RECORDER": str(stubs / "recorder.py")}
    proc = subprocess.run(args, env=full, capture_output=True, text=True, timeout=60,
                          cwd=stubs)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def slurm_launches(path: Path, stubs: Path, **extra: str) -> list[dict]:
    """The sbatch script run as Slurm would on its first node, its #SBATCH sizes in the env."""
    header = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", path.read_text(), flags=re.M))
    env = {"SLURM_JOB_NUM_NODES": header["nodes"], "SLURM_GPUS_PER_NODE": header["gpus-per-node"],
           "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": f"node[0-{int(header['nodes']) - 1}]",
           **extra}
    return run_shell(["bash", str(path)], stubs, env)


def k8s_launches(path: Path, stubs: Path) -> list[dict]:
    """Each container's command, as the kubelet starts it (and a bash -c script, run)."""
    out = []
    for doc in yaml.safe_load_all(path.read_text()):
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []):
            env = {e["name"]: str(e["value"]) for e in c.get("env", [])}
            argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], str(a))
                    for a in c.get("command", []) + c.get("args", [])]
            if argv[:2] == ["bash", "-c"]:
                out += run_shell(argv, stubs, env)
            else:
                out.append({"argv": argv, "env": {k: env.get(k) for k in GROUP_ENV}})
    return out


def check_launches(launches: list[dict], where: str) -> None:
    """Every torchrun starts a `shardtrain train` that validates for its world (a group's
    processes times the groups under fault.mode=replicas: parallel.dp counts them all);
    replica groups get indices 0..R-1 and the lighthouse their config names; the
    lighthouse's flags are its own."""
    trains = [x for x in launches if x["argv"][0] == "torchrun"]
    assert trains, f"{where}: no torchrun launch"
    groups = []
    for x in trains:
        argv = x["argv"]
        m = argv.index("-m")
        assert argv[m + 1:m + 3] == ["shardtrain", "train"], (where, argv)
        opts = dict(zip(argv[1:m:2], argv[2:m:2]))
        per_group = int(opts["--nnodes"]) * int(opts["--nproc-per-node"])
        _, cfg = check_train(argv[m + 3:], per_group)  # parses; dp checked below
        if cfg.fault.mode == "replicas":
            _, cfg = check_train(argv[m + 3:], per_group * cfg.parallel.replicas)
            assert x["env"]["TORCHFT_LIGHTHOUSE"] == cfg.fault.lighthouse, (where, x["env"])
            groups.append((int(x["env"]["SHARDTRAIN_REPLICA"]), cfg.parallel.replicas))
        else:
            assert not any(x["env"].values()), (where, "a restart-mode launch got", x["env"])
    if groups:
        assert sorted(g for g, _ in groups) == list(range(groups[0][1])), (where, groups)
        lighthouses = [x["argv"] for x in launches if x["argv"][0] == "torchft_lighthouse"]
        assert len(lighthouses) == 1, (where, lighthouses)
        real = shutil.which("torchft_lighthouse")
        if real:  # torchft's own binary: every flag the recipe gives is in its --help
            help_text = subprocess.run([real, "--help"], capture_output=True, text=True).stdout
            check_options(lighthouses[0][1:], help_text)


@pytest.mark.parametrize("path", SLURM, ids=[p.name for p in SLURM])
def test_slurm_recipe(path: Path, stubs: Path):
    check_launches(slurm_launches(path, stubs), path.name)
    if "--requeue" in path.read_text():  # a requeued job resumes the same run
        again = slurm_launches(path, stubs, SLURM_RESTART_COUNT="1")
        assert all(x["argv"][-2:] == ["--checkpoint.resume", "latest"] for x in again)
        check_launches(again, path.name + " (requeued)")


@pytest.mark.parametrize("path", K8S, ids=[p.name for p in K8S])
def test_k8s_recipe(path: Path, stubs: Path):
    check_launches(k8s_launches(path, stubs), path.name)


def test_every_mode_has_a_recipe_on_each_and_the_docs_explain_them():
    for files in (SLURM, K8S):
        assert {p.stem for p in files} == {"restart", "replicas"}
    text = (ROOT / "docs" / "launching.md").read_text()
    for path in SLURM + K8S:
        assert str(path.relative_to(ROOT)) in text, path
    for name in GROUP_ENV:
        assert f"`{name}`" in text, name
