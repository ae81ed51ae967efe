"""`amoe bench plan-check | plan-table | plan-scale | policies`: the planner's predictions, tabled and checked
against the emulated runtime, and the scheduling policies compared on it. Only argparse-level code here (`amoe
--help` stays light); each command imports its module when it runs."""

from __future__ import annotations

import argparse
from typing import Any

# amoe.emulation.plan_check.PRESETS' names (listed here so that `--help` imports nothing heavy; a test keeps them equal).
PLAN_CHECK_PRESETS = ("ci", "depth", "full", "scale32", "variance")
OUT_OF_SAMPLE = "sample"  # plans drawn from --seed (amoe.emulation.plan_check.sample_checks)


def add_bench_plan_check_command(sub: Any) -> None:
    p = sub.add_parser(
        "plan-check",
        help="run the planner's plans on the emulated runtime and compare measured with predicted",
    )
    p.add_argument("--preset", default="full", choices=(*PLAN_CHECK_PRESETS, OUT_OF_SAMPLE))
    p.add_argument(
        "--seed", type=int, default=None, help="--preset sample: the seed its 8 plans are drawn from"
    )
    p.add_argument("--repeats", type=int, default=1, help="runs per plan; the median is reported")
    p.add_argument("--out", default=None, help="write plan_check.json here")
    p.add_argument("--only", default=None, help="run only the plans of these modes, e.g. ep,pingpong")
    p.add_argument("--match", default=None, help="run only the plans whose description contains this")
    p.add_argument(
        "--fill", default="steady", choices=("steady", "poisson"),
        help="steady: the plan's requests at once, measured over ITLs (default); poisson: arrivals above its rate",
    )  # fmt: skip
    p.add_argument(
        "--time-scale", type=float, default=None,
        help="the preset's time scale on the reference host (stretched by the host probe as usual); a larger one "
        "shrinks the host's scheduling delays against the emulated steps, which a barrier pays (docs/results.md)",
    )  # fmt: skip
    _step_variance(p)
    add_aep_policy(p)
    p.set_defaults(run=run_plan_check)


def add_bench_plan_table_command(sub: Any) -> None:
    p = sub.add_parser(
        "plan-table", help="the planner's best plan of each mode per GPU type, size, top-k, routing"
    )
    p.add_argument("--gpus", default="a100-80g,h100,h200")
    p.add_argument("--sizes", default="8,16")
    p.add_argument("--top-k", default="1,2")
    p.add_argument(
        "--routings", default=None, help="';'-separated routing specs (default: the three of the table)"
    )
    p.add_argument("--profile", default="mixtral-8x7b-mqa")
    p.add_argument("--out", default="docs/results/plan_table")
    p.add_argument("--jobs", type=int, default=1, help="cells planned at once, one process each")
    p.add_argument("--itl-slo-ms", type=float, default=None, help="the planner's ITL objective")
    p.add_argument(
        "--measure", action="store_true", help="also run each cell's plans on the emulated runtime (slow)"
    )
    p.add_argument(
        "--report-measured", action="store_true",
        help="with --measure: report the points measured.jsonl holds, run none (the rest stay predictions)",
    )  # fmt: skip
    p.add_argument(
        "--measure-modes", default=None, metavar="MODES",
        help="with --measure: run only these modes' plans (e.g. aep,ep), the others read from measured.jsonl",
    )  # fmt: skip
    p.add_argument(
        "--measure-rows", default=None, metavar="I,J",
        help="with --measure: run only these rows (0-based, the table's order), the others read from measured.jsonl",
    )  # fmt: skip
    p.add_argument(
        "--plans", default=None, metavar="JSON",
        help="take the rows (and their plans) of this earlier plan_table.json instead of planning them again",
    )  # fmt: skip
    p.add_argument(
        "--figure10", action="store_true", help="only the Figure 10 setup (16 experts, 8 vs 16 GPUs)"
    )
    p.add_argument(
        "--time-scale", type=float, default=40.0,
        help="with --measure: the time scale on the reference host, stretched by the host probe (default 40); a "
        "larger one shrinks the host's own delays against the emulated steps, at that many times the wall time",
    )  # fmt: skip
    _step_variance(p)
    add_aep_policy(p)
    p.set_defaults(run=run_plan_table)


def add_bench_plan_scale_command(sub: Any) -> None:
    p = sub.add_parser("plan-scale", help="predicted throughput per GPU against cluster size, AEP against EP")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--profile", default="mixtral-8x7b-16e")
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument(
        "--routing", default=None, help="the skew the plans assume (default: the sourced skew-exp)"
    )
    p.add_argument("--itl-slo-ms", type=float, default=None)
    p.add_argument("--out", default="docs/results/scale")
    p.add_argument("--simulate", action="store_true", help="refine each best plan by the simulation")
    p.set_defaults(run=run_plan_scale)


