"""Hybrid train step (forward + backward) in tokens/s, ours vs transformers' NemotronHForCausalLM (torch path),
and the chunked SSD against the sequential recurrence it equals.

All sides hold the same weights (`to_hf`), see the same batch and the same loss, and are timed in one process after a
warm-up, alternating (the order turns every repetition; the compiled side's warm-up compiles); the ratios of the
best and of the median steps are printed. Sides: our eager model, transformers' eager model and,
with --compile, our model with compiled non-MoE blocks (`build(compile=True)`). The SSD comparison
runs the scan of one Soofi-sized Mamba-2 layer (forward, eager, chunk 128) at L = 2048. On CPU, one profiled step of
each side splits its time into matrix products (mm, bmm, addmm: the same products on both sides) and everything
else, and prints the ratio our model would reach if everything else cost nothing: an upper bound on any speed-up
of our element-wise, scan and dispatch code.
Run: OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_hybrid.py [--reps 3] [--compile] [--device cuda]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from openpretrain.models.hybrid import HybridConfig, build, to_hf
from train_step import step_time
from openpretrain.models.mamba2 import ssd_chunked, ssd_recurrent




def model_step(reps: int, batch: int, seq: int, device: str, compile: bool) -> dict[str, float]:
    "Median train-step tokens/s of each side on a small Soofi-shaped hybrid."
    torch.manual_seed(0)
    config = HybridConfig(vocab_size=8192, d_model=512, pattern="MEMEM*EMEM-", n_heads=8, n_kv_heads=2, head_dim=64,
                          mamba_heads=16, mamba_head_dim=64, mamba_groups=2, mamba_state=64, mamba_chunk=128,
                          n_experts=32, top_k=4, expert_hidden=256, shared_hidden=512, mlp_hidden=1024,
                          aux_loss_coef=0.0)
    eager = build(config, device=device).train()
    ref = to_hf(eager).to(device).train()
    ref.config.use_cache = False
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1), device=device)
    sides = {"ours (eager)": (eager, eager.parameters), "transformers": (lambda x: ref(x).logits, ref.parameters)}
    if compile:
        fused = build(config, device=device, compile=True).train()
        fused.load_state_dict(eager.state_dict())
        sides["ours (compiled blocks)"] = (fused, fused.parameters)
    with torch.no_grad():   # the same function on every side
        for fwd, _ in sides.values():
            assert (fwd(ids) - eager(ids)).abs().max() < 1e-3
    times = {k: [] for k in sides}
    for rep in range(reps + 1):  # rep 0 is the warm-up; the sides alternate, in turned order every repetition
        for name in list(sides)[:: 1 if rep % 2 else -1]:
            fwd, params = sides[name]
            if device == "cuda":
                torch.cuda.synchronize()
            dt = step_time(fwd, list(params()), ids)
            if device == "cuda":
                torch.cuda.synchronize()
            if rep:
                times[name].append(dt)
    print(f"model: d_model {config.d_model}, pattern {config.pattern}, {config.n_experts} experts top-{config.top_k}, "
          f"batch {batch}x{seq}, fp32, {device}, {torch.get_num_threads()} threads")
    if device == "cpu":
        print_matmul_bound({k: matmul_share(*sides[k], ids) for k in ("ours (eager)", "transformers")},
                           {k: statistics.median(v) for k, v in times.items()})
    return {k: [batch * seq / t for t in v] for k, v in times.items()}   # tokens/s of every timed step


MATMULS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm"}


def matmul_share(fwd, params, ids: torch.Tensor) -> float:
    "Share of one profiled train step's CPU time spent in matrix products."
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step_time(fwd, list(params()), ids)
    events = prof.key_averages()
    return sum(e.self_cpu_time_total for e in events if e.key in MATMULS) / sum(e.self_cpu_time_total for e in events)


def print_matmul_bound(share: dict[str, float], step: dict[str, float]) -> None:
    "Matmul shares, and transformers' step over our matmul time: our ratio if all our other ops were free."
    ours, ref = "ours (eager)", "transformers"
    print(f"matrix products: {100 * share[ours]:.0f}% of our step, {100 * share[ref]:.0f}% of transformers'; "
          f"transformers' step / our matmul time = {step[ref] / (step[ours] * share[ours]):.2f}x "
          "(the ratio if every other op of ours cost nothing)")


def ssd_time(reps: int, L: int = 2048) -> tuple[float, float]:
    "Median seconds of (chunked, recurrent) SSD for one Soofi Mamba-2 layer: 64 heads × 64, 8 groups, state 128."
    gen = torch.Generator().manual_seed(0)
    h, p, g, n = 64, 64, 8, 128
    x, B, C = torch.randn(1, L, h, p, generator=gen), torch.randn(1, L, g, n, generator=gen), torch.randn(1, L, g, n, generator=gen)
    dt, A, D = F.softplus(torch.randn(1, L, h, generator=gen) - 3), -torch.rand(h, generator=gen), torch.ones(h)
    times = {"chunked": [], "recurrent": []}
    with torch.no_grad():
        for rep in range(reps + 1):
            for name, fn in (("chunked", lambda: ssd_chunked(x, dt, A, B, C, D, 128)),
                             ("recurrent", lambda: ssd_recurrent(x, dt, A, B, C, D))):
                t = time.perf_counter()
                fn()
                if rep:
                    times[name].append(time.perf_counter() - t)
    return statistics.median(times["chunked"]), statistics.median(times["recurrent"])


def main(reps: int = 3, batch: int = 2, seq: int = 512, device: str = "cpu", compile: bool = False):
    tps = model_step(reps, batch, seq, device, compile)
    chunked, recurrent = ssd_time(reps)
    ref = tps.pop("transformers")
    print(f"SSD at L=2048: chunked {chunked * 1e3:.1f} ms | recurrent {recurrent * 1e3:.1f} ms | "
          f"ratio {recurrent / chunked:.1f}x (median of {reps})")
    for name, ours in tps.items():   # the best step is the one least disturbed by the machine's other load
        print(f"{name} {max(ours):.0f} tok/s | transformers {max(ref):.0f} tok/s | "
              f"ratio {max(ours) / max(ref):.2f}x (best of {reps})")
        print(f"{name} {statistics.median(ours):.0f} tok/s | transformers {statistics.median(ref):.0f} tok/s | "
              f"ratio {statistics.median(ours) / statistics.median(ref):.2f}x (median of {reps})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compile", action="store_true", help="also time our model with compiled blocks (slow warm-up)")
    args = ap.parse_args()
    main(args.reps, args.batch, args.seq, args.device, args.compile)
