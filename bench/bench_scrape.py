"""Parse time of a ~3000-line SGLang /metrics payload: our prefilter parser vs prometheus_client.

Run from the repository root: `python -m bench.bench_scrape` (`make bench-scrape`). The payload is
built with prometheus_client from real SGLang 0.5.23 names at TP=8 (pdsim/payloads.py).
Both parsers run in the same process, on the same text, side by side; the best of several repeats
is reported (the least disturbed by the rest of the machine), with the median beside it. Results go
to stdout as a markdown table and to bench/scrape_results.json. Targets: >= 20x faster, <= 3 ms.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import timeit
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pdsim.payloads import sglang_payload
from watchdog.model import Role
from watchdog.observe.sglang_metrics import WORKER_NAMES, extract_snapshot, parse_samples

TARGET_SPEEDUP = 20.0
TARGET_MS = 3.0
RESULTS = Path(__file__).with_name("scrape_results.json")


def _ours(text: str) -> Callable[[], object]:
    return lambda: extract_snapshot(text, Role.PREFILL, 0.0)


def _prometheus_client(text: str) -> Callable[[], object]:
    # The full parser materialises every family and sample; consuming the generator is the cost.
    return lambda: sum(len(family.samples) for family in text_string_to_metric_families(text))


def time_ms(func: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(best, median) milliseconds per call over `repeat` timeit rounds."""
    timer = timeit.Timer(func)
    number, _ = timer.autorange()
    rounds = [t / number * 1000.0 for t in timer.repeat(repeat=repeat, number=number)]
    return min(rounds), statistics.median(rounds)


def _agree(text: str) -> bool:
    """Both parsers read the same wanted values (a benchmark of a wrong parser would lie)."""
    wanted = set(WORKER_NAMES)
    theirs = sorted(
        (s.name, tuple(sorted(s.labels.items())), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in wanted
    )
    ours = sorted(
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for s in parse_samples(text, WORKER_NAMES).samples
    )
    return ours == theirs


def run(repeat: int) -> dict[str, Any]:
    """Time both parsers on the payload; the results as a JSON-ready dict."""
    text = sglang_payload("0.5.23", "prefill", tp=8, transfer_failed_per_rank=[3] * 8)
    ours_best, ours_median = time_ms(_ours(text), repeat)
    theirs_best, theirs_median = time_ms(_prometheus_client(text), repeat)
    speedup = theirs_best / ours_best
    return {
        "payload": {
            "sglang_version": "0.5.23",
            "tp": 8,
            "lines": text.count("\n"),
            "bytes": len(text.encode()),
        },
        "ours_ms": {"best": round(ours_best, 4), "median": round(ours_median, 4)},
        "prometheus_client_ms": {"best": round(theirs_best, 3), "median": round(theirs_median, 3)},
        "speedup": round(speedup, 1),
        "targets": {"speedup": TARGET_SPEEDUP, "ours_ms": TARGET_MS},
        "passed": {"speedup": speedup >= TARGET_SPEEDUP, "ours_ms": ours_best <= TARGET_MS},
        "parsers_agree": _agree(text),
        "environment": {
            "python": platform.python_version(),
            "prometheus_client": version("prometheus-client"),
            "machine": platform.machine(),
        },
    }


def markdown(results: dict[str, Any]) -> str:
    """The results as a markdown table."""
    payload = results["payload"]
    ours, theirs = results["ours_ms"], results["prometheus_client_ms"]
    passed = results["passed"]
    return "\n".join(
        [
            f"SGLang {payload['sglang_version']} payload, TP={payload['tp']}: "
            f"{payload['lines']} lines, {payload['bytes']} bytes",
            "",
            "| parser | best ms/parse | median ms/parse | speedup |",
            "|---|---:|---:|---:|",
            f"| watchdog (prefilter + extract) | {ours['best']:.3f} | {ours['median']:.3f} "
            f"| {results['speedup']:.1f}x |",
            f"| prometheus_client {results['environment']['prometheus_client']} (full parse) "
            f"| {theirs['best']:.3f} | {theirs['median']:.3f} | 1.0x |",
            "",
            f"target >= {TARGET_SPEEDUP:g}x: {'PASS' if passed['speedup'] else 'MISS'}; "
            f"target <= {TARGET_MS:g} ms: {'PASS' if passed['ours_ms'] else 'MISS'}; "
            f"parsers agree on the wanted series: {results['parsers_agree']}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Run, print, write the JSON; with --check, exit 1 when a target is missed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=7, help="timeit rounds per parser")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    results = run(args.repeat)
    print(markdown(results))
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.output}")
    missed = not all(results["passed"].values()) or not results["parsers_agree"]
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
