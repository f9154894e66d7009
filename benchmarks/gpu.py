"""One-GPU benchmark (`make bench-gpu`): bf16 MFU of a ~1B dense train step, Triton xIELU vs PyTorch, the hybrid.

Sections, each skipped with a reason when its pieces are missing, all inside a ~4-minute budget:
1. measured bf16 matmul peak (8192³) next to the nominal H100/H200 dense peak;
2. the gpu-1 preset's dense model (~1B), forward + backward in bf16: tokens/s and MFU, eager and with compiled
   blocks, and transformers' ApertusForCausalLM with the same weights and batch;
3. the fused Triton xIELU kernel against the PyTorch formula (forward + backward time, max error);
4. the Soofi-width hybrid (fewer layers) train step, and mamba-ssm's fused SSD against ours, when they import;
5. Soofi Eq. 1 decode throughput of gpu-1's `serving:` models (B = 32, O_long = 1024), context by context until OOM.
Run on the GPU machine from the repo root: python benchmarks/gpu.py
"""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "lib"), str(ROOT)]  # a bare GPU machine: run from the checkout without installing
NOMINAL_BF16 = 989e12  # H100/H200 SXM dense bf16 FLOP/s
BUDGET_S = 225.0
START = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - START


def cuda_time(fn, reps: int, warmup: int = 2) -> float:
    "Median seconds of fn() over `reps` runs, timed with CUDA events after `warmup` runs."
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def section(title: str):
    "Run a section, print its failure instead of stopping, skip it when the budget is spent."
    def wrap(fn):
        print(f"\n== {title}", flush=True)
        if elapsed() > BUDGET_S:
            print(f"skipped: {elapsed():.0f}s of the {BUDGET_S:.0f}s budget spent")
            return None
        try:
            return fn()
        except Exception as e:  # a benchmark of optional pieces reports and goes on
            print(f"failed: {type(e).__name__}: {e}")
        finally:
            torch.cuda.empty_cache()
    return wrap


def train_step(forward, params, ids):
    "Forward + backward of the next-token loss (grads reset to None)."
    def step():
        for p in params:
            p.grad = None
        logits = forward(ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
    return step


def matmul_peak() -> float:
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    peak = 2 * 8192**3 / cuda_time(lambda: a @ b, reps=10, warmup=3)
    print(f"measured {peak / 1e12:.0f} TFLOP/s (nominal {NOMINAL_BF16 / 1e12:.0f})")
    return peak


def dense(peak: float | None):
    from openpretrain.core import load_preset
    from openpretrain.models.common import param_counts
    from openpretrain.models.dense import DenseConfig, build, to_hf, train_flops_per_token

    config = load_preset("gpu-1").section("model", DenseConfig)
    batch, seq = 4, 4096
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1), device="cuda")
    flops = train_flops_per_token(config, seq) * batch * seq
    model = build(config, device="cuda", dtype=torch.bfloat16)
    print(f"gpu-1 model: {param_counts(model)['total'] / 1e9:.2f}B parameters, batch {batch}x{seq}, bf16")
    rows = {}

    def report(name, seconds):
        rows[name] = batch * seq / seconds
        mfu = flops / seconds
        vs = f", {100 * mfu / peak:.0f}% of measured" if peak else ""
        print(f"{name}: {rows[name]:,.0f} tok/s, {mfu / 1e12:.0f} TFLOP/s = MFU {100 * mfu / NOMINAL_BF16:.0f}%"
              f" of nominal{vs}", flush=True)

    report("ours (eager)", cuda_time(train_step(model, list(model.parameters()), ids), reps=5))
    doc_ids = torch.arange(seq, device="cuda").div(seq // 8, rounding_mode="floor").expand(batch, seq)
    report("ours (eager), 8 packed documents per row",
           cuda_time(train_step(lambda x: model(x, doc_ids=doc_ids), list(model.parameters()), ids), reps=5))
    def transformers_step_time() -> float:  # its copy of the weights is freed on return
        ref = to_hf(model)
        ref.config.use_cache = False
        return cuda_time(train_step(lambda x: ref(x).logits, list(ref.parameters()), ids), reps=5)
    report("transformers ApertusForCausalLM", transformers_step_time())
    torch.cuda.empty_cache()
    if elapsed() < 90:
        for block in model.layers:
            block.compile()
        t = time.perf_counter()
        step = train_step(model, list(model.parameters()), ids)
        step()
        torch.cuda.synchronize()
        print(f"(compiling the blocks took {time.perf_counter() - t:.0f}s)")
        report("ours (compiled blocks)", cuda_time(step, reps=5))
    ours = max(v for k, v in rows.items() if k.startswith("ours"))
    print(f"ours {ours:,.0f} tok/s | transformers {rows['transformers ApertusForCausalLM']:,.0f} tok/s | "
          f"ratio {ours / rows['transformers ApertusForCausalLM']:.2f}x (median of 5)")


def xielu_kernel():
    from openpretrain_kernels.xielu import xielu_triton
    from openpretrain.models.dense import XIELU, xielu_reference

    act = XIELU().cuda()
    x = torch.randn(4 * 4096, 10752, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ap, an = (p.detach().bfloat16().requires_grad_() for p in (act.alpha_p, act.alpha_n))
    dy = torch.randn_like(x)

    def run(fn):
        return lambda: torch.autograd.grad(fn(x, ap, an), [x, ap, an], dy)
    t_ref, t_fused = cuda_time(run(xielu_reference), reps=10), cuda_time(run(xielu_triton), reps=10)
    with torch.no_grad():
        exact = xielu_reference(x.float(), ap.float(), an.float())
        err_fused = (xielu_triton(x, ap, an).float() - exact).abs().max().item()
        err_ref = (xielu_reference(x, ap, an).float() - exact).abs().max().item()
    gb = 4 * x.numel() * x.element_size() / 1e9  # fused: x read twice, dy read, y and dx written
    print(f"max |error| vs fp32 formula: fused {err_fused:.3g}, PyTorch bf16 {err_ref:.3g}")
    print(f"fused {t_fused * 1e3:.2f} ms ({gb / t_fused:,.0f} GB/s) | PyTorch {t_ref * 1e3:.2f} ms | "
          f"ratio {t_ref / t_fused:.2f}x (fwd+bwd, {x.numel() / 1e6:.0f}M bf16 elements, median of 10)")


def hybrid():
    try:
        from openpretrain.models import hybrid as hy
    except ImportError as e:
        print(f"skipped: openpretrain.models.hybrid does not import ({e})")
        return
    from openpretrain.models.common import param_counts
    config = dataclasses.replace(hy.HybridConfig(), pattern="MEM*EMEM*E")  # Soofi widths, 10 of its 52 layers
    batch, seq = 2, 4096
    model = hy.build(config, device="cuda", dtype=torch.bfloat16)
    counts = param_counts(model)
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1), device="cuda")
    t = cuda_time(train_step(model, list(model.parameters()), ids), reps=3, warmup=1)
    print(f"hybrid {config.pattern} (Soofi widths): {counts['total'] / 1e9:.2f}B total, "
          f"{counts['active'] / 1e9:.2f}B active; batch {batch}x{seq} bf16: {batch * seq / t:,.0f} tok/s")


