"""Tokenization throughput and peak memory of the token cache build, by data.num_proc.

    python benchmarks/tokenize_throughput.py [--mb 100] [--num-proc 1,2] [--tokenizer bpe]

A corpus of `--mb` MB is written as one Parquet file (the standard library's .py files, one
document each, repeated until the size is reached); with `--tokenizer bpe` a 4096-token BPE
is trained first on its first 5 MB (not timed). Then, per process count, a fresh
interpreter builds the cache (data/cache.py: reader here, `num_proc` encoding workers) and
reports its wall time and MB/s of text; this script samples the resident memory of that
process and its workers every 0.1 s from /proc (getrusage's maximum would include the
memory of the process that started it: Linux keeps it across exec) and reports the peaks of
the reading process and of all of them together. A figure, never a test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

_CHILD = r"""
import json, sys, time
from shardtrain.config import DataConfig
from shardtrain.data.cache import load_tokens
from shardtrain.data.tokenizer import load_tokenizer
cfg = DataConfig(**json.loads(sys.argv[1]))
tok = load_tokenizer(cfg)
start = time.perf_counter()
n = len(load_tokens(cfg, tok))
seconds = time.perf_counter() - start
print(json.dumps({"tokens": n, "seconds": seconds}))
"""


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:  # the process has ended
        pass
    return 0.0


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def measure(cmd: list[str]) -> tuple[str, float, float]:
    """Run `cmd`; its stdout, and the peak RSS (MiB) of it alone and of it plus children."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    reader = total = 0.0
    while proc.poll() is None:
        mine = _rss_mib(proc.pid)
        reader, total = max(reader, mine), max(total, mine + sum(map(_rss_mib, _children(proc.pid))))
        time.sleep(0.1)
    out = proc.stdout.read() if proc.stdout else ""
    if proc.returncode:
        raise SystemExit(f"the tokenization run failed ({proc.returncode})")
    return out, reader, total


def write_corpus(path: Path, megabytes: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    target, size = megabytes * 10**6, 0
    with pq.ParquetWriter(str(path), pa.schema([("text", pa.string())])) as out:
        while size < target:
            docs = []
            for p in files:
                text = p.read_text(errors="replace")
                docs.append(text[:target - size])
                size += len(docs[-1].encode())
                if size >= target:
                    break
            # Row groups of 1000 documents (a few MB), as writers of large corpora keep them:
            # the reader decodes one row group at a time.
            out.write_table(pa.table({"text": docs}), row_group_size=1000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=100, help="corpus size in MB (default 100)")
    ap.add_argument("--num-proc", default="1,2", help="process counts, comma-separated")
    ap.add_argument("--tokenizer", default="bpe", choices=["bpe", "byte"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.parquet"
        write_corpus(corpus, args.mb)
        base = {"source": str(corpus), "tokenizer": "byte"}
        if args.tokenizer == "bpe":  # trained on the first 5 MB, then named by its file
            from shardtrain.config import DataConfig
            from shardtrain.data.tokenizer import train_bpe

            trained = train_bpe(DataConfig(source=str(corpus), max_bytes=5 * 10**6,
                                           cache_dir=str(Path(tmp) / "bpe")))
            base["tokenizer"] = str(trained)
        print(f"{args.mb} MB of text, tokenizer {args.tokenizer}")
        for n in [int(x) for x in args.num_proc.split(",")]:
            cfg = {**base, "num_proc": n, "cache_dir": str(Path(tmp) / f"cache{n}")}
            out, reader, total = measure([sys.executable, "-c", _CHILD, json.dumps(cfg)])
            r = json.loads(out.strip().splitlines()[-1])
            print(f"num_proc={n}: {r['seconds']:.1f} s, {args.mb / r['seconds']:.2f} MB/s, "
                  f"{r['tokens'] / 1e6:.1f} M tokens, peak RSS: reading process {reader:.0f} MiB, "
                  f"with its workers {total:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
