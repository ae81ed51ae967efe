"""lm-evaluation-harness, unmodified, scores a multiple-choice task and a generate-until task against `amoe serve`
with its `local-completions` model exactly as its transformers (`hf`) model does on the same checkpoint: the same
per-choice log-likelihoods (within 1e-3), greedy flags, generations and metrics.

`local-completions` finds vLLM's /tokenizer_info and /tokenize on the server and tokenizes with them (its "remote"
tokenizer, which adds no BOS); the `hf` model is told the same (`add_bos_token=False`). Local task files and a local
dataset only: nothing is downloaded.
"""

import asyncio
import json
import os
import tempfile
import threading
import time

import pytest

# Before `datasets` is imported (it reads them once): offline, and a cache of our own.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="amoe-lm-eval-"))

lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-evaluation-harness is in the dev extra: pip install -e .[dev]"
)

from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from amoe.config import AmoeConfig  # noqa: E402
from amoe.model.make import make_model  # noqa: E402
from amoe.serve import AmoeServer  # noqa: E402

MODEL = "tiny-eval"
TASKS = ["amoe_mc", "amoe_gen"]
MULTIPLE_CHOICE = [
    {"question": "The colour of the sky is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " five"], "answer": 0},
    {"question": "A cat says", "choices": [" meow", " woof", " moo", " quack"], "answer": 0},
]
GENERATE = [
    {"question": "Q: What is the capital of France?\nA:", "answer": "Paris"},
    {"question": "Once upon a time", "answer": "there"},
]


def _task_files(root) -> None:
    """Two YAML tasks over local JSON-lines datasets."""
    for name, docs in (("mc", MULTIPLE_CHOICE), ("gen", GENERATE)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = (
        "dataset_path: json\ntest_split: test\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
    )
    (root / "amoe_mc.yaml").write_text(
        f"task: amoe_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\nmetric_list:\n  - metric: acc\n"
    )
    (root / "amoe_gen.yaml").write_text(
        f"task: amoe_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'gen.jsonl'}\n"
        "output_type: generate_until\ngeneration_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n"
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm-eval")
    model_dir = make_model("tiny", root / MODEL, seed=0)
    _task_files(root)
    config = AmoeConfig().replace(
        model={"path": str(model_dir)}, parallel={"mode": "local"}, server={"port": 0, "drain_timeout_s": 2.0}
    )
    srv = AmoeServer(config)
    thread = threading.Thread(target=asyncio.run, args=(srv.run(),), name="test-lm-eval-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started.wait(0.1):
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
    yield srv.url, model_dir, TaskManager(include_path=str(root))
    srv.request_exit()
    thread.join(30)


def _evaluate(lm, tasks: TaskManager) -> dict:
    return lm_eval.simple_evaluate(model=lm, tasks=TASKS, task_manager=tasks, log_samples=True, random_seed=0)


@pytest.mark.timeout(240)
def test_local_completions_scores_as_the_transformers_model_does(setup):
    url, model_dir, tasks = setup
    served = LocalCompletionsAPI(model=MODEL, base_url=f"{url}/v1/completions", max_retries=1)
    assert served.tokenizer_backend == "remote"  # it found /tokenizer_info and /tokenize
    hf = HFLM(pretrained=str(model_dir), dtype="float32", device="cpu", add_bos_token=False)
    ours, theirs = _evaluate(served, tasks), _evaluate(hf, tasks)
    choices = 0
    for a, b in zip(ours["samples"]["amoe_mc"], theirs["samples"]["amoe_mc"], strict=True):
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip(
            [r[0] for r in a["resps"]], [r[0] for r in b["resps"]], strict=True
        ):
            assert abs(ll_a - ll_b) < 1e-3 and greedy_a == greedy_b
            choices += 1
    assert choices == sum(len(d["choices"]) for d in MULTIPLE_CHOICE)
    generated = [s["resps"] for s in ours["samples"]["amoe_gen"]]
    assert generated == [s["resps"] for s in theirs["samples"]["amoe_gen"]] and all(
        g[0][0] for g in generated
    )
    for task in TASKS:
        metrics = {k: v for k, v in ours["results"][task].items() if "," in k}
        assert metrics == {k: theirs["results"][task][k] for k in metrics}
