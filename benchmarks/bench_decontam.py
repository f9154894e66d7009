"""Decontamination speed: our rule against a literal transcription of the public script, on the same token lists.

The benchmark prompts are the UDHR's articles 1–30 in five languages (chapter 13's kind of evaluation text); the
training samples are real held-out and training texts of the embedded corpus — fortunes, KJV chapters, Debian
reference sections — with a copy, a half copy or an edited copy of a benchmark article mixed into every tenth.
Both sides get the same token ids (the tiny preset's tokenizer with BoS) and build their own n-gram index; the
transcription (tests/decontam_reference.py) runs its per-sample loop in one process; ours (`matches`) takes all
samples as one batch in one process (the hash prefilter runs over the batch at once), so the ratio is the rule's
own cost, single-process on both sides. Their decisions are compared sample by sample: they may differ only where the
script's dropped last n-gram decides. Both sides alternate, median of `--reps`.
Run: OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_decontam.py [--samples 3000] [--reps 3]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import decontam_reference as ref  # noqa: E402

from openpretrain.core import load_preset  # noqa: E402
from openpretrain.corpus import load_embedded  # noqa: E402
from openpretrain.evaluation.harness import udhr_documents  # noqa: E402
from openpretrain.posttrain.decontam import BenchmarkIndex, DecontaminationConfig, encode, matches  # noqa: E402
from openpretrain.tokenization import TokenizerConfig, load_tokenizer  # noqa: E402


def workload(samples: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    "(training token lists, benchmark token lists) of real text, a benchmark copy in every tenth sample."
    tok = load_tokenizer(load_preset("tiny").section("tokenizer", TokenizerConfig))
    config, rng = DecontaminationConfig(), random.Random(seed)
    bench = [a for lang in ("eng", "deu", "fra", "ita", "spa") for a in udhr_documents(lang, 30)]
    pool = [t for t in load_embedded("train").filter(lambda r: r["source"] in ("fortunes", "bible-kjv-text",
                                                                                "debian-reference-en"))["text"]]
    train = []
    for i in range(samples):
        text = rng.choice(pool)[:2000]
        if i % 10 == 0:
            b = rng.choice(bench).split()
            text += " " + " ".join(b if i % 30 == 0 else b[: len(b) // 2] if i % 30 == 10 else
                                   [w if rng.random() > 0.1 else "x" for w in b])
        train.append(text)
    return [encode(tok, t, config) for t in train], [encode(tok, b, config) for b in bench]


def main(samples: int, reps: int) -> None:
    train, bench = workload(samples)
    def ours():                                        # index built inside, as the reference builds its own
        index = BenchmarkIndex(dict(enumerate(bench)))
        return matches(index, train)
    theirs = lambda: ref.decontaminate(train, bench)
    times = {"ours": [], "reference": []}
    for _ in range(reps):
        for side, fn in (("ours", ours), ("reference", theirs)):
            t = time.perf_counter()
            result = fn()
            times[side].append(time.perf_counter() - t)
            if side == "ours":
                mine = [m is not None for m in result]
            else:
                other = [m is not None for m in result]
    differ = sum(a != b for a, b in zip(mine, other))
    o, r = statistics.median(times["ours"]), statistics.median(times["reference"])
    print(f"{len(train):,} samples vs {len(bench)} benchmark prompts; flagged: ours {sum(mine)}, reference {sum(other)}, "
          f"decisions that differ {differ}")
    print(f"ours {len(train) / o:,.0f} samples/s | reference {len(train) / r:,.0f} samples/s | ratio {r / o:.2f}x "
          f"(median of {reps}, one process each)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--reps", type=int, default=3)
    main(**vars(ap.parse_args()))
