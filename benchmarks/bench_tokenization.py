"""Fairness metrics of one tokenizer on the aligned UDHR corpus: our batched, vectorised path vs a per-text reference.

Ours: `fairness_metrics` with the Tekken adapter (one batched tiktoken call, NumPy/pandas group-bys).
Reference: mistral-common's own Tekken encoder, one text at a time, and the Appendix-I formulas written as plain
Python loops. Both must give the same numbers; they are timed alternately in one process after a warm-up.
Run: OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_tokenization.py [--reps 5] [--languages 70]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from openpretrain.corpus import load_udhr
from openpretrain.tokenization import (FLORES_TO_UDHR, SPACELESS_SCRIPTS, aligned_corpus, fairness_metrics, gini, load_tekken,
                                       tekken_path, text_units)


def reference_metrics(encode, corpus, vocab_size: int) -> dict:
    "Appendix I, one text and one token at a time."
    tokens_of, words_of, bytes_of, ratios, used = {}, {}, {}, [], set()
    for lang, script, text in zip(corpus.language, corpus.script, corpus.text):
        ids = encode(text)
        words = sum(not c.isspace() for c in text) if script in SPACELESS_SCRIPTS else len(text.split())
        tokens_of[lang] = tokens_of.get(lang, 0) + len(ids)
        words_of[lang] = words_of.get(lang, 0) + words
        bytes_of[lang] = bytes_of.get(lang, 0) + len(text.encode())
        ratios.append(len(text.encode()) / len(ids))
        for i in ids:
            used.add(i)
    return {"fertility": sum(tokens_of.values()) / sum(words_of.values()),
            "compression_ratio": sum(ratios) / len(ratios), "vocab_utilization": len(used) / vocab_size,
            "gini_bytes": gini([tokens_of[lang] / bytes_of[lang] for lang in tokens_of])}


def main(reps: int = 5, languages: int = 70):
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    corpus = aligned_corpus(load_udhr(), dict(list(FLORES_TO_UDHR.items())[:languages]))
    ours, ref = load_tekken(), Tekkenizer.from_file(str(tekken_path()))
    run_ours = lambda: fairness_metrics(ours, corpus, text_units(corpus))[1]
    run_ref = lambda: reference_metrics(lambda t: ref.encode(t, bos=False, eos=False), corpus, ref.n_words)
    a, b = run_ours(), run_ref()   # warm-up, and the two must agree
    for key, value in b.items():
        assert np.isclose(a[key], value), (key, a[key], value)
    t_ours, t_ref = [], []
    for _ in range(reps):
        for fn, out in ((run_ours, t_ours), (run_ref, t_ref)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    chars = corpus.text.str.len().sum()
    mo, mr = statistics.median(t_ours), statistics.median(t_ref)
    print(f"{corpus.language.nunique()} languages, {len(corpus)} texts, {chars:,} characters; identical metrics")
    print(f"ours {chars / mo / 1e6:.2f} Mchar/s | mistral-common + loops {chars / mr / 1e6:.2f} Mchar/s | "
          f"ratio {mr / mo:.2f}x (median of {reps})")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--languages", type=int, default=70)
    main(**vars(p.parse_args()))
