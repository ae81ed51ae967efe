"""What clients send beyond plain generation, through `amoe serve` (local mode) with the openai SDK and plain HTTP:
completions `logprobs` with `echo` and vLLM's `prompt_logprobs`, chat `logprobs` + `top_logprobs` (transformers'
values, streamed alike), a list of prompts in one request, vLLM's /tokenize and /detokenize, and 400s naming the
parameter for what is out of range."""

import json

import httpx
import openai
import pytest
import torch
import transformers
from factories import LOGPROB_TOL, check_echo_choice, hf_greedy, server_in_thread, streamed_choices

from amoe.config import AmoeConfig
from amoe.logprobs import MAX_LOGPROBS
from amoe.model.make import make_model
from amoe.tokenizer import Tokenizer
from coordinator.api.validation import MAX_PROMPTS

MODEL = "tiny-logprobs"
KV_BLOCKS = 12  # of 16 tokens
PROMPT = [1, 17, 300, 42, 9, 511]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("ckpt") / MODEL, seed=0)


@pytest.fixture(scope="module")
def server(model_dir):
    config = AmoeConfig().replace(
        model={"path": str(model_dir)},
        parallel={"mode": "local"},
        server={"port": 0, "drain_timeout_s": 2.0},
        cache={"num_kv_blocks": KV_BLOCKS},  # small: a list of prompts may need more than it holds at once
    )
    with server_in_thread(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


def test_completions_logprobs_with_echo_are_transformers(client, hf):
    output, ref = hf_greedy(hf, PROMPT, 4)
    got = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3, echo=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = got.choices[0]
    check_echo_choice(ref, PROMPT + output, choice.model_dump(), 3)
    assert choice.text.startswith(
        Tokenizer.from_dir(hf.name_or_path).decode(PROMPT)
    )  # the prompt's text first
    # Without echo: the output tokens only, each the most likely (greedy), its offset in the text.
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0)
    lp = plain.choices[0].logprobs
    assert lp.token_logprobs == choice.logprobs.token_logprobs[len(PROMPT) :]
    assert [len(top) for top in lp.top_logprobs] == [1] * 4 and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == plain.choices[0].text


def test_echo_with_max_tokens_0_scores_the_prompt_alone(http, hf):
    _, ref = hf_greedy(hf, PROMPT, 1)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    check_echo_choice(ref, PROMPT, whole, 1)
    assert whole["text"] == http.post("/detokenize", json={"tokens": PROMPT}).json()["prompt"].removeprefix(
        "<s>"
    )
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert [c["choices"][0]["logprobs"] for c in chunks] == [whole["logprobs"]]


def test_vllm_prompt_logprobs_name_token_ids_and_ranks(client, hf):
    _, ref = hf_greedy(hf, PROMPT, 1)
    got = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    scored = got.choices[0].model_extra["prompt_logprobs"]
    assert got.choices[0].logprobs is None and scored[0] is None and len(scored) == len(PROMPT)
    for i, token in enumerate(PROMPT[1:]):
        row, entry = ref[i], scored[i + 1]
        own = entry[str(token)]
        assert abs(own["logprob"] - float(row[token])) < LOGPROB_TOL
        assert own["rank"] == int((row > row[token]).sum()) + 1
        top = row.topk(2).indices.tolist()
        assert [entry[str(t)]["rank"] for t in top] == [1, 2]


