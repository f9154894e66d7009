"""Hybrid train step (forward + backward) in tokens/s, ours vs transformers' NemotronHForCausalLM (torch path),
and the chunked SSD against the sequential recurrence it equals.

All sides hold the same weights (`to_hf`), see the same batch and the same loss, and are timed in one process after a
warm-up, alternating (the order turns every repetition; the compiled side's warm-up compiles), with glibc keeping
freed memory as the trainer sets it (`keep_freed_memory`); the ratios of the
best and of the median steps are printed. Sides: our eager model, transformers' eager model and,
with --compile, our model with compiled non-MoE blocks (`build(compile=True)`). The SSD comparison
runs the scan of one Soofi-sized Mamba-2 layer (forward, chunk 128) at L = 2048: the recurrence, the chunked form
eager, and the chunked form compiled by inductor (what a compiled block runs). On CPU, one profiled run of
each side splits its time into matrix products (mm, bmm, addmm: the same products on both sides) and everything
else, and prints the ratio we would reach if everything else cost nothing: an upper bound on any speed-up
of our element-wise, scan and dispatch code. Last, what the rest of the machine did while the sides were timed.
Run: OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_hybrid.py [--reps 3] [--compile] [--device cuda]
"""
from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
import torch.nn.functional as F

from openpretrain.models.hybrid import HybridConfig, build, to_hf
from openpretrain.models.mamba2 import ssd_chunked, ssd_recurrent
from openpretrain.training.parallel import keep_freed_memory
from timing import MachineLoad, alternate, matmul_bound, matmul_share, step_time, timed


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
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    steps = {name: partial(step_time, fwd, list(params()), ids, sync) for name, (fwd, params) in sides.items()}
    times = alternate(steps, reps)
    print(f"model: d_model {config.d_model}, pattern {config.pattern}, {config.n_experts} experts top-{config.top_k}, "
          f"batch {batch}x{seq}, fp32, {device}, {torch.get_num_threads()} threads")
    if device == "cpu":
        print(matmul_bound(steps, times, "ours (eager)"))
    return {k: [batch * seq / t for t in v] for k, v in times.items()}   # tokens/s of every timed step


def ssd_times(reps: int, L: int = 2048) -> tuple[dict[str, list[float]], float]:
    "Seconds of one Soofi Mamba-2 layer's scan (64 heads × 64, 8 groups, state 128) per side, and the chunked matmul share."
    gen = torch.Generator().manual_seed(0)
    h, p, g, n = 64, 64, 8, 128
    x, B, C = (torch.randn(1, L, *shape, generator=gen) for shape in ((h, p), (g, n), (g, n)))
    dt, A, D = F.softplus(torch.randn(1, L, h, generator=gen) - 3), -torch.rand(h, generator=gen), torch.ones(h)
    compiled = torch.compile(ssd_chunked, dynamic=False)
    sides = {"chunked": lambda: ssd_chunked(x, dt, A, B, C, D, 128),
             "chunked, compiled": lambda: compiled(x, dt, A, B, C, D, 128),
             "recurrent": lambda: ssd_recurrent(x, dt, A, B, C, D)}
    with torch.no_grad():
        return alternate({k: timed(fn) for k, fn in sides.items()}, reps), matmul_share(sides["chunked"])


def main(reps: int = 3, batch: int = 2, seq: int = 512, device: str = "cpu", compile: bool = False):
    keep_freed_memory()   # what the trainer's start_run sets on CPU; process-wide, so both sides share it
    with MachineLoad() as load:
        tps = model_step(reps, batch, seq, device, compile)
        ssd, share = ssd_times(2 * reps + 1)
    ssd = {k: statistics.median(v) for k, v in ssd.items()}
    recurrent = ssd.pop("recurrent")
    for name, seconds in ssd.items():
        print(f"SSD at L=2048: {name} {seconds * 1e3:.1f} ms | recurrent {recurrent * 1e3:.1f} ms | "
              f"ratio {recurrent / seconds:.1f}x (median of {2 * reps + 1})")
    print(f"SSD bound: matrix products are {100 * share:.0f}% of the eager chunked scan; recurrent / their time = "
          f"{recurrent / (ssd['chunked'] * share):.1f}x (the ratio if every other op cost nothing)")
    ref = tps.pop("transformers")
    for name, ours in tps.items():   # the best step is the one least disturbed by the machine's other load
        print(f"{name} {max(ours):.0f} tok/s | transformers {max(ref):.0f} tok/s | "
              f"ratio {max(ours) / max(ref):.2f}x (best of {reps})")
        print(f"{name} {statistics.median(ours):.0f} tok/s | transformers {statistics.median(ref):.0f} tok/s | "
              f"ratio {statistics.median(ours) / statistics.median(ref):.2f}x (median of {reps})")
    print(load.report())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compile", action="store_true", help="also time our model with compiled blocks (slow warm-up)")
    args = ap.parse_args()
    main(args.reps, args.batch, args.seq, args.device, args.compile)
