"""Compliance pipeline throughput (docs/s): 2 workers vs 1 worker, same input, same process, median of N.

    OMP_NUM_THREADS=1 python benchmarks/bench_compliance.py [--docs 8000] [--reps 3]

Both sides run the real pipeline (reader → quarantine → robots → toxicity with USE v3 → PII → writer) under
LocalPipelineExecutor with 4 tasks on the same real-text input (the weak-label fortunes, FineWeb-schema JSONL);
only `workers` differs. Thresholds are fixed so that calibration is not timed. The embedding cache
(`$OPENPRETRAIN_EMBEDDING_CACHE`) points into the temporary folder and is emptied before every run, so each run
embeds from scratch. Target: ratio ≥ 1.8×.
"""
import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import pandas as pd

from openpretrain.compliance.pipeline import build_pipeline, make_executor
from openpretrain.compliance.toxicity import load_weak_labels

ISO = {"en": "eng", "de": "deu", "it": "ita", "es": "spa"}
SNAPSHOT = pd.DataFrame([{"host": "blocked.example.org", "http_status": 200, "fetched_at": "2025-01-15",
                          "body": b"User-agent: GPTBot\nDisallow: /\n"}])


def write_input(folder: Path, n: int, shards: int = 4) -> None:
    weak = load_weak_labels().sample(n, replace=n > 8980, random_state=0).reset_index(drop=True)
    folder.mkdir(parents=True)
    files = [open(folder / f"part-{k}.jsonl", "w") for k in range(shards)]
    for i, row in weak.iterrows():
        host = "blocked.example.org" if i % 20 == 0 else "open.example.org"
        doc = {"text": row.text, "id": f"d{i}", "url": f"https://{host}/{i}", "language": ISO[row.lang],
               "token_count": len(row.text.split())}
        files[i % shards].write(json.dumps(doc, ensure_ascii=False) + "\n")
    for f in files:
        f.close()


def run_once(inp: Path, out: Path, workers: int, tasks: int = 4) -> float:
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(os.environ["OPENPRETRAIN_EMBEDDING_CACHE"], ignore_errors=True)  # cold: nothing cached
    pipe = build_pipeline(inp, out, "tiny", robots_snapshot=SNAPSHOT, thresholds={"*": 0.9})
    t0 = time.perf_counter()
    make_executor(pipe, "local", tasks=tasks, workers=workers, logging_dir=out / "logs").run()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=8000)  # worker start-up (~1 s: imports, USE) amortised
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from datatrove.utils.logging import logger
    logger.remove()  # datatrove logs every task; keep the benchmark output readable
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["OPENPRETRAIN_EMBEDDING_CACHE"] = str(Path(tmp) / "embeddings")  # before any worker starts
        inp = Path(tmp) / "in"
        write_input(inp, args.docs)
        run_once(inp, Path(tmp) / "warm", workers=2)  # warm-up: page cache, forkserver, model files
        rates = {1: [], 2: []}
        for _ in range(args.reps):
            for w in (1, 2):
                rates[w].append(args.docs / run_once(inp, Path(tmp) / f"out{w}", workers=w))
        for w in (1, 2):
            print(f"workers={w}: " + ", ".join(f"{r:.0f}" for r in rates[w]) + " docs/s")
        one, two = statistics.median(rates[1]), statistics.median(rates[2])
        print(f"ours 2 workers {two:.0f} docs/s | ref 1 worker {one:.0f} docs/s | ratio {two / one:.2f}x "
              f"(median of {args.reps})")


if __name__ == "__main__":
    main()
