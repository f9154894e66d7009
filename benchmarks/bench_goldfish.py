"""Goldfish masking overhead: the mask of one micro-batch vs one train step of the tiny model on it.

Both are measured alternately in one process on the same real rows of the tiny curriculum (the loader's packed
labels), after a warm-up; the mask for each key (hash-table, rolling, canonical), the step as `train_step.step_time`
(forward + backward of the next-token loss) of the tiny preset's dense model. Apertus applies the mask in the
data loader, once per micro-batch, so the ratio is the share of a step the mask adds (target: < 1 %).
Run: OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_goldfish.py [--reps 7] [--batch 8]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from openpretrain.core import load_preset
from openpretrain.models.registry import build_model
from openpretrain.tokenization import load_tokenizer
from openpretrain.training.goldfish import STRATEGIES, GoldfishConfig, canonical_vocab, goldfish_mask
from openpretrain.training.plan import plan, token_loader
from timing import step_time


def mask_time(labels: torch.Tensor, config: GoldfishConfig, strategy: str, vocab) -> float:
    "Seconds to compute one micro-batch's keep-mask."
    t = time.perf_counter()
    goldfish_mask(labels, config.k, config.h, strategy, vocab=vocab)
    return time.perf_counter() - t


def main(reps: int = 7, batch: int = 8, preset: str = "tiny"):
    torch.manual_seed(0)
    p = load_preset(preset)
    p.raw["train"].update(micro_batch=batch)                        # one micro-batch of `batch` rows per step
    p.raw["optim"].update(batch_size=batch, batch_increase_at=[], batch_increase_to=[])
    pl = plan(p)
    model, config, tok = build_model(pl.model), pl.goldfish, load_tokenizer(pl.tokenizer)
    vocab = canonical_vocab(tok)
    b = token_loader(pl, tok).next_batch()
    ids = torch.cat([b.input_ids, b.labels[:, -1:]], 1)  # (B, L+1): step_time shifts it into inputs and labels
    steps, masks = [], {s: [] for s in STRATEGIES}
    for rep in range(reps + 1):  # rep 0 is the warm-up
        for s in STRATEGIES:
            dt = mask_time(b.labels, config, s, vocab)
            if rep:
                masks[s].append(dt)
        dt = step_time(model, list(model.parameters()), ids)
        if rep:
            steps.append(dt)
    step = statistics.median(steps)
    print(f"preset {preset}: micro-batch {batch}x{b.labels.shape[1]}, k={config.k}, h={config.h}, "
          f"{torch.get_num_threads()} threads; train step (fwd+bwd) {step * 1e3:.1f} ms")
    for s in STRATEGIES:
        m = statistics.median(masks[s])
        print(f"mask {s} {m * 1e3:.2f} ms | train step {step * 1e3:.1f} ms | ratio {100 * m / step:.2f}%")
    m = statistics.median(masks[config.strategy])
    print(f"mask ({config.strategy}, the preset's) {m * 1e3:.2f} ms | train step {step * 1e3:.1f} ms | "
          f"ratio {100 * m / step:.2f}% (median of {reps})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--preset", default="tiny")
    args = ap.parse_args()
    main(args.reps, args.batch, args.preset)
