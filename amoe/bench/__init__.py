"""`amoe bench`: benchmarks against running servers, and the planner's (amoe.emulation.commands). Each subcommand's add function is listed in BENCH_SUBCOMMANDS.

Only argparse-level code is imported here; each command imports its heavy modules when it runs.
"""

from amoe.bench.compare import add_bench_compare_command
from amoe.bench.serve import add_bench_serve_command
from amoe.emulation.commands import PLAN_BENCH_SUBCOMMANDS

BENCH_SUBCOMMANDS = (add_bench_serve_command, add_bench_compare_command, *PLAN_BENCH_SUBCOMMANDS)
