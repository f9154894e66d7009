"""Dense train step (forward + backward) in tokens/s: openpretrain's DenseLM vs transformers' ApertusForCausalLM.

All sides hold the same weights (`to_hf`), see the same batch and the same loss, and are timed alternately in one
process after a warm-up (the compiled side's warm-up compiles). Sides: our eager model, our model with compiled
blocks (`build(compile=True)`, how the training loop runs it) and transformers' eager model. Also prints the FLOP/s
our compiled step achieves against this machine's measured fp32 matmul peak.
Run: OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_dense.py [--reps 5] [--d-model 512]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from openpretrain.models.dense import DenseConfig, build, to_hf, train_flops_per_token
from train_step import step_time


def matmul_flops(n: int = 2048) -> float:
    "Measured fp32 FLOP/s of one n×n×n matmul on this machine, now."
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = time.perf_counter()
    a @ b
    return 2 * n**3 / (time.perf_counter() - t)




def main(reps: int = 5, d_model: int = 512, n_layers: int = 4, seq: int = 512, batch: int = 2, vocab: int = 8192):
    torch.manual_seed(0)
    config = DenseConfig(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=d_model // 64, n_kv_heads=2,
                         mlp_hidden=int(5.25 * d_model), max_seq_len=seq, init_std=0.02)
    eager = build(config)
    ref = to_hf(eager)
    ref.config.use_cache = False
    fused = build(config, compile=True)
    fused.load_state_dict(eager.state_dict())
    ids = torch.randint(0, vocab, (batch, seq + 1))
    sides = {"ours (compiled blocks)": (fused, fused.parameters), "ours (eager)": (eager, eager.parameters),
             "transformers": (lambda x: ref(x).logits, ref.parameters)}
    times, peaks = {k: [] for k in sides}, []
    for rep in range(reps + 1):  # rep 0 is the warm-up
        for name, (fwd, params) in sides.items():
            dt = step_time(fwd, list(params()), ids)
            if rep:
                times[name].append(dt)
        peaks.append(matmul_flops())  # the peak is measured between steps: the machine is shared
    tps = {k: batch * seq / statistics.median(v) for k, v in times.items()}
    ours_tps, eager_tps, ref_tps = tps.values()
    flops = train_flops_per_token(config, seq) * ours_tps
    peak = statistics.median(peaks)
    print(f"config: d_model {d_model}, {n_layers} layers, {config.n_heads}/{config.n_kv_heads} heads, "
          f"mlp {config.mlp_hidden}, vocab {vocab}, batch {batch}x{seq}, fp32, {torch.get_num_threads()} threads")
    print(f"achieved {flops / 1e9:.1f} GFLOP/s of a measured fp32 matmul peak of {peak / 1e9:.1f} GFLOP/s "
          f"-> {100 * flops / peak:.0f}% (train FLOPs = 6 x matmul params + causal attention)")
    print(f"ours (eager) {eager_tps:.0f} tok/s | transformers {ref_tps:.0f} tok/s | ratio {eager_tps / ref_tps:.2f}x")
    print(f"ours {ours_tps:.0f} tok/s | transformers {ref_tps:.0f} tok/s | ratio {ours_tps / ref_tps:.2f}x "
          f"(median of {reps})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()
    main(args.reps, args.d_model, args.n_layers, args.seq, args.batch)
