"""Soofi Eq. 1 decode throughput of the tiny dense and tiny hybrid models at a short and a long context (chapter 14).

Target: the hybrid's aggregate decode tokens/s at the longest context / at the shortest ≥ 0.8 (Soofi S: flat from 4K
to 256K), while the dense model's falls. Both models are timed in one process with the same protocol — B prompts of
each context, t(O_short = 1) and t(O_long) interleaved, the median of --reps kept after a warm-up — through
`openpretrain.evaluation.serving.serving_sweep` (the models' own caches, batched greedy `generate`).
Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_serving.py [--reps 3] [--contexts 128 2048] [--device cuda]
"""
from __future__ import annotations

import argparse

import torch

from openpretrain.core import load_preset
from openpretrain.models.registry import model_config
from openpretrain.evaluation.serving import ServingConfig, run_serving, tps_ratio


def main() -> None:
    tiny = load_preset("tiny").section("serving", ServingConfig)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--contexts", type=int, nargs="+", default=[min(tiny.contexts), max(tiny.contexts)])
    ap.add_argument("--batch", type=int, default=tiny.batch)
    ap.add_argument("--o-long", type=int, default=tiny.o_long)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    cfg = ServingConfig(models=tiny.models, batch=args.batch, o_long=args.o_long, contexts=sorted(args.contexts),
                        reps=args.reps, dtype="float32" if args.device == "cpu" else "bfloat16")
    with torch.no_grad():
        timings = run_serving(cfg, {m: model_config(load_preset(m)) for m in cfg.models}, args.device)
    for row in timings.itertuples():
        print(f"{row.preset:12s} context {row.context:6d}: t(1) {row.t_short_s:7.3f} s, t({cfg.o_long}) "
              f"{row.t_long_s:7.3f} s → {row.decode_tps:8.1f} tok/s")
    ratio = tps_ratio(timings)
    dense, hybrid = (next(p for p, a in zip(timings.preset, timings.arch) if a == kind) for kind in ("dense", "hybrid"))
    lo, hi = cfg.contexts[0], cfg.contexts[-1]
    print(f"decode TPS at {hi} / at {lo} tokens (B = {cfg.batch}, O_long = {cfg.o_long}, median of {cfg.reps}): "
          f"dense {ratio[dense]:.2f} | hybrid {ratio[hybrid]:.2f} | target hybrid ≥ 0.8 "
          f"{'met' if ratio[hybrid] >= 0.8 else 'MISSED'}, dense falls {'yes' if ratio[dense] < 1 else 'NO'}")


if __name__ == "__main__":
    main()
