"""Which of the machine's kernel choices moves the report's numbers, and what pinning them costs.

Each configuration runs in a fresh interpreter with its own environment (a pin only acts at library load):
two steps of the `tiny` preset (the dense model, seed 0, real token files) and the toxicity embedder (USE-m3 on
NumPy's OpenBLAS) on eight embedded documents. Printed per configuration: step 1 and 2 losses and step 1's
gradient norm as `repr` floats, a digest of the embeddings, the precision the run trained in, and which of them
differ from the reference configuration in any bit. The reference is native numerics in fp32, so that each pin
is seen alone; native bf16 (the preset as it runs here) is a row of its own. What a pin costs is measured on
whole chapters (`openpretrain report --numerics portable`, the README's table).
Run: OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_numerics.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from openpretrain.report import PORTABLE_ENV

PROBE = """
import hashlib, json, pathlib, sys, tempfile
import numpy as np
from openpretrain.compliance.toxicity import USEEmbedder
from openpretrain.core import load_preset
from openpretrain.corpus import load_embedded
from openpretrain.training.plan import plan
from openpretrain.training.trainer import read_metrics, train

p = load_preset("tiny")
p.raw["train"]["precision"] = sys.argv[1]
with tempfile.TemporaryDirectory() as tmp:
    m = read_metrics(train(plan(p, 2), f"{tmp}/run"))
    trained_in = json.loads(next(pathlib.Path(tmp).rglob("run.json")).read_text())["precision"]
texts = load_embedded("train").to_pandas()["text"].head(8).tolist()
vectors = np.concatenate(USEEmbedder(chunk_words=128, max_chunks=2).embed(texts))
print(json.dumps(dict(loss1=repr(m[0]["loss"]), loss2=repr(m[1]["loss"]), gnorm1=repr(m[0]["grad_norm"]),
                      use=hashlib.sha256(vectors.tobytes()).hexdigest()[:12], use_sum=repr(float(vectors.sum())),
                      precision=trained_in)))
"""
NUMPY_AVX512 = "AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR"
CONFIGS = {  # name → (precision asked for, environment): one pin at a time, then all of them
    "native, fp32 (reference)": ("fp32", {}),
    "native, bf16 (the preset)": ("bf16", {}),
    "ATen → AVX2 (+ inductor's C++)": ("fp32", {"ATEN_CPU_CAPABILITY": "avx2"}),
    "xIELU eager (no C++ compiler)": ("fp32", {"CXX": "/nonexistent/c++"}),
    "oneDNN → AVX2": ("fp32", {"ONEDNN_MAX_CPU_ISA": "AVX2"}),
    "MKL → AVX2 (CBWR)": ("fp32", {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "MKL_CBWR": "AVX2"}),
    "OpenBLAS → Haswell": ("fp32", {"OPENBLAS_CORETYPE": "Haswell"}),
    "NumPy SIMD without AVX-512": ("fp32", {"NPY_DISABLE_CPU_FEATURES": NUMPY_AVX512}),
    "portable (every pin)": ("bf16", dict(PORTABLE_ENV)),
}


def probe(precision: str, env: dict[str, str], cache: str) -> dict:
    "One configuration in a fresh interpreter, with its own inductor cache root (keyed by numerics below it)."
    full = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, **env}
    out = subprocess.run([sys.executable, "-c", PROBE, precision], env=full, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"probe failed under {env}: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        rows = {name: probe(precision, env, cache) for name, (precision, env) in CONFIGS.items()}
    ref = rows["native, fp32 (reference)"]
    print("| configuration | trains in | loss step 1 | loss step 2 | grad norm step 1 | USE digest | differs from "
          "the reference in |\n|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        moved = [k for k in ("loss1", "loss2", "gnorm1", "use") if r[k] != ref[k]] or ["nothing"]
        print(f"| {name} | {r['precision']} | {r['loss1']} | {r['loss2']} | {r['gnorm1']} | {r['use']} "
              f"| {', '.join(moved)} |")


if __name__ == "__main__":
    main()
