"""Fused xIELU forward and backward in Triton (one read/write pass each); reference: openpretrain.models.dense.xielu_reference.

Forward reads x once and writes y; backward reads x and dy, writes dx, and reduces the gradients of the two raw
parameters (a_p, a_n) per block, summed in fp32 afterwards. Only x is saved for backward (the reference's autograd
keeps several full-size intermediates). Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements per program


@triton.jit
def _softplus(a):
    return tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))


@triton.jit
def _expm1(x):
    # exp(x) − 1 without cancellation near 0 (x ≤ ε < 0 here): Taylor series below |x| = 1/16
    taylor = x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0)))))
    return tl.where(x > -0.0625, taylor, tl.exp(x) - 1.0)


@triton.jit
def _xielu_fwd(x_ptr, y_ptr, ap_ptr, an_ptr, n, beta, eps, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    alpha_p = _softplus(tl.load(ap_ptr).to(tl.float32))
    alpha_n = beta + _softplus(tl.load(an_ptr).to(tl.float32))
    positive = alpha_p * x * x + beta * x
    negative = alpha_n * (_expm1(tl.minimum(x, eps)) - x) + beta * x
    y = tl.where(x > 0.0, positive, negative)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _xielu_bwd(x_ptr, dy_ptr, dx_ptr, ap_ptr, an_ptr, dap_ptr, dan_ptr, n, beta, eps, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    alpha_p = _softplus(tl.load(ap_ptr).to(tl.float32))
    alpha_n = beta + _softplus(tl.load(an_ptr).to(tl.float32))
    pos = x > 0.0
    xm = tl.minimum(x, eps)
    dexp = tl.where(x <= eps, tl.exp(xm), 0.0)  # d/dx expm1(min(x, ε)); at x = ε as torch.clamp
    dx = tl.where(pos, 2.0 * alpha_p * x + beta, alpha_n * (dexp - 1.0) + beta)
    tl.store(dx_ptr + offs, (dy * dx).to(dx_ptr.dtype.element_ty), mask=inside)
    # dy/dα_p = x² (x > 0); dy/dα_n = expm1(min(x, ε)) − x (x ≤ 0); masked lanes have x = dy = 0
    tl.store(dap_ptr + pid, tl.sum(tl.where(pos, dy * x * x, 0.0), axis=0))
    tl.store(dan_ptr + pid, tl.sum(tl.where(pos, 0.0, dy * (_expm1(xm) - x)), axis=0))


class _XIELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha_p, alpha_n, beta: float, eps: float):
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        _xielu_fwd[(triton.cdiv(n, BLOCK),)](x, y, alpha_p, alpha_n, n, beta, eps, BLOCK=BLOCK)
        ctx.save_for_backward(x, alpha_p, alpha_n)
        ctx.beta, ctx.eps = beta, eps
        return y

    @staticmethod
    def backward(ctx, dy):
        x, alpha_p, alpha_n = ctx.saved_tensors
        dy = dy.contiguous()
        n, blocks = x.numel(), triton.cdiv(x.numel(), BLOCK)
        dx = torch.empty_like(x)
        dap = torch.empty(blocks, device=x.device, dtype=torch.float32)  # per-block partial sums
        dan = torch.empty(blocks, device=x.device, dtype=torch.float32)
        _xielu_bwd[(blocks,)](x, dy, dx, alpha_p, alpha_n, dap, dan, n, ctx.beta, ctx.eps, BLOCK=BLOCK)
        # chain rule through α_p = softplus(a_p), α_n = β + softplus(a_n): d softplus(a)/da = sigmoid(a)
        d_alpha_p = (dap.sum() * torch.sigmoid(alpha_p.float())).to(alpha_p.dtype)
        d_alpha_n = (dan.sum() * torch.sigmoid(alpha_n.float())).to(alpha_n.dtype)
        return dx, d_alpha_p, d_alpha_n, None, None


def xielu_triton(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, beta: float = 0.5,
                 eps: float = -1e-6) -> torch.Tensor:
    "xIELU of x (any shape) with raw parameters a_p, a_n of shape (1,), fused forward and backward."
    return _XIELU.apply(x, alpha_p, alpha_n, float(beta), float(eps))
