"""What the benchmarks share: sides timed in alternation, the train step the model benchmarks run, and what the rest
of the machine did meanwhile (this project's machines are shared virtual ones: a ratio is only read beside it)."""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from openpretrain.training.parallel import autocast, training_precision


def step_time(forward, params, ids: torch.Tensor, sync: Callable[[], None] = lambda: None) -> float:
    "Seconds for one forward + backward of the next-token loss (`sync` waits for the device: CUDA's is asynchronous)."
    for p in params:
        p.grad = None
    sync()
    t = time.perf_counter()
    logits = forward(ids[:, :-1])
    F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
    sync()
    return time.perf_counter() - t


def bf16_sides(sides: dict[str, tuple], device: str) -> dict[str, tuple]:
    """Each (forward, parameters) side again under the trainer's bf16 autocast, named '<side>, bf16', where `device`
    trains in bf16 (`training_precision`: GPUs, and CPUs that multiply bf16); none elsewhere."""
    if training_precision("bf16", device.startswith("cuda")) != "bf16":
        return {}
    def under_bf16(forward):
        def run(ids):
            with autocast("bf16", torch.device(device)):
                return forward(ids)
        return run
    return {f"{name}, bf16": (under_bf16(forward), params) for name, (forward, params) in sides.items()}


def reference_of(side: str, ref: str = "transformers") -> str:
    "The reference side a side is compared with: the one of its precision."
    return f"{ref}, bf16" if side.endswith(", bf16") else ref


def timed(fn: Callable[[], object]) -> Callable[[], float]:
    "A side that times one call of `fn`."
    def side() -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    return side


def alternate(sides: dict[str, Callable[[], float]], reps: int,
              between: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    "Seconds of every side in `reps` rounds after an untimed warm-up round; the order turns every round."
    times = {name: [] for name in sides}
    for rep in range(reps + 1):
        for name in list(sides)[:: 1 if rep % 2 else -1]:
            seconds = sides[name]()   # a side returns the seconds it measured
            if rep:
                times[name].append(seconds)
        between()
    return times


MATMULS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm"}
# ATen kernels both sides call with the same shapes, none of which our code could make cheaper: CPU flash attention
# (faster than the math path at these lengths: 19 vs 28 ms forward + backward at T = 512) and the loss
SHARED = {"aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
          "aten::_log_softmax", "aten::_log_softmax_backward_data", "aten::nll_loss_forward", "aten::nll_loss_backward"}


def op_shares(fn: Callable[[], object], groups: dict[str, set[str]]) -> dict[str, float]:
    "Share of one profiled call's CPU time spent in each group of ops."
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return {name: sum(e.self_cpu_time_total for e in events if e.key in ops) / total for name, ops in groups.items()}


def matmul_share(fn: Callable[[], object]) -> float:
    "Share of one profiled call's CPU time spent in matrix products."
    return op_shares(fn, {"matmul": MATMULS})["matmul"]


def matmul_bound(steps: dict[str, Callable[[], object]], times: dict[str, list[float]], ours: str,
                 ref: str = "transformers") -> str:
    """Both sides' matmul shares, and the reference's median step over our matmul time (our ratio if our other ops
    were free) and over our matmul and shared-kernel time (our ratio if only our own element-wise code were free)."""
    share = {k: op_shares(steps[k], {"matmul": MATMULS, "kept": MATMULS | SHARED}) for k in (ours, ref)}
    step = {k: statistics.median(times[k]) for k in (ours, ref)}
    return (f"{ours}: matrix products {100 * share[ours]['matmul']:.0f}% of the step ({ref}: "
            f"{100 * share[ref]['matmul']:.0f}%); {ref} step / our matmul time = "
            f"{step[ref] / (step[ours] * share[ours]['matmul']):.2f}x (the ratio if every other op of ours cost "
            f"nothing); with attention and the loss kept too ({100 * share[ours]['kept']:.0f}% of our step, the same "
            f"ATen kernels on both sides): {step[ref] / (step[ours] * share[ours]['kept']):.2f}x")


def _cpu_ticks() -> tuple[int, int]:
    "(busy, stolen) clock ticks of all cores since boot, from /proc/stat."
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, open("/proc/stat").readline().split()[1:9])
    return user + nice + system + irq + softirq, steal


def _own_ticks() -> int:
    "CPU clock ticks of this process and every process below it (inductor's compile workers, pools), reaped ones too."
    parent, ticks = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:   # gone meanwhile
            continue
        parent[int(pid)], ticks[int(pid)] = int(fields[1]), sum(map(int, fields[11:15]))  # utime stime cutime cstime
    tree, frontier = set(), {os.getpid()}
    while frontier:
        tree |= frontier
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - tree
    return sum(ticks.get(pid, 0) for pid in tree)


QUIET = 0.25  # cores the rest of the machine may use while a run still counts as quiet


class MachineLoad:
    "`with MachineLoad() as load:` … `load.report()`: cores the other processes kept busy and the hypervisor stole."
    def __enter__(self):
        self.start = _cpu_ticks(), _own_ticks(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        (busy, steal), own, wall = _cpu_ticks(), _own_ticks(), time.perf_counter()
        (busy0, steal0), own0, wall0 = self.start
        hz, seconds = os.sysconf("SC_CLK_TCK"), wall - wall0
        self.others = max(0, (busy - busy0) - (own - own0)) / hz / seconds   # cores, averaged over the run
        self.stolen = (steal - steal0) / hz / seconds

    def report(self) -> str:
        busy = self.others + self.stolen > QUIET
        return (f"machine meanwhile: other processes {self.others:.2f} cores, stolen by the hypervisor "
                f"{self.stolen:.2f} cores, of {os.cpu_count()}"
                + (" - busy: the ratios above are not comparable with a quiet run's" if busy else " (quiet)"))
