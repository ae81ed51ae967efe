"""Routing traces for the offloading policies: recorded routing of a real checkpoint, or a task-clustered model.

A trace is a list of sequences; a sequence is a list of forward steps (the prefill, then one per generated token);
a step is, per MoE block, the experts its router picked and how many of the step's tokens each got.

**Recorded routing** (what `amoe serve` writes, JSON Lines): a header line
`{"format": "amoe-routing/1", "num_blocks": L, "num_experts": E, "model": NAME}`, then one line per finished sequence
`{"seq": ID, "steps": [[[expert, tokens], ...] per block] per step}`.

**The task-clustered model** (`TaskRouting`). A random-weight checkpoint's router has no structure a policy could
learn, so the replay benchmarks draw routing from a model built to match what MoE-Infinity measured on real traces
(arXiv 2401.14361 §3): batches of 1–32 sequences activate 3–20 % of the experts over their generation and 30–46 %
of the activated experts are used more than once. The model: each sequence belongs to one of `num_tasks` tasks; a
task favours, per block, a support of `support` experts (a seeded random subset, Zipf-weighted); a sequence picks
per block `core` of them that most of its tokens go to (temporal locality: the same experts every step), and the
rest of its tokens (a share `spread`) to the task's support at large (experts a sequence touches once or twice, but
that sequences of one task share). `stats()` measures the §3 statistics of any trace; tests/test_offload_replay.py
checks the defaults fall in the §3 ranges, and docs/offload.md records the values.

**The workload the constants come from.** MoE-Infinity replays requests drawn from BIGBench, FLAN and MMLU mixed
together (§8.1 "Datasets": "If the dataset is not specified, we mix all three datasets"; §8.5 replays 3000 requests
"from the mixed dataset" against both Switch-large-128 and NLLB-MoE-128). The mix therefore holds the tasks of all
three: MMLU's 57 (Hendrycks et al., arXiv 2009.03300, "57 tasks"), BIG-bench's 204 (Srivastava et al., arXiv
2206.04615, "204 tasks") and FLAN's 62 datasets (Wei et al., arXiv 2109.01652 §2.1): `num_tasks`
= 323, drawn uniformly (the paper gives no mixing proportions). Independent task supports with that many tasks
break §3 (batch 32 would activate 63 % of the experts), so per block the experts have a global popularity (Zipf
exponent `popularity`) that tasks draw their supports by; its value is the smallest on a 0.25 grid that brings
batches of 1–32 back into §3's ranges (2.25 for top-1; amoe bench offload-replay's top-2 shape needs 2.75), chosen
from §3 alone before any policy was replayed. The paper states no sequence lengths; prompts and outputs stay 8–32
tokens. A search of `spread` and `zipf` for the access locality the paper's ORACLE implies (Figure 11)
found none that keeps §3's ranges (docs/offload-policy.md "Access locality set from the paper's ORACLE"),
so these defaults are the sourced ones. Giving the model the paper checkpoints' encoder–decoder structure
(`encoder_blocks`: the encoder's blocks routed once, at prefill) with these constants unchanged moved Bélády
further from the ORACLE and §3's reuse below 30 %, so `encoder_blocks` defaults to 0, the decoder-only
structure (docs/offload-policy.md "The shapes as the encoder–decoder models they are").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from amoe.errors import ConfigError

ROUTING_FORMAT = "amoe-routing/1"

Step = list[tuple[np.ndarray, np.ndarray]]  # per block: (experts [k], tokens [k])
Sequence_ = list[Step]


@dataclass
class Trace:
    """Routing of many sequences of one model shape."""

    num_blocks: int
    num_experts: int
    sequences: list[Sequence_]
    origin: str = ""

    def eams(self) -> np.ndarray:
        """[N, L, E]: each sequence's expert activation matrix (token counts over all its steps)."""
        out = np.zeros((len(self.sequences), self.num_blocks, self.num_experts), dtype=np.float32)
        for i, seq in enumerate(self.sequences):
            for step in seq:
                for block, (experts, tokens) in enumerate(step):
                    np.add.at(out[i, block], experts, tokens)
        return out

    def split(self, first: int) -> tuple[Trace, Trace]:
        """The first `first` sequences and the rest (an EAMC built on one part, replayed on the other)."""
        head, tail = self.sequences[:first], self.sequences[first:]
        return (
            Trace(self.num_blocks, self.num_experts, head, self.origin),
            Trace(self.num_blocks, self.num_experts, tail, self.origin),
        )


