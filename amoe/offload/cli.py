"""`amoe offload build-eamc`: an EAMC from the routing the server recorded (docs/offload.md)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

logger = logging.getLogger(__name__)


def add_offload_command(sub: Any) -> None:
    p = sub.add_parser("offload", help="expert offloading tools (build an EAMC from recorded routing)")
    nested = p.add_subparsers(dest="offload_command", metavar="OFFLOAD_COMMAND", required=True)
    b = nested.add_parser(
        "build-eamc",
        help="cluster recorded routing into an expert activation matrix collection (MoE-Infinity §4.2)",
        description="cluster recorded routing into an expert activation matrix collection (MoE-Infinity §4.2)",
        parents=getattr(sub, "_parents", []),
    )
    b.add_argument(
        "--routing", required=True, metavar="FILE", help="routing the server recorded (JSON Lines)"
    )
    # The default lives in amoe.offload.eam (numpy-heavy, not imported for `amoe --help`).
    b.add_argument(
        "--size", type=int, help="entries to keep (default: 200, where §8.5's gains have saturated)"
    )
    b.add_argument("--seed", type=int, default=0, help="K-Means seed (default: 0)")
    b.add_argument("--out", required=True, metavar="FILE", help="the EAMC file to write (npz)")
    b.set_defaults(run=run_build_eamc)


def run_build_eamc(args: argparse.Namespace) -> int:
    from amoe.offload.eam import DEFAULT_SIZE, EAMC  # noqa: PLC0415 - numpy-heavy; keeps `amoe --help` quick
    from amoe.offload.trace import read_routing  # noqa: PLC0415

    trace = read_routing(args.routing)
    eamc = EAMC.build(trace.eams(), args.size or DEFAULT_SIZE, seed=args.seed)
    eamc.save(args.out)
    logger.info(
        "[offload] EAMC of %d entries from %d sequences (%d blocks x %d experts) -> %s",
        len(eamc), len(trace.sequences), trace.num_blocks, trace.num_experts, args.out,
    )  # fmt: skip
    print(args.out)
    return 0