def add_bench_frontier_command(sub: Any) -> None:
    p = sub.add_parser(
        "frontier",
        help="the model's predictions of published DeepSeek-V3 deployments (EP72-EP144), out of sample",
    )
    p.add_argument("--out", default="docs/results/frontier")
    p.add_argument(
        "--table", action="store_true", help="AEP, ping-pong and EP at 16-256 GPUs under 50/100 ms ITL"
    )
    p.add_argument("--profiles", default="deepseek-v3,qwen3-235b-a22b")
    p.add_argument("--gpu", default="h800")
    p.add_argument("--sizes", default="16,32,64,128,256")
    p.add_argument(
        "--modes", default="aep,pingpong,ep", help="the table's modes (default: all three; comma-separated)"
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="the misses explained per decode layer against DeepSeek's profile and SGLang's breakdown",
    )
    p.add_argument(
        "--trace",
        default=None,
        help="with --breakdown: a Chrome trace (e.g. profile-data's decode.json) to sum",
    )
    p.set_defaults(run=run_frontier)


def run_frontier(args: argparse.Namespace) -> int:
    if args.breakdown or args.trace:
        from amoe.emulation import frontier_trace

        try:
            return frontier_trace.main(args)
        except ValueError as exc:
            raise SystemExit(f"amoe bench frontier: {exc}") from None
    from amoe.emulation import frontier

    return frontier.main(args)


def add_bench_policies_command(sub: Any) -> None:
    p = sub.add_parser(
        "policies", help="the scheduling policies on an emulated AEP deployment under Poisson arrivals"
    )
    p.add_argument("--policies", default="defrag,mtfs,flfs,wave", help="comma-separated (default: all four)")
    p.add_argument("--blocks", type=int, default=8, help="blocks of the model profile kept (default: 8)")
    p.add_argument(
        "--loads", default="0.5,1.3", help="request rates as fractions of the bound's; must include 0.5"
    )
    p.add_argument(
        "--duration", type=float, default=4.0,
        help="emulated seconds of arrivals per point (default 4: the overload point fills its ranks in ~2)",
    )  # fmt: skip
    p.add_argument(
        "--half-duration", type=float, default=5.5,
        help="emulated seconds of arrivals of the half-load point, measured after its first 1.5 (default 5.5)",
    )  # fmt: skip
    p.add_argument(
        "--max-num-seqs", type=int, default=None,
        help="requests each rank holds (default: the planner's concurrency for the deployment; 0: no cap)",
    )  # fmt: skip
    p.add_argument(
        "--time-scale", type=float, default=25.0, help="on the reference host; stretched by a probe"
    )
    p.add_argument("--repeats", type=int, default=2, help="runs, each with its own seed (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="the first run's arrival and routing seed")
    p.add_argument("--out", default="docs/results/policies")
    p.add_argument(
        "--report", default=None, metavar="JSON", help="summarise a recorded policies.json again; run nothing"
    )
    _step_variance(p)
    p.set_defaults(run=run_policies)


def add_aep_policy(p: argparse.ArgumentParser) -> None:
    """`--aep-policy` (amoe.emulation.plan.AEP_POLICY; checked there against amoe.config.POLICIES, so that
    `--help` imports nothing heavy)."""
    p.add_argument(
        "--aep-policy", default="waves", metavar="POLICY",
        help="the scheduling policy AEP plans are simulated, measured and served with (`amoe serve --scheduler`): "
        "waves (default) | defrag | mtfs | flfs | wave | best (each plan simulated with waves and with defrag, served "
        "with the one that gives more within --itl-slo-ms)",
    )  # fmt: skip


def _step_variance(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--step-variance", default="sourced", metavar="V",
        help="the emulated GPUs' speed spread and step jitter, in the runs and the predictions: "
        "sourced (default) | off | SPREAD[,jitter=J][,seed=N]",
    )  # fmt: skip


def run_policies(args: argparse.Namespace) -> int:
    from amoe.emulation import policy_bench

    return policy_bench.main(args)


def run_plan_check(args: argparse.Namespace) -> int:
    from amoe.emulation import plan_check

    return plan_check.main(args)


def run_plan_table(args: argparse.Namespace) -> int:
    from amoe.emulation import plan_table

    return plan_table.main(args)


def run_plan_scale(args: argparse.Namespace) -> int:
    from amoe.emulation import plan_scale

    return plan_scale.main(args)


def add_bench_eps_command(sub: Any) -> None:
    p = sub.add_parser(
        "eps", help="EPS-MoE's Tables II and III, N* and decode auto PN against the cost model"
    )
    p.add_argument("--fit", action="store_true", help="refit the h800 curves to Table II's PN 1 rows first")
    p.add_argument("--gpus", default="a100-80g,h100,h200", help="the planner's table's GPUs (decode check)")
    p.add_argument("--sizes", default="8,16", help="the planner's table's pool sizes (decode check)")
    p.add_argument("--top-k", default="1,2", help="the planner's table's top-k (decode check)")
    p.set_defaults(run=run_eps)


def run_eps(args: argparse.Namespace) -> int:
    from amoe.emulation import eps_bench

    return eps_bench.main(args)


PLAN_BENCH_SUBCOMMANDS = (
    add_bench_plan_check_command,
    add_bench_plan_table_command,
    add_bench_plan_scale_command,
    add_bench_policies_command,
    add_bench_eps_command,
    add_bench_frontier_command,
)
