"""Peak memory per token of a long-context training step on CPU, with and without activation checkpointing.

Chapter 11b's dense model (d 64, 2 layers, 2,048 ids) takes one optimizer step of 4,096 tokens — the stages' batch
— as rows of L = 256 … 4,096 tokens, each row holding two documents (so the document mask is in play), through the
trainer's own `train_step`. Each (L, checkpointing) point runs in a fresh process: the step's memory is the rise of
the process's peak resident set (ru_maxrss) over its resident set just before the step, divided by the tokens of
the step; the step's wall time is beside it. The reference is the same step without checkpointing, measured in
the same run. What grows with L at a constant 4,096 tokens per step is attention's (L × L) part: the scores and
the mask, per head and row.
Run: OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_long_context.py [--lengths 256 512 1024 2048 4096]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from types import SimpleNamespace

TOKENS = 4096                                                           # per optimizer step, as chapter 11b's stages
SIZE = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=336, vocab_size=2048)


def rss_bytes() -> int:
    "This process's resident set now (Linux /proc)."
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def one_step(length: int, checkpointing: bool) -> dict:
    "One train_step of TOKENS tokens in rows of `length`: peak memory rise per token and seconds."
    import torch

    from openpretrain.core import load_preset, seed_everything
    from openpretrain.models.registry import build_model
    from openpretrain.training.data import pack_rows
    from openpretrain.training.optim import build_optimizer
    from openpretrain.training.parallel import parallelize
    from openpretrain.training.plan import plan
    from openpretrain.training.trainer import PRETRAINING, Run, train_step
    p = load_preset("tiny")
    rows = TOKENS // length
    p.raw["model"].update(SIZE, max_seq_len=length)
    p.raw["tokenizer"].update(name="bpe-bal-2k", vocab_size=2048)
    p.raw["data"].update(seq_len=length)
    p.raw["optim"].update(batch_size=rows, batch_increase_at=[], batch_increase_to=[])
    p.raw["train"].update(micro_batch=rows, precision="fp32", activation_checkpointing=checkpointing)
    pl = plan(p, max_steps=1)
    seed_everything(0)
    cpu = SimpleNamespace(num_processes=1, device=torch.device("cpu"), backward=lambda loss: loss.backward())
    model = parallelize(build_model(pl.model), pl.train, cpu)
    ids = torch.randint(4, 2048, (rows, length + 1), generator=torch.Generator().manual_seed(0)).numpy()
    ids[:, 0], ids[:, length // 2] = 1, 1                                  # BoD at the start and mid-row: two documents
    batch = pack_rows(ids, bod=1, eod=2)
    run = Run(pl, model, build_optimizer(model, pl.optim), None, cpu, None)
    train_step(run, [batch], PRETRAINING)                                  # warm-up: optimizer state, allocator pools
    before = rss_bytes()
    t = time.perf_counter()
    train_step(run, [batch], PRETRAINING)
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024      # KiB on Linux
    return {"bytes_per_token": max(peak - before, 0) / TOKENS, "seconds": seconds}


def main(lengths: list[int]) -> None:
    print(f"one step of {TOKENS:,} tokens, rows of L tokens (two documents each); fresh process per point")
    for length in lengths:
        point = {}
        for ac in (False, True):
            out = subprocess.run([sys.executable, __file__, "--one", str(length), str(int(ac))], check=True,
                                 capture_output=True, text=True).stdout
            point[ac] = json.loads(out.strip().splitlines()[-1])
        off, on = point[False], point[True]
        print(f"L = {length:5,}: {TOKENS // length:2d} rows | peak rise {off['bytes_per_token'] / 1024:7.1f} KiB/token, "
              f"checkpointed {on['bytes_per_token'] / 1024:7.1f} KiB/token, ratio {on['bytes_per_token'] / max(off['bytes_per_token'], 1):.2f} | "
              f"step {off['seconds'] * 1e3:6.0f} ms, checkpointed {on['seconds'] * 1e3:6.0f} ms, ratio {on['seconds'] / off['seconds']:.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    ap.add_argument("--one", type=int, nargs=2, help=argparse.SUPPRESS)      # a child process: one point
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_step(args.one[0], bool(args.one[1]))))
    else:
        main(args.lengths)
