"""Hybrid train step (forward + backward) in tokens/s, ours vs transformers' NemotronHForCausalLM (torch path),
and the chunked SSD against the sequential recurrence it equals.

All sides hold the same weights (`to_hf`), see the same batch and the same loss, and are timed in one process after a
warm-up, alternating (the order turns every repetition; the compiled side's warm-up compiles), with the process set
up as the trainer's start_run sets it on CPU: glibc keeping freed memory (`keep_freed_memory`) and denormal floats
flushed (`flushing_denormals`); the ratios of the best and of the median steps are printed. Sides: our eager model,
transformers' eager model, both again under the trainer's bf16 autocast where this device trains in bf16
(`training_precision`; each compared with transformers at its own precision) and, with --compile, our model with
compiled non-MoE blocks (`build(compile=True)`). One Mamba-2 layer of the model is also timed with denormals flushed
and computed. The SSD comparison runs the scan of one Soofi-sized Mamba-2 layer (forward, chunk 128) at L = 2048:
the recurrence, the chunked form eager, and the chunked form compiled by inductor (what a compiled block runs). On
CPU, one profiled run of each side splits its time into matrix products (mm, bmm, addmm: the same products on both
sides) and everything else, and prints the ratio we would reach if everything else cost nothing: an upper bound on
any speed-up of our element-wise, scan and dispatch code. Last, what the rest of the machine did while the sides
were timed.
Run: OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_hybrid.py [--reps 3] [--compile] [--device cuda]
"""
from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F

from openpretrain.models.hybrid import HybridConfig, build, to_hf
from openpretrain.models.mamba2 import ssd_chunked, ssd_recurrent
from openpretrain.training.parallel import flushing_denormals, keep_freed_memory
from timing import (MachineLoad, alternate, bf16_sides, matmul_bound, matmul_share, reference_of, step_time,
                    timed)

# a small Soofi-shaped hybrid: every layer kind, Soofi's chunk, 32 experts top-4
CONFIG = HybridConfig(vocab_size=8192, d_model=512, pattern="MEMEM*EMEM-", n_heads=8, n_kv_heads=2, head_dim=64,
                      mamba_heads=16, mamba_head_dim=64, mamba_groups=2, mamba_state=64, mamba_chunk=128,
                      n_experts=32, top_k=4, expert_hidden=256, shared_hidden=512, mlp_hidden=1024, aux_loss_coef=0.0)


def model_step(reps: int, batch: int, seq: int, device: str, compile: bool) -> dict[str, float]:
    "Median train-step tokens/s of each side on a small Soofi-shaped hybrid."
    torch.manual_seed(0)
    eager = build(CONFIG, device=device).train()
    ref = to_hf(eager).to(device).train()
    ref.config.use_cache = False
    ids = torch.randint(0, CONFIG.vocab_size, (batch, seq + 1), device=device)
    sides = {"ours (eager)": (eager, eager.parameters), "transformers": (lambda x: ref(x).logits, ref.parameters)}
    sides |= bf16_sides(sides, device)
    if compile:
        fused = build(CONFIG, device=device, compile=True).train()
        fused.load_state_dict(eager.state_dict())
        sides["ours (compiled blocks)"] = (fused, fused.parameters)
    with torch.no_grad():   # the same function on every fp32 side
        for name, (fwd, _) in sides.items():
            assert name.endswith(", bf16") or (fwd(ids) - eager(ids)).abs().max() < 1e-3
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    steps = {name: partial(step_time, fwd, list(params()), ids, sync) for name, (fwd, params) in sides.items()}
    times = alternate(steps, reps)
    print(f"model: d_model {CONFIG.d_model}, pattern {CONFIG.pattern}, {CONFIG.n_experts} experts top-{CONFIG.top_k}, "
          f"batch {batch}x{seq}, {device}, {torch.get_num_threads()} threads")
    if device == "cpu":
        for name in ("ours (eager)", "ours (eager), bf16"):
            if name in steps:
                print(matmul_bound(steps, times, name, reference_of(name)))
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


def denormal_times(reps: int, batch: int, seq: int) -> dict[str, list[float]]:
    "Seconds of forward + backward of the model's first Mamba-2 layer with denormals flushed and computed (CPU)."
    torch.manual_seed(0)
    layer = build(CONFIG).layers[0].train()
    x = torch.randn(batch, seq, CONFIG.d_model)
    def side(flush: bool):
        def run() -> float:
            with flushing_denormals(flush):
                t = time.perf_counter()
                layer(x, None).square().mean().backward()
                return time.perf_counter() - t
        return run
    return alternate({"flushed": side(True), "computed": side(False)}, reps)


def main(reps: int = 3, batch: int = 2, seq: int = 512, device: str = "cpu", compile: bool = False):
    keep_freed_memory()   # what the trainer's start_run sets on CPU; process-wide, so every side shares it
    with flushing_denormals(), MachineLoad() as load:   # the trainer's CPU float mode, for every side
        tps = model_step(reps, batch, seq, device, compile)
        denormals = denormal_times(2 * reps + 1, batch, seq) if device == "cpu" else {}
        ssd, share = ssd_times(2 * reps + 1)
    ssd = {k: statistics.median(v) for k, v in ssd.items()}
    recurrent = ssd.pop("recurrent")
    for name, seconds in ssd.items():
        print(f"SSD at L=2048: {name} {seconds * 1e3:.1f} ms | recurrent {recurrent * 1e3:.1f} ms | "
              f"ratio {recurrent / seconds:.1f}x (median of {2 * reps + 1})")
    print(f"SSD bound: matrix products are {100 * share:.0f}% of the eager chunked scan; recurrent / their time = "
          f"{recurrent / (ssd['chunked'] * share):.1f}x (the ratio if every other op cost nothing)")
    if denormals:
        flushed, computed = (statistics.median(denormals[k]) for k in ("flushed", "computed"))
        print(f"one Mamba-2 layer, forward + backward: denormals flushed {flushed * 1e3:.1f} ms | computed "
              f"{computed * 1e3:.1f} ms | ratio {computed / flushed:.2f}x (median of {2 * reps + 1})")
    ours_sides = {name: v for name, v in tps.items() if not name.startswith("transformers")}
    for name, ours in ours_sides.items():   # the best step is the one least disturbed by the machine's other load
        ref_name = reference_of(name)
        ref = tps[ref_name]
        print(f"{name} {max(ours):.0f} tok/s | {ref_name} {max(ref):.0f} tok/s | "
              f"ratio {max(ours) / max(ref):.2f}x (best of {reps})")
        print(f"{name} {statistics.median(ours):.0f} tok/s | {ref_name} {statistics.median(ref):.0f} tok/s | "
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
