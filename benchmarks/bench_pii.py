"""PII anonymisation throughput on the embedded corpus: ours vs datatrove's PIIFormatter, in one process.

Both sides rewrite the same documents with the same IP policy (public addresses only, the default of both):
datatrove's PIIFormatter (emails and IPv4, two `re.sub` passes, fake replacement addresses) and our
`anonymize` (emails, IPv4, IPv6 and IBANs with checksums, markers). Sides alternate within each repetition,
after one warm-up repetition; the median is reported. The Apertus-mode replay is timed too, for information.
Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_pii.py [--reps 7] [--mb 8]
"""
from __future__ import annotations

import argparse
import statistics
import time

from datatrove.pipeline.formatters.pii import PIIFormatter

from openpretrain.compliance.pii import KINDS, anonymize, find_pii
from openpretrain.corpus import load_embedded


def corpus_texts(mb: float) -> list[str]:
    "Documents of the embedded corpus, in a fixed shuffled order, up to `mb` megabytes of text."
    frame = load_embedded("train").to_pandas().sample(frac=1.0, random_state=0)
    texts, size = [], 0
    for text in frame["text"]:
        if size >= mb * 1e6:
            break
        texts.append(text)
        size += len(text.encode())
    return texts


def seconds(fn, texts: list[str]) -> float:
    t = time.perf_counter()
    for text in texts:
        fn(text)
    return time.perf_counter() - t


def datatrove_counts(formatter: PIIFormatter, texts: list[str]) -> dict[str, int]:
    "How many emails and IPs datatrove's formatter replaces (its regexes and validator, as `format` applies them)."
    ips = formatter.ip_replacer
    email_rx = formatter.emails_replacer.regex
    n_email = sum(len(email_rx.findall(t)) for t in texts)
    n_ip = sum(1 for t in texts for m in ips.regex.finditer(email_rx.sub("", t)) if ips.validator(m.group()))
    return {"email": n_email, "ip": n_ip, "iban": 0}


def main(reps: int = 7, mb: float = 8.0):
    texts = corpus_texts(mb)
    formatter = PIIFormatter()
    sides = {"ours": anonymize, "datatrove": formatter.format, "apertus mode": lambda t: anonymize(t, mode="apertus")}
    times = {name: [] for name in sides}
    for rep in range(reps + 1):  # rep 0 is the warm-up
        for name, fn in sides.items():
            dt = seconds(fn, texts)
            if rep:
                times[name].append(dt)
    size = sum(len(t.encode()) for t in texts) / 1e6
    speed = {name: size / statistics.median(ts) for name, ts in times.items()}
    ours = {k: 0 for k in KINDS}
    for text in texts:
        for kind, n in anonymize(text)[1].items():
            ours[kind] += n
    ipv6 = sum(1 for t in texts for s in find_pii(t) if s.kind == "ip" and ":" in t[s.start:s.end])
    print(f"{len(texts)} documents, {size:.1f} MB of text; replacements ours {ours} (IPv6 {ipv6}), "
          f"datatrove {datatrove_counts(formatter, texts)}")
    print(f"apertus mode {speed['apertus mode']:.2f} MB/s ({speed['apertus mode'] / speed['datatrove']:.2f}x datatrove)")
    print(f"ours {speed['ours']:.2f} MB/s | datatrove PIIFormatter {speed['datatrove']:.2f} MB/s | "
          f"ratio {speed['ours'] / speed['datatrove']:.2f}x (median of {reps})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--mb", type=float, default=8.0, help="megabytes of corpus text to rewrite per repetition")
    main(**vars(ap.parse_args()))