def mamba_ssd():
    from openpretrain.models import mamba2
    if mamba2.mamba_chunk_scan_combined is None:
        print("skipped: mamba-ssm is not installed (pip install 'openpretrain[gpu]' builds it against CUDA)")
        return
    b, L, h, p, g, n, Q = 2, 4096, 64, 64, 8, 128, 128
    torch.manual_seed(0)
    x = torch.randn(b, L, h, p, device="cuda", dtype=torch.bfloat16)
    dt = F.softplus(torch.randn(b, L, h, device="cuda") - 3)
    A = -torch.rand(h, device="cuda") - 0.5
    B, C = (torch.randn(b, L, g, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    D = torch.randn(h, device="cuda")
    ours = lambda: mamba2.ssd_chunked(x, dt, A, B, C, D, Q)  # noqa: E731
    fused = lambda: mamba2.mamba_chunk_scan_combined(x, dt, A, B, C, Q, D=D)  # noqa: E731
    err = (ours()[0].float() - fused().float()).abs().max().item()
    t_ours, t_fused = cuda_time(ours, reps=5), cuda_time(fused, reps=5)
    print(f"SSD forward, b{b} L{L} h{h} p{p} g{g} n{n}: max |ours - mamba-ssm| {err:.3g}")
    print(f"ours {t_ours * 1e3:.2f} ms | mamba-ssm {t_fused * 1e3:.2f} ms | ratio {t_ours / t_fused:.2f}x (median of 5)")


def serving_sweep():
    "Soofi Eq. 1 on one GPU: gpu-1's serving section (B = 32, O_long = 1024), dense vs hybrid, contexts up to what fits."
    from openpretrain.core import ConfigError, load_preset
    from openpretrain.evaluation.serving import ServingConfig, run_serving, tps_ratio
    from openpretrain.models.registry import model_config
    cfg = load_preset("gpu-1").section("serving", ServingConfig)
    models = {m: model_config(load_preset(m)) for m in cfg.models}
    rows = []
    for ctx in cfg.contexts:  # one context at a time: stop at the first that runs out of memory or budget
        if elapsed() > BUDGET_S:
            print(f"stopped before context {ctx}: budget spent")
            break
        try:
            with torch.no_grad():
                rows.append(run_serving(dataclasses.replace(cfg, contexts=[ctx]), models, "cuda"))
        except torch.OutOfMemoryError:
            print(f"context {ctx}: out of memory at B = {cfg.batch}")
            break
        except ConfigError as e:  # refused before allocating: beyond the model's limit or surely beyond free memory
            print(f"context {ctx}: {e}")
            break
        finally:
            torch.cuda.empty_cache()
        for r in rows[-1].itertuples():
            print(f"{r.preset} context {ctx}: t(1) {r.t_short_s:.2f} s, t({cfg.o_long}) {r.t_long_s:.2f} s → "
                  f"{r.decode_tps:,.0f} tok/s", flush=True)
    if len(rows) > 1:
        import pandas as pd
        ratio = tps_ratio(pd.concat(rows, ignore_index=True))
        print(" | ".join(f"{name} decode TPS longest/shortest context {r:.2f}" for name, r in ratio.items()))


def main():
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | budget {BUDGET_S:.0f}s")
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = section("bf16 matmul peak")(matmul_peak)
    section("dense ~1B train step (gpu-1 preset)")(lambda: dense(peak))
    section("xIELU: fused Triton kernel vs PyTorch")(xielu_kernel)
    section("hybrid train step")(hybrid)
    section("mamba-ssm SSD vs ours")(mamba_ssd)
    section("serving: Soofi Eq. 1 decode throughput sweep (gpu-1 serving section)")(serving_sweep)
    print(f"\ndone in {elapsed():.0f}s")


if __name__ == "__main__":
    main()
