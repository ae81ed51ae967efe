# Round 3's cut-down remainder of bench/offload_replay.py (the full parts did not fit the 20-minute window).
import json
import sys

sys.path.insert(0, "bench")
import offload_replay as B

from amoe.emulation.profiles import GB
from amoe.offload import replay as rp
from amoe.offload.activation import ActivationPolicy
from amoe.offload.eam import EAMC
from amoe.offload.trace import TaskRouting


def main() -> None:
    """Round 3's remainder rows, one JSON line each (the recorded offload_replay_r3d.jsonl)."""
    tr = {}
    for name, m in B.MODELS.items():
        model = TaskRouting(num_blocks=m.blocks, num_experts=m.experts, top_k=m.top_k, **m.routing)
        tr[name] = model.generate(300, seed=1), model.generate(160, seed=2)
    for name, m in B.MODELS.items():
        B.recall_oracle_eamc(name, m, tr[name][1])
    m = B.MODELS["nllb-moe-128"]
    B.BANDWIDTHS_GBPS = (8, 128)
    B.recall_by_bandwidth("nllb-moe-128", m, *tr["nllb-moe-128"], 1)
    B.recall_by_bandwidth(
        "nllb-moe-128", m, *tr["nllb-moe-128"], 1, paper_blocks=B.PAPER_BLOCK_S["nllb-moe-128"]
    )
    m = B.MODELS["switch-large-128"]
    train, test = tr["switch-large-128"]
    eamc = EAMC.build(train.eams(), B.EAMC_SIZE, seed=0)
    evs = rp.events(test, 1)
    for gbps in (8, 128):
        r = rp.replay_timed(
            evs,
            ActivationPolicy(m.blocks, m.experts, eamc=eamc),
            m.capacity,
            bandwidth=gbps * GB,
            expert_bytes=m.expert_bytes,
            block_s=B.PAPER_BLOCK_S["switch-large-128"],
        )
        print(
            json.dumps(
                {
                    "model": "switch-large-128",
                    "batch": 1,
                    "gbps": gbps,
                    "recall": round(r.recall, 4),
                    "hit_ratio": round(r.hit_ratio, 4),
                    "prefetched": r.prefetched,
                    "misses": r.misses,
                    "late": r.late,
                    "blocks_from": "paper latency",
                    "block_ms": round(B.PAPER_BLOCK_S["switch-large-128"] * 1e3, 3),
                    "ms_per_step": round(r.time_s / max(r.steps, 1) * 1e3, 2),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
