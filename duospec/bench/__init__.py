"""`duospec bench`: the same prompts and models through every decoding mode, repeated, with medians.

Files: arithmetic.py (pure formulas), prompts.py (the prompt set), records.py (what a run records),
inprocess.py (our modes on a LocalCoordinator; transformers generate), served.py (Ray pipeline +
gRPC server + SDK; round overhead; concurrency sweep), summary.py (medians, ratios, exactness),
report.py (JSON / Markdown / PNG), guards.py (a goodput guard per speculation variant),
harness.py (the run order).
"""

from duospec.bench.harness import BenchConfig, run_bench
from duospec.bench.report import write_outputs

__all__ = ["BenchConfig", "run_bench", "write_outputs"]
