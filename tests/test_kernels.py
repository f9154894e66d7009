"""Triton kernels against their PyTorch references (on CUDA, or on CPU through Triton's interpreter), and how the
kernels/ folder is installed: as `openpretrain_kernels`, never as a top-level `kernels`."""
import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when openpretrain_kernels.xielu decorates its kernels (imported below)
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
if HAS_TRITON:  # triton present: the kernels package must import (it is part of the install)
    from openpretrain_kernels.xielu import BLOCK, xielu_triton

from openpretrain.models.dense import XIELU, xielu  # noqa: E402
from openpretrain.models.dense import xielu_reference as reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    "Run `code` in a fresh interpreter (its own import-time choices) with `env` added; fails the test on a crash."
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return out


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


@needs_triton
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


@needs_triton
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
    assert "torch.Size([1, 4, 50])" in run_python(code, CUDA_VISIBLE_DEVICES="").stdout


def test_fallback_is_explicit_and_logged_with_its_reason():
    code = ("import logging, sys; sys.modules['triton'] = None\n"
            "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
            "from openpretrain.models.dense import _fused_xielu\n"
            "assert _fused_xielu() is None and _fused_xielu() is None")
    assert run_python(code).stderr.count(
        "xIELU on CUDA: xielu_eager (PyTorch ops, hand-written backward), triton is not installed") == 1  # logged once


def test_without_a_cxx_compiler_cpu_xielu_falls_back_to_eager_and_says_why():
    code = ("import logging, torch\nlogging.basicConfig(level=logging.INFO, format='%(message)s')\n"
            "from openpretrain.models.dense import xielu\n"
            "ys = [xielu(torch.randn(5000, requires_grad=True), torch.zeros(1), torch.zeros(1)) for _ in range(2)]\n"
            "print(ys[0].grad_fn.name())")
    out = run_python(code, CXX="no-such-compiler")
    assert out.stdout.strip() == "_XIELUEagerBackward"
    assert out.stderr.count("xIELU on CPU: xielu_eager (PyTorch ops, hand-written backward), "
                            "no C++ compiler 'no-such-compiler' for inductor") == 1   # logged once


def test_kernels_install_under_a_name_that_shadows_no_other_distribution():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tool["package-dir"]["openpretrain_kernels"] == "kernels"
    assert not any(p == "kernels" or p.startswith("kernels.") for p in tool["packages"])
    # the package list is explicit (a mapped folder cannot be found by packages.find): it must name every
    # folder of lib/ that holds modules, or a wheel would silently miss one
    folders = {str(d.relative_to(ROOT / "lib")).replace("/", ".")
               for d in (ROOT / "lib").rglob("*") if d.is_dir() and any(d.glob("*.py"))}
    assert folders == set(tool["packages"]) - {"openpretrain_kernels"}
