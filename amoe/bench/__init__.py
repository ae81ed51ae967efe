"""`amoe bench serve`: the load generator — requests drawn from a workload (`workloads`, `arrivals`), sent to a
running server (`client`, `http1`), reported (`report`). It imports nothing from the modelling wing (amoe.perf),
whose studies it serves; their `amoe bench` commands are registered in amoe.perf.studies.commands.

Only argparse-level code is imported here; each command imports its heavy modules when it runs.
"""

from amoe.bench.serve import add_bench_serve_command

BENCH_SUBCOMMANDS = (add_bench_serve_command,)