def read_routing(path: str | Path) -> Trace:
    """A routing file the server recorded (the module docstring's format); bad lines raise ConfigError with
    their line number."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read routing file {path}: {exc}") from None
    if not lines:
        raise ConfigError(f"routing file {path} is empty")
    try:
        header = json.loads(lines[0])
        if header.get("format") != ROUTING_FORMAT:
            raise ValueError(f"format is {header.get('format')!r}, expected {ROUTING_FORMAT!r}")
        num_blocks, num_experts = int(header["num_blocks"]), int(header["num_experts"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{path}:1: not an {ROUTING_FORMAT} header: {exc}") from None
    sequences = []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            sequences.append(_parse_sequence(json.loads(line), num_blocks, num_experts))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}:{number}: bad routing record: {exc}") from None
    origin = f"recorded routing of {header.get('model', '?')} ({path.name})"
    return Trace(num_blocks, num_experts, sequences, origin)


def write_routing(trace: Trace, path: str | Path, model: str = "") -> None:
    """The inverse of `read_routing` (tests and the benchmark write generated traces in the server's format)."""
    with open(path, "w") as f:
        header = {"format": ROUTING_FORMAT, "num_blocks": trace.num_blocks, "num_experts": trace.num_experts}
        f.write(json.dumps({**header, "model": model}) + "\n")
        for i, seq in enumerate(trace.sequences):
            steps = [[[[int(e), int(t)] for e, t in zip(*block)] for block in step] for step in seq]
            f.write(json.dumps({"seq": i, "steps": steps}) + "\n")


def _parse_sequence(record: dict, num_blocks: int, num_experts: int) -> Sequence_:
    steps = record["steps"]
    if not isinstance(steps, list):
        raise ValueError("'steps' must be a list")
    seq = []
    for step in steps:
        if len(step) != num_blocks:
            raise ValueError(f"a step has {len(step)} blocks; the header says {num_blocks}")
        blocks = []
        for pairs in step:
            arr = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
            if arr.size and (arr[:, 0].min() < 0 or arr[:, 0].max() >= num_experts or arr[:, 1].min() < 1):
                raise ValueError(f"expert ids must be in [0, {num_experts}) with >= 1 token; got {pairs}")
            blocks.append((arr[:, 0].copy(), arr[:, 1].copy()))
        seq.append(blocks)
    return seq


@dataclass(frozen=True)
class TaskRouting:
    """The task-clustered routing model (module docstring). Defaults were set from the paper's workload (the task
    count) and its §3 statistics (everything else) alone (docs/offload-policy.md "Routing traces"), before any
    policy was replayed on them."""

    num_blocks: int = 24
    num_experts: int = 128
    top_k: int = 1
    num_tasks: int = 323  # MMLU 57 + BIG-bench 204 + FLAN 62 (module docstring)
    popularity: float = 2.25  # exponent of the experts' global popularity tasks draw supports by (0: uniform)
    support: int = 20  # experts a task favours per block
    zipf: float = 2.5  # weight of a task's r-th favoured expert ∝ 1 / (r + 1)^zipf
    core: int = 1  # experts per block a sequence sends most tokens to
    spread: float = 0.1  # share of a sequence's generated tokens routed over its task's support, not its core
    noise: float = 0.0  # share of every token's routing spread evenly over all experts (the rare experts)
    prompt: tuple[int, int] = (8, 32)  # prompt tokens, uniform inclusive
    output: tuple[int, int] = (8, 32)  # generated tokens (decode steps), uniform inclusive
    seed: int = 0
    # The first `encoder_blocks` blocks are an encoder's: routed once per sequence, at prefill, by the prompt;
    # the rest are the decoder's, routed at every step by the one token it runs (0: decoder-only, every block
    # every step). docs/offload-policy.md "The shapes as the encoder–decoder models they are".
    encoder_blocks: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.core <= self.support <= self.num_experts:
            raise ConfigError("need 1 <= top_k <= core <= support <= num_experts")
        if self.num_tasks < 1 or self.popularity < 0:
            raise ConfigError(
                f"need num_tasks >= 1 and popularity >= 0; got {self.num_tasks}, {self.popularity}"
            )
        if not 0 <= self.encoder_blocks < self.num_blocks:
            raise ConfigError(
                f"encoder_blocks must be in [0, num_blocks) (a decoder block must remain); got "
                f"{self.encoder_blocks} of {self.num_blocks}"
            )
        if not (0.0 <= self.spread <= 1.0 and 0.0 <= self.noise <= 1.0):
            raise ConfigError(f"spread and noise must be in [0, 1]; got {self.spread}, {self.noise}")

    def task_tables(self) -> np.ndarray:
        """[T, L, E] each task's routing distribution per block."""
        rng = np.random.default_rng([self.seed, 0])
        weights = 1.0 / (np.arange(self.support) + 1.0) ** self.zipf
        tables = np.zeros((self.num_tasks, self.num_blocks, self.num_experts))
        # Per block a global popularity over the experts (a seeded order, weight ∝ 1 / (rank + 1)^popularity); a
        # task's support is drawn ∝ it, so with many tasks the supports overlap on the popular experts.
        popular = np.zeros((self.num_blocks, self.num_experts))
        for b in range(self.num_blocks):
            popular[b, rng.permutation(self.num_experts)] = (
                1.0 / (np.arange(self.num_experts) + 1.0) ** self.popularity
            )
        popular /= popular.sum(axis=1, keepdims=True)
        for t in range(self.num_tasks):
            for b in range(self.num_blocks):
                tables[t, b, rng.choice(self.num_experts, self.support, replace=False, p=popular[b])] = (
                    weights
                )
        tables /= tables.sum(axis=-1, keepdims=True)
        return (1.0 - self.noise) * tables + self.noise / self.num_experts

    def generate(self, num_sequences: int, seed: int = 1) -> Trace:
        """`num_sequences` sequences, tasks drawn uniformly; `seed` picks the sequences (the tasks stay)."""
        tables = self.task_tables()
        rng = np.random.default_rng([self.seed, seed])
        sequences = [self._sequence(tables[rng.integers(self.num_tasks)], rng) for _ in range(num_sequences)]
        origin = (
            f"task-clustered routing model (amoe.offload.trace.TaskRouting, {self.num_tasks} tasks, "
            f"{self.num_blocks}x{self.num_experts}, top-{self.top_k}), statistics from MoE-Infinity §3"
        )
        if self.encoder_blocks:
            origin += f"; encoder-decoder: blocks 0-{self.encoder_blocks - 1} the encoder's (prefill only)"
        return Trace(self.num_blocks, self.num_experts, sequences, origin)

    def _sequence(self, task: np.ndarray, rng: np.random.Generator) -> Sequence_:
        # The sequence's own routing distribution per block: its core experts drawn from the task's, most tokens
        # to them, the rest over the task's support.
        dist = np.empty_like(task)  # [L, E]
        for b in range(self.num_blocks):
            core = rng.choice(self.num_experts, self.core, replace=False, p=task[b])
            own = np.zeros(self.num_experts)
            own[core] = 1.0 / self.core
            uniform = self.noise / self.num_experts
            dist[b] = (1.0 - self.noise) * ((1.0 - self.spread) * own + self.spread * task[b]) + uniform
        n_prompt = int(rng.integers(self.prompt[0], self.prompt[1] + 1))
        n_output = int(rng.integers(self.output[0], self.output[1] + 1))
        # The prompt's tokens are the task's text at large; generated tokens stay with the sequence's core.
        if not self.encoder_blocks:
            return [self._step(task, n_prompt, rng)] + [self._step(dist, 1, rng) for _ in range(n_output)]
        # Encoder-decoder: at prefill the encoder's blocks take the prompt and the decoder's blocks the decoder's
        # start token (the same forward pass); afterwards only the decoder's blocks run, one token a step.
        enc, dec = slice(0, self.encoder_blocks), slice(self.encoder_blocks, self.num_blocks)
        idle = [_EMPTY] * self.encoder_blocks
        prefill = self._step(task[enc], n_prompt, rng) + self._step(dist[dec], 1, rng)
        return [prefill] + [idle + self._step(dist[dec], 1, rng) for _ in range(n_output)]

    def _step(self, dist: np.ndarray, tokens: int, rng: np.random.Generator) -> Step:
        """`tokens` tokens through each block `dist` [blocks, E] has, each to top_k distinct experts drawn ∝ dist
        (Gumbel-top-k)."""
        with np.errstate(divide="ignore"):
            log_p = np.log(dist)  # [blocks, E]
        # One draw for all blocks: the generator fills it in the order the per-block draws used to take, so the
        # traces are unchanged, at a fraction of the calls (generation dominated the benchmark's set-up).
        keys = log_p[:, None, :] + rng.gumbel(size=(len(dist), tokens, self.num_experts))
        picks = np.argpartition(-keys, self.top_k - 1, axis=2)[:, :, : self.top_k]
        return [np.unique(picks[b], return_counts=True) for b in range(len(dist))]


# A block no token of the step went through (an encoder block at a decode step): no experts, no tokens.
_EMPTY = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


def batches(trace: Trace, batch_size: int) -> list[list[int]]:
    """Consecutive sequences grouped `batch_size` at a time (the last batch may be smaller)."""
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1; got {batch_size}")
    n = len(trace.sequences)
    return [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]


def batch_steps(trace: Trace, batch: list[int]) -> list[list[np.ndarray]]:
    """The batch run in lockstep: per step, per block, the experts any of its running sequences picked."""
    longest = max(len(trace.sequences[s]) for s in batch)
    out = []
    for i in range(longest):
        running = [trace.sequences[s][i] for s in batch if i < len(trace.sequences[s])]
        out.append(
            [np.unique(np.concatenate([step[b][0] for step in running])) for b in range(trace.num_blocks)]
        )
    return out


def stats(trace: Trace, batch_size: int, first_block: int = 0) -> dict:
    """MoE-Infinity §3's statistics over batches of `batch_size` sequences run together: the mean share of all
    experts the batch activated during its generation, and the mean share of those used in more than one step.
    `first_block` > 0 measures blocks first_block.. only (an encoder–decoder trace's decoder part, for reading)."""
    total = (trace.num_blocks - first_block) * trace.num_experts
    active, reused = [], []
    for batch in batches(trace, batch_size):
        if len(batch) < batch_size:
            continue
        uses = np.zeros((trace.num_blocks, trace.num_experts), dtype=np.int64)  # steps each expert ran in
        for step in batch_steps(trace, batch):
            for b, experts in enumerate(step):
                uses[b, experts] += 1
        uses = uses[first_block:]
        n_active = int((uses > 0).sum())
        active.append(n_active / total)
        reused.append(int((uses > 1).sum()) / max(n_active, 1))
    if not active:
        raise ConfigError(f"the trace has fewer than {batch_size} sequences")
    return {"batch": batch_size, "activated": float(np.mean(active)), "reused": float(np.mean(reused))}
