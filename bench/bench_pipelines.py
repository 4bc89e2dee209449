"""torchrec's training pipelines on one model and data, KJT and TD batches: runtime P50/P90 per step and
peak memory, with ratios to TrainPipelineSparseDist (KJT) measured in this run.

Run: python bench/bench_pipelines.py [--rounds N] [--batches N] [--batch-size N] [--no-memory] [--device cpu|cuda]
     [--report DIR]   (or `paritykit bench pipelines`). The measurement is
paritykit.checks.pipeline.benchmark (its docstring says how each figure is taken); the gate saves the
same table into its report with paritykit.checks.pipeline.benchmark_report.save_benchmark.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from paritykit.checks.pipeline.benchmark import BenchSettings, run_benchmark
from paritykit.checks.pipeline.benchmark_report import format_table, save_benchmark


def settings_from(args: argparse.Namespace) -> BenchSettings:
    settings = BenchSettings()
    data = replace(settings.data, num_batches=args.batches or settings.data.num_batches,
                   batch_size=args.batch_size or settings.data.batch_size)
    return replace(settings, data=data, rounds=args.rounds or settings.rounds, device=args.device,
                   measure_memory=not args.no_memory)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 3)")
    parser.add_argument("--batches", type=int, default=None, help="batches per run (default 20)")
    parser.add_argument("--batch-size", type=int, default=None, help="examples per rank and batch (default 512)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--no-memory", action="store_true", help="skip the fresh-pool memory runs on CPU")
    parser.add_argument("--report", default=None, help="also write pipeline_benchmark.md/.json into this directory")
    args = parser.parse_args()
    settings = settings_from(args)
    started = time.perf_counter()
    progress = lambda line: print(f"  {line}", file=sys.stderr, flush=True)  # noqa: E731
    if args.report:
        paths = save_benchmark(args.report, settings, progress)
        print(paths[0].read_text().strip("`\n"))
    else:
        print(format_table(run_benchmark(settings, progress), settings))
    print(f"({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
