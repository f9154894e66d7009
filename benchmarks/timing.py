"""What the model benchmarks share: the timed train step both sides run."""
import time

import torch
import torch.nn.functional as F


def step_time(forward, params, ids: torch.Tensor) -> float:
    "Seconds for one forward + backward of the next-token loss."
    for p in params:
        p.grad = None
    t = time.perf_counter()
    logits = forward(ids[:, :-1])
    F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
    return time.perf_counter() - t
