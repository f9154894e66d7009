"""Trainer step on CPU with and without `keep_freed_memory` (glibc malloc keeping freed pages).

One optimizer step of chapter 11a's arm size (d 64, 2 layers, 8 × 256 tokens, vocabulary 8,192, AdEMAMix) through
the trainer's own `train_step`, on real rows of the tiny curriculum. Its logits and their gradients are 67 MB each,
above glibc's 32 MB mmap ceiling; with default malloc they are mapped and page-faulted in anew every step. Both
settings are measured alternately in one process (mallopt can restore glibc's defaults), the step after each switch
untimed, after a warm-up; the median of each and the ratio are printed last, in wall and in CPU time. The numbers a
step computes are the same either way (tests/test_trainer.py::test_keeping_freed_memory_changes_no_metric).
Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_train_step.py [--reps 7] [--threads 1]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from types import SimpleNamespace

import torch

from openpretrain.core import load_preset, seed_everything
from openpretrain.models.registry import build_model
from openpretrain.tokenization import load_tokenizer
from openpretrain.training.optim import build_optimizer
from openpretrain.training.plan import plan, token_loader
from openpretrain.training.parallel import keep_freed_memory
from openpretrain.training.trainer import PRETRAINING, Run, train_step

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
ARM = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=336)   # chapter 11a's SIZE


def glibc_defaults() -> None:
    "Undo `keep_freed_memory`: glibc's documented defaults (65,536 mmaps, trim above 128 KiB)."
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_MAX, 65536)
    libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024)


def main(reps: int = 7, threads: int = 1, preset: str = "tiny"):
    torch.set_num_threads(threads)
    p = load_preset(preset)
    p.raw["model"].update(ARM)
    p.raw["train"].update(micro_batch=8)
    pl = plan(p)
    seed_everything(0)
    model = build_model(pl.model)
    batches = [token_loader(pl, load_tokenizer(pl.tokenizer)).next_batch()]
    cpu = SimpleNamespace(num_processes=1, device=torch.device("cpu"),
                          backward=lambda loss: loss.backward())
    run = Run(pl, model, build_optimizer(model, pl.optim), None, cpu, None)

    def step() -> tuple[float, float]:
        "Wall and CPU seconds (this process, user + system) of one step: on a shared machine CPU time is the steadier."
        t, c = time.perf_counter(), time.process_time()
        train_step(run, batches, PRETRAINING)
        return time.perf_counter() - t, time.process_time() - c

    times = {"glibc default": [], "keep_freed_memory": []}
    for rep in range(reps + 1):                      # the first round is a warm-up
        for name, setting in (("glibc default", glibc_defaults), ("keep_freed_memory", keep_freed_memory)):
            setting()
            step()                                   # the first step after a switch settles the heap: untimed
            t = step()
            if rep:
                times[name].append(t)
    for i, kind in enumerate(("wall", "CPU")):
        base, tuned = (statistics.median(t[i] for t in times[k]) for k in times)
        print(f"{kind:4s}: glibc default {base * 1e3:.0f} ms/step | keep_freed_memory {tuned * 1e3:.0f} ms/step | "
              f"ratio {base / tuned:.2f}x (median of {reps}, {threads} thread(s))")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    main(**vars(ap.parse_args()))