def test_chat_logprobs_and_top_logprobs_are_transformers_and_stream_alike(client, hf, tokenizer):
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt = tokenizer.encode_chat(messages)
    output, ref = hf_greedy(hf, prompt, 5)
    args = {"model": MODEL, "messages": messages, "max_tokens": 5, "temperature": 0, "logprobs": True}
    got = client.chat.completions.create(**args, top_logprobs=4, extra_body={"ignore_eos": True})
    content = got.choices[0].logprobs.content
    assert len(content) == 5
    for i, (token, entry) in enumerate(zip(output, content)):
        row = ref[len(prompt) - 1 + i]
        assert abs(entry.logprob - float(row[token])) < LOGPROB_TOL
        assert entry.bytes == list(entry.token.encode("utf-8", "replace"))
        top = row.topk(4).values.tolist()
        assert [round(t.logprob, 4) for t in entry.top_logprobs] == [round(v, 4) for v in top]
    streamed = client.chat.completions.create(
        **args, top_logprobs=4, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = [c.choices[0].logprobs.content for c in streamed if c.choices and c.choices[0].logprobs]
    assert [e.model_dump() for chunk in chunks for e in chunk] == [e.model_dump() for e in content]
    # logprobs without top_logprobs: each token's own, and an empty top list (OpenAI's default of 0)
    bare = client.chat.completions.create(**args)
    assert [e.top_logprobs for e in bare.choices[0].logprobs.content] == [[]] * len(output)


def test_streamed_completion_logprobs_equal_the_whole_ones(http):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 2, "echo": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    parts = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for key, values in json.loads(line[6:])["choices"][0]["logprobs"].items():
                    parts[key] += values
    assert parts == whole


def test_a_list_of_prompts_gets_a_choice_each_in_order(http):
    prompts = ["The expert said", "Hello", "A"]
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "logprobs": 1}
    alone = [http.post("/v1/completions", json={**body, "prompt": p}).json() for p in prompts]
    together = http.post("/v1/completions", json={**body, "prompt": prompts}).json()
    assert [c["index"] for c in together["choices"]] == [0, 1, 2]
    for one, choice in zip(alone, together["choices"]):
        assert choice["text"] == one["choices"][0]["text"]
        assert choice["logprobs"]["tokens"] == one["choices"][0]["logprobs"]["tokens"]
    assert together["usage"]["completion_tokens"] == 12
    assert together["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    # Streamed: each chunk names its prompt's choice; every choice finishes once, on its last chunk.
    with http.stream("POST", "/v1/completions", json={**body, "prompt": prompts, "stream": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    chunks = streamed_choices(events)
    assert sorted(chunks) == [0, 1, 2]
    for i, one in enumerate(alone):
        assert "".join(c["text"] for c in chunks[i]) == one["choices"][0]["text"]
        assert chunks[i][-1]["finish_reason"] == one["choices"][0]["finish_reason"]


def _close(x: float | None, y: float | None) -> bool:
    return (x is None and y is None) or (x is not None and y is not None and abs(x - y) < LOGPROB_TOL)


def _same_logprobs(a: dict, b: dict) -> bool:
    """Completions logprobs equal but for float noise (a request batched with others runs other matmul shapes)."""
    tops = zip(a["top_logprobs"], b["top_logprobs"], strict=True)
    return (
        a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"]
        and all(_close(x, y) for x, y in zip(a["token_logprobs"], b["token_logprobs"], strict=True))
        and all((x is None and y is None) or (x.keys() == y.keys() and all(_close(x[k], y[k]) for k in x))
                for x, y in tops)
    )  # fmt: skip


def test_n_sequences_of_a_list_of_prompts_are_choices_p_times_n_plus_i_with_their_logprobs(http):
    """n=2 × two prompts: choice p * 2 + i is prompt p's sequence i (its seed + i, as vLLM derives it), whose text and
    log-probabilities equal those of that sequence requested alone; its prompt's log-probabilities are shared by
    its choices; usage counts each prompt once and every token. Streamed, the same choices chunk by chunk (echo's
    prompt scored with top 2 both ways: prompt_logprobs defaults to logprobs under echo)."""
    prompts, seed = ["The expert said", "Hello"], 7
    body = {
        "model": MODEL, "max_tokens": 4, "temperature": 1.0, "logprobs": 2, "echo": True, "ignore_eos": True,
    }  # fmt: skip
    together = http.post(
        "/v1/completions", json={**body, "prompt": prompts, "n": 2, "seed": seed, "prompt_logprobs": 2}
    ).json()
    choices = together["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    num_prompt_tokens = 0
    for p, prompt in enumerate(prompts):
        for i in range(2):
            alone = http.post(
                "/v1/completions", json={**body, "prompt": prompt, "seed": seed + i, "prompt_logprobs": 2}
            ).json()
            one, choice = alone["choices"][0], choices[p * 2 + i]
            assert choice["text"] == one["text"], (p, i)
            assert _same_logprobs(choice["logprobs"], one["logprobs"]), (p, i)
            assert [e and sorted(e) for e in choice["prompt_logprobs"]] == [
                e and sorted(e) for e in one["prompt_logprobs"]
            ]
        num_prompt_tokens += alone["usage"]["prompt_tokens"]
        assert choices[2 * p]["prompt_logprobs"] == choices[2 * p + 1]["prompt_logprobs"]
    assert len({c["text"] for c in choices}) == 4  # four different samples, not one repeated
    assert together["usage"]["prompt_tokens"] == num_prompt_tokens
    assert together["usage"]["completion_tokens"] == 2 * 2 * 4

    stream = {**body, "prompt": prompts, "n": 2, "seed": seed, "stream": True}
    stream["stream_options"] = {"include_usage": True}
    with http.stream("POST", "/v1/completions", json=stream) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    chunks = streamed_choices(events)  # in no order across choices; each ends once, on its last chunk
    assert sorted(chunks) == [0, 1, 2, 3]
    for index, choice in enumerate(choices):
        mine = chunks[index]
        assert mine[-1]["finish_reason"] == choice["finish_reason"], index
        parts = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for chunk in mine:
            for key, values in chunk["logprobs"].items():
                parts[key] += values
        assert "".join(c["text"] for c in mine) == choice["text"], index
        assert _same_logprobs(parts, choice["logprobs"]), index
    assert events[-1]["usage"] == together["usage"]


def test_prompts_needing_more_kv_than_the_cache_holds_run_in_turn(http):
    # Each reserves 3 blocks (3 + 40 tokens): 8 of them need twice the cache; admitted as they start, they finish.
    prompts = [[1, 30 + i, 7] for i in range(8)]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8 * 40


def test_tokenize_and_detokenize_as_vllm_serves_them(http, tokenizer, server):
    got = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    ids = tokenizer.encode("Hello world")
    assert got == {
        "count": len(ids), "max_model_len": got["max_model_len"], "tokens": ids,
        "token_strs": tokenizer.token_strs(ids),
    }  # fmt: skip
    bare = http.post(
        "/tokenize", json={"model": MODEL, "prompt": "Hello", "add_special_tokens": False}
    ).json()
    assert (
        bare["tokens"] == tokenizer.encode("Hello", add_special_tokens=False) and bare["token_strs"] is None
    )
    messages = [{"role": "user", "content": "hi"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tokenizer.encode_chat(messages)
    assert http.post("/detokenize", json={"tokens": ids}).json() == {
        "prompt": tokenizer.decode(ids, skip_special_tokens=False)
    }
    info = http.get("/tokenizer_info").json()  # what lm-evaluation-harness probes for
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert http.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404
    bad = http.post("/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


BAD = [
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ("/v1/completions", {"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": "2"}, "logprobs"),
    ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": ["a"] * (MAX_PROMPTS + 1)}, "prompt"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"echo": True}, "echo"),  # chat's echo (repeat the last message): not served
    ("/v1/completions", {"logprobs": 1, "return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    ("/v1/completions", {"logprobs": 1, "logprob_token_ids": [5]}, "logprob_token_ids"),
]


@pytest.mark.parametrize(
    ("path", "extra", "param"), BAD, ids=[f"{p[4:]}:{json.dumps(e)[:40]}" for p, e, _ in BAD]
)
def test_bad_values_get_a_400_naming_the_parameter(http, path, extra, param):
    body = {"model": MODEL, "max_tokens": 2}
    body |= (
        {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    )
    response = http.post(path, json=body | extra)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
