"""Dense train step (forward + backward) in tokens/s: openpretrain's DenseLM vs transformers' ApertusForCausalLM.

All sides hold the same weights (`to_hf`), see the same batch and the same loss, and are timed in one process after a
warm-up, alternating (the order turns every repetition), with the process set up as the trainer's start_run sets it
on CPU: glibc keeping freed memory (`keep_freed_memory`: without it the reference's steps vary with page faults, and
its median with them) and denormal floats flushed (`flushing_denormals`).
Sides: our model as the trainer runs it on CPU (fp32, blocks not compiled; xIELU is the inductor-compiled formula when
a C++ compiler is found, `CXX=none` forces the eager xIELU), transformers' eager model, and both again under the
trainer's bf16 autocast where this CPU trains in bf16 (`training_precision`: AVX512-BF16 or AMX, as the tiny preset
does here); with --compile also our model with compiled blocks (`build(compile=True)`; its warm-up compiles). Each
side is compared with transformers at its own precision. Also prints the FLOP/s each of our sides achieves against
this machine's measured matmul peak in the side's precision, the ratios of the best and of the median steps, the
share of each side's step spent in matrix products with the ratio we would reach if our other ops cost nothing, and
what the rest of the machine did while the sides were timed (a median ratio is only comparable between runs on an
equally quiet machine).
Run: OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_dense.py [--reps 5] [--d-model 512] [--compile]
"""
from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from openpretrain.models.dense import DenseConfig, build, to_hf, train_flops_per_token
from openpretrain.training.parallel import flushing_denormals, keep_freed_memory
from timing import MachineLoad, alternate, bf16_sides, matmul_bound, reference_of, step_time


def matmul_flops(n: int = 2048, dtype: torch.dtype = torch.float32) -> float:
    "Measured FLOP/s of one n×n×n matmul in `dtype` on this machine, now."
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    t = time.perf_counter()
    a @ b
    return 2 * n**3 / (time.perf_counter() - t)


def peaks_now() -> dict[str, float]:
    "The matmul peak of each precision a side may run in (fp32, and bf16 for the ', bf16' sides)."
    return {"fp32": matmul_flops(), "bf16": matmul_flops(dtype=torch.bfloat16)}


def main(reps: int = 5, d_model: int = 512, n_layers: int = 4, seq: int = 512, batch: int = 2, vocab: int = 8192,
         compile: bool = False):
    keep_freed_memory()   # what the trainer's start_run sets on CPU; process-wide, so every side shares it
    torch.manual_seed(0)
    config = DenseConfig(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=d_model // 64, n_kv_heads=2,
                         mlp_hidden=int(5.25 * d_model), max_seq_len=seq, init_std=0.02)
    eager = build(config)
    ref = to_hf(eager)
    ref.config.use_cache = False
    ids = torch.randint(0, vocab, (batch, seq + 1))
    sides = {"ours": (eager, eager.parameters), "transformers": (lambda x: ref(x).logits, ref.parameters)}
    sides |= bf16_sides(sides, "cpu")
    if compile:
        fused = build(config, compile=True)
        fused.load_state_dict(eager.state_dict())
        sides["ours (compiled blocks)"] = (fused, fused.parameters)
    with torch.no_grad():   # the same function on every fp32 side
        for name, (fwd, _) in sides.items():
            assert name.endswith(", bf16") or (fwd(ids) - eager(ids)).abs().max() < 1e-3
    steps = {name: partial(step_time, fwd, list(params()), ids) for name, (fwd, params) in sides.items()}
    peaks = []   # the peak is measured between rounds: the machine is shared
    with flushing_denormals(), MachineLoad() as load:   # the trainer's CPU float mode, for every side
        times = alternate(steps, reps, between=lambda: peaks.append(peaks_now()))
        bounds = [matmul_bound(steps, times, name, reference_of(name))
                  for name in ("ours", "ours, bf16") if name in steps]
    ours = {name: ts for name, ts in times.items() if not name.startswith("transformers")}
    flops_per_token = train_flops_per_token(config, seq)
    print(f"config: d_model {d_model}, {n_layers} layers, {config.n_heads}/{config.n_kv_heads} heads, "
          f"mlp {config.mlp_hidden}, vocab {vocab}, batch {batch}x{seq}, {torch.get_num_threads()} threads")
    for name, ts in ours.items():
        precision = "bf16" if name.endswith(", bf16") else "fp32"
        peak, tps = statistics.median(p[precision] for p in peaks), batch * seq / statistics.median(ts)
        print(f"{name}: {flops_per_token * tps / 1e9:.1f} GFLOP/s of a measured {precision} matmul peak of "
              f"{peak / 1e9:.1f} GFLOP/s -> {100 * flops_per_token * tps / peak:.0f}% "
              f"(train FLOPs = 6 x matmul params + causal attention)")
    for name, ts in ours.items():   # the best step is the one least disturbed by the machine's other load
        ref, ref_times = reference_of(name), times[reference_of(name)]
        print(f"{name} {batch * seq / min(ts):.0f} tok/s | {ref} {batch * seq / min(ref_times):.0f} tok/s | "
              f"ratio {min(ref_times) / min(ts):.2f}x (best of {reps})")
        print(f"{name} {batch * seq / statistics.median(ts):.0f} tok/s | {ref} "
              f"{batch * seq / statistics.median(ref_times):.0f} tok/s | "
              f"ratio {statistics.median(ref_times) / statistics.median(ts):.2f}x (median of {reps})")
    print("\n".join(bounds))
    print(load.report())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="also time our model with compiled blocks (slow warm-up)")
    args = ap.parse_args()
    main(args.reps, args.d_model, args.n_layers, args.seq, args.batch, compile=args.compile)
