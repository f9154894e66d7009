"""Triton kernels against their PyTorch references: on CUDA, or on CPU through Triton's interpreter."""
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when kernels.xielu decorates its kernels (imported below)
pytest.importorskip("triton")

from kernels.xielu import BLOCK, xielu_triton  # noqa: E402
from openpretrain.models.dense import XIELU, xielu  # noqa: E402
from openpretrain.models.dense import xielu_reference as reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(dtype) -> torch.Tensor:
    "Wide spread, both sides of 0 and ε, far tails, and a length that is not a multiple of BLOCK."
    torch.manual_seed(0)
    edges = torch.tensor([0.0, -1e-6, -2e-6, -5e-7, 1e-7, -0.0625, -0.07, -40.0, 9.0])
    return torch.cat([torch.randn(3 * BLOCK + 77) * 3, edges]).to(DEVICE, dtype)


def trained_params(dtype):
    act = XIELU().to(DEVICE)
    with torch.no_grad():  # away from the init, so α_p and α_n both matter
        act.alpha_p.fill_(0.4), act.alpha_n.fill_(-0.9)
    return act.alpha_p.to(dtype).detach(), act.alpha_n.to(dtype).detach()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2**-7)])
def test_fused_xielu_matches_reference_values_and_gradients(dtype, tol):
    x = inputs(dtype).requires_grad_()
    ap, an = (p.requires_grad_() for p in trained_params(dtype))
    dy = torch.randn_like(x)
    y = xielu_triton(x, ap, an)
    grads = torch.autograd.grad(y, [x, ap, an], dy)
    # the kernel computes in fp32 and rounds once: compare with the fp32 formula on the same (rounded) inputs
    x32, ap32, an32 = (t.detach().float().requires_grad_() for t in (x, ap, an))
    y32 = reference(x32, ap32, an32)
    ref_grads = torch.autograd.grad(y32, [x32, ap32, an32], dy.float())
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), y32, rtol=tol, atol=tol)
    torch.testing.assert_close(grads[0].float(), ref_grads[0], rtol=tol, atol=tol)
    for got, want in zip(grads[1:], ref_grads[1:]):  # parameter gradients: sums over every element
        torch.testing.assert_close(got.float(), want, rtol=max(tol, 1e-4), atol=1e-2)


def test_fused_xielu_keeps_shape_and_accepts_non_contiguous_input():
    x = inputs(torch.float32)[: 8 * 96].view(8, 96).t()  # (96, 8), non-contiguous
    ap, an = trained_params(torch.float32)
    y = xielu_triton(x, ap, an)
    assert y.shape == x.shape
    torch.testing.assert_close(y, reference(x, ap, an), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the model selects the kernel on CUDA only")
def test_model_selects_the_fused_kernel_on_cuda():
    x = torch.randn(4, 64, device="cuda", requires_grad=True)
    ap, an = trained_params(torch.float32)
    y = xielu(x, ap, an)
    assert y.grad_fn.name().endswith("_XIELUBackward")


def test_library_imports_and_runs_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\nfrom openpretrain.models.dense import XIELU, build, DenseConfig\n"
            "m = build(DenseConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, mlp_hidden=64))\n"
            "print(m(torch.randint(0, 50, (1, 4))).shape)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr
    assert "torch.Size([1, 4, 50])" in out.stdout
