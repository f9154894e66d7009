"""robots.txt decisions per second on the embedded corpus: parser cache warm vs cold, in one process.

Warm: each host's robots.txt is parsed once (Protego, cached by text) and every document costs the 15 agent matches.
Cold: the caches are cleared before every document, so each decision also classifies and parses its host's file —
what a filter without a cache (or with one that thrashes because documents are not grouped by host) pays.
Both sides decide the same documents under the same snapshot, alternately, after a warm-up.
Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_robots.py [--reps 7] [--docs 2000] [--mode url]
"""
from __future__ import annotations

import argparse
import statistics
import time

from openpretrain.compliance.robots import RobotsConfig, RobotsOracle, parse_robots
from openpretrain.corpus import load_embedded, load_robots_snapshot


def decide_all(oracle: RobotsOracle, urls: list[str], cold: bool) -> float:
    "Seconds to decide every URL; `cold` clears the parse and file caches before each one."
    t = time.perf_counter()
    for url in urls:
        if cold:
            parse_robots.cache_clear()
            oracle._files.clear()
        oracle.decide(url)
    return time.perf_counter() - t


def main(reps: int = 7, docs: int = 2000, mode: str = "url"):
    urls = list(load_embedded("train")["url"])[:docs]
    oracle = RobotsOracle(load_robots_snapshot(), RobotsConfig(mode=mode))
    times = {"warm": [], "cold": []}
    for rep in range(reps + 1):  # rep 0 is the warm-up
        for side in times:
            if side == "warm":
                decide_all(oracle, urls, cold=False)  # make sure every file is parsed before timing
            dt = decide_all(oracle, urls, cold=side == "cold")
            if rep:
                times[side].append(dt)
    warm, cold = (len(urls) / statistics.median(times[k]) for k in ("warm", "cold"))
    print(f"{len(urls)} documents, {len(oracle._rows)} robots.txt files, {mode} mode, "
          f"{len(oracle.config.checked_agents)} agents")
    print(f"warm {warm:,.0f} docs/s | cold {cold:,.0f} docs/s | ratio {warm / cold:.1f}x (median of {reps})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--docs", type=int, default=2000)
    ap.add_argument("--mode", default="url", choices=["url", "domain"])
    main(**vars(ap.parse_args()))
