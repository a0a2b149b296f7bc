"""The OpenAI-compatible server as clients use it: a live `python -m nanovllm.serve` on a tiny
random model, driven by the real `openai` client (and raw HTTP where the client hides details),
judged against offline `LLM.generate` / `LLM.chat` on the same model."""
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nanovllm import LLM, SamplingParams
from nanovllm.serve.cli import parse_args
from tests.conftest import alive, child_pids, free_port, mixed_prompts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_KEY = "test-key"
MODEL_NAME = "tiny-qwen3"
ENGINE_ARGS = dict(device="cpu", max_model_len=512, kvcache_block_size=16, num_kvcache_blocks=160)
GREEDY = dict(temperature=0, ignore_eos=True)


def engine_flags(engine_args: dict) -> list[str]:
    return [item for name, value in engine_args.items() for item in (f"--{name.replace('_', '-')}", str(value))]


def start_server(path: str | None, port: int, *flags: str) -> subprocess.Popen:
    """`python -m nanovllm.serve [path] --port port flags...` (no path: the demo model)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = [sys.executable, "-m", "nanovllm.serve", *([path] if path else []), "--port", str(port),
               "--log-level", "warning", *flags]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_ready(server: subprocess.Popen, port: int, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}:\n{server.stdout.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.kill()
    raise RuntimeError("the server did not become ready")


@contextlib.contextmanager
def running_server(path: str | None, *flags: str):
    """A live `nanovllm serve` on a free port for the block; its base URL. Killed after."""
    port = free_port()
    process = start_server(path, port, *flags)
    try:
        wait_ready(process, port)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait(60)


@pytest.fixture(scope="module")
def path(model_paths) -> str:
    return model_paths["gqa_tied"]


@pytest.fixture(scope="module")
def server_process(path):
    """The server every test here talks to; the last test stops it with SIGINT."""
    port = free_port()
    process = start_server(path, port, "--api-key", API_KEY, "--served-model-name", MODEL_NAME,
                           *engine_flags(ENGINE_ARGS))
    wait_ready(process, port)
    yield f"http://127.0.0.1:{port}", process
    if process.poll() is None:
        process.kill()
        process.wait(60)


@pytest.fixture(scope="module")
def server(server_process) -> str:
    return server_process[0]


@pytest.fixture(scope="module")
def offline(path):
    with LLM(path, **ENGINE_ARGS) as llm:
        yield llm


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        yield client


def stop_string_from(text: str, length: int) -> str:
    """Plain letters from the second half of a greedy output: a stop string it is known to reach."""
    match = re.search("[A-Za-z ]{%d}" % length, text[len(text) // 3:])
    assert match, f"no {length} plain letters in {text!r}"
    return match.group()


def metrics(http: httpx.Client) -> dict[str, float]:
    """Every sample of /metrics by name (labels dropped; this server has one model)."""
    samples = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            key = sample.name + "".join(f"|{v}" for k, v in sorted(sample.labels.items())
                                        if k not in ("model_name",))
            samples[key] = sample.value
    return samples


def wait_idle(http: httpx.Client, timeout: float = 15.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        if m["nanovllm:num_requests_running"] == 0 and m["nanovllm:num_requests_waiting"] == 0 \
                and m["nanovllm:kv_cache_usage_perc"] == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.05)


# ---- completions and chat against offline generation -----------------------------------------

def test_health_and_models(server, http):
    assert httpx.get(f"{server}/health").status_code == 200          # no key needed
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME] and models["object"] == "list"


def test_completion_equals_offline_greedy(client, offline):
    prompt = "The capital of France"
    expected = offline.generate([prompt], SamplingParams(max_tokens=20, **GREEDY), use_tqdm=False)[0]
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=20, temperature=0,
                                         extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert choice.text == expected["text"] and choice.finish_reason == "length" and choice.index == 0
    assert response.usage.prompt_tokens == len(expected["prompt_token_ids"])
    assert response.usage.completion_tokens == 20 == len(expected["token_ids"])
    assert response.usage.total_tokens == response.usage.prompt_tokens + 20
    assert response.model == MODEL_NAME and response.object == "text_completion"


def test_completion_prompt_forms(client, offline):
    vocab = offline.config.hf_config.vocab_size
    ids = mixed_prompts(vocab, lengths=(5, 30, 12))
    params = SamplingParams(max_tokens=8, **GREEDY)
    expected = offline.generate(["hello there", "a b c"] + ids, params, use_tqdm=False)
    kwargs = dict(model=MODEL_NAME, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    one = client.completions.create(prompt=ids[0], **kwargs)
    assert one.choices[0].text == expected[2]["text"]
    strings = client.completions.create(prompt=["hello there", "a b c"], **kwargs)
    assert [c.text for c in sorted(strings.choices, key=lambda c: c.index)] == [e["text"] for e in expected[:2]]
    lists = client.completions.create(prompt=ids, **kwargs)
    assert [c.index for c in lists.choices] == [0, 1, 2]
    assert [c.text for c in lists.choices] == [e["text"] for e in expected[2:]]
    assert lists.usage.prompt_tokens == sum(len(p) for p in ids)
    assert lists.usage.completion_tokens == 3 * 8


def test_streamed_completion_equals_offline(client, http, offline):
    prompt = "Tell me a story"
    expected = offline.generate([prompt], SamplingParams(max_tokens=200, **GREEDY), use_tqdm=False)[0]
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=200, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == expected["text"]
    # streamed, not sent at the end. Outputs that queue up while the server's reader is busy come
    # joined (RequestStream), so how many chunks a busy machine yields varies: 30 tokens once came
    # as one chunk on two loaded cores; 200 engine steps are not all joined
    assert len(text_chunks) > 1
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 200
    assert chunks[-1].usage.prompt_tokens == len(expected["prompt_token_ids"])
    # the raw stream: server-sent events ending with [DONE]
    body = dict(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, stream=True)
    with http.stream("POST", "/v1/completions", json=body) as response:
        events = [line for line in response.iter_lines() if line]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_chat_equals_offline_chat(client, offline):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    expected = offline.chat(messages, SamplingParams(max_tokens=16, **GREEDY), use_tqdm=False)[0]
    response = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=16,
                                              temperature=0, extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected["text"]
    assert choice.finish_reason == "length" and response.object == "chat.completion"
    assert response.usage.prompt_tokens == len(offline.apply_chat_template(messages))
    assert response.usage.completion_tokens == 16
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == response.usage.total_tokens


def test_stop_strings_cut_text_streamed_or_not(client, offline):
    prompt = "List all prime numbers"
    text = offline.generate([prompt], SamplingParams(max_tokens=40, **GREEDY), use_tqdm=False)[0]["text"]
    stop = stop_string_from(text, 2)
    expected = offline.generate([prompt], SamplingParams(max_tokens=40, stop=[stop], **GREEDY), use_tqdm=False)[0]
    assert expected["finish_reason"] == "stop"
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0, stop=[stop],
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    assert whole.text == expected["text"] and whole.finish_reason == "stop" and stop not in whole.text
    streamed = ""
    for chunk in client.completions.create(stream=True, **kwargs):
        streamed += chunk.choices[0].text
        assert stop not in streamed
    assert streamed == expected["text"]


def seeded_n(n: int, max_tokens: int = 12, seed: int = 5) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def test_n_choices_equal_offline_n_streamed_or_not(client, offline):
    """n is SamplingParams.n: choice i is completion i of offline generate with the same seed."""
    prompt = "Introduce yourself"
    expected = offline.generate([prompt], seeded_n(3), use_tqdm=False)[0]["outputs"]
    assert len({c["text"] for c in expected}) == 3                   # the completions differ
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=1.0, seed=5, n=3,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.text for c in whole.choices] == [c["text"] for c in expected]
    assert [c.finish_reason for c in whole.choices] == ["length"] * 3
    assert whole.usage.completion_tokens == 36
    assert whole.usage.prompt_tokens == len(offline.tokenizer.encode(prompt))     # the prompt counted once
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)}
    assert [texts[i] for i in range(3)] == [c["text"] for c in expected]
    ends = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(choice.index for choice in ends) == [0, 1, 2] and {c.finish_reason for c in ends} == {"length"}
    assert chunks[-1].usage.completion_tokens == 36 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    expected_chat = offline.chat(messages, seeded_n(2, max_tokens=8, seed=9), use_tqdm=False)[0]["outputs"]
    chat_kwargs = dict(model=MODEL_NAME, messages=messages, n=2, max_tokens=8, temperature=1.0, seed=9,
                       extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(**chat_kwargs)
    assert [c.message.content for c in chat.choices] == [c["text"] for c in expected_chat]
    chat_chunks = list(client.chat.completions.create(stream=True, **chat_kwargs))
    assert {c.choices[0].index for c in chat_chunks if c.choices[0].delta.role == "assistant"} == {0, 1}
    assert ["".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices[0].index == i)
            for i in range(2)] == [c["text"] for c in expected_chat]


def test_n_greedy_choices_are_copies_of_greedy(client, offline):
    prompt = "The weather today"
    expected = offline.generate([prompt], SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)[0]["text"]
    kwargs = dict(model=MODEL_NAME, prompt=prompt, n=4, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert [c.text for c in client.completions.create(**kwargs).choices] == [expected] * 4
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(4)] == [expected] * 4


def test_n_with_several_prompts_numbers_choices_prompt_major(client, offline):
    prompts = ["first prompt", "a second, longer prompt here"]
    expected = offline.generate(prompts, seeded_n(2, max_tokens=8, seed=11), use_tqdm=False)
    want = [c["text"] for out in expected for c in out["outputs"]]             # prompt 0's two, then prompt 1's
    kwargs = dict(model=MODEL_NAME, prompt=prompts, n=2, max_tokens=8, temperature=1.0, seed=11,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3] and [c.text for c in whole.choices] == want
    assert whole.usage.prompt_tokens == sum(len(out["prompt_token_ids"]) for out in expected)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(4)] == want


def test_an_n_request_holds_its_prompt_once(path, offline):
    """In process (the app over an AsyncLLM without prefix caching, whose every step is measured):
    a streamed n=4 request prefills its prompt once (the prompt-token counter grows by one prompt)
    and at its peak holds fewer KV blocks than two n=1 requests would; four separate requests
    would hold four prompts."""
    import asyncio

    from nanovllm import AsyncLLM
    from nanovllm.serve.app import build_app

    llm = AsyncLLM(path, engine_process=False, **{**ENGINE_ARGS, "enable_prefix_caching": False})
    step_updates, used = llm.engine.step_updates, []

    def measured_step_updates(*args):
        updates = step_updates(*args)
        used.append(llm.engine.core.scheduler.block_manager.num_used_blocks)
        return updates

    llm.engine.step_updates = measured_step_updates     # set while the thread idles, before any request
    prompt = mixed_prompts(offline.config.hf_config.vocab_size, lengths=(200,), seed=41)[0]
    full, tail = divmod(len(prompt), ENGINE_ARGS["kvcache_block_size"])     # 12 full blocks, 8 tokens

    async def stream(client: openai.AsyncOpenAI, n: int) -> tuple[list[str], int, int]:
        """Each choice's streamed text, the peak of used blocks and the prompt tokens counted."""
        used.clear()
        prompt_tokens = llm.stats()["prompt_tokens"]
        chunks = await client.completions.create(model=MODEL_NAME, prompt=prompt, n=n, max_tokens=20, seed=3,
                                                 temperature=1.0, stream=True, extra_body={"ignore_eos": True})
        texts = [""] * n
        async for chunk in chunks:
            texts[chunk.choices[0].index] += chunk.choices[0].text
        return texts, max(used), llm.stats()["prompt_tokens"] - prompt_tokens

    async def main():
        transport = httpx.ASGITransport(app=build_app(llm, MODEL_NAME))
        async with httpx.AsyncClient(transport=transport) as http_client:
            client = openai.AsyncOpenAI(base_url="http://nanovllm/v1", api_key="none", http_client=http_client)
            return await stream(client, 1), await stream(client, 4)

    try:
        (_, one_peak, one_prompt), (texts, four_peak, four_prompt) = asyncio.run(asyncio.wait_for(main(), 120))
        assert llm.engine.core.scheduler.block_manager.num_used_blocks == 0
    finally:
        llm.shutdown()
    expected = offline.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=20,
                                                         ignore_eos=True), use_tqdm=False)[0]["outputs"]
    assert texts == [c["text"] for c in expected]
    assert one_prompt == four_prompt == len(prompt)                      # prefilled once
    assert one_peak == full + 2                                          # 8 + 20 tokens: two blocks of its own
    assert four_peak == full + 4 * 2 < 2 * one_peak                      # shared prompt blocks, four own tails


def test_hang_up_of_an_n_stream_frees_every_completion(server, http):
    before = wait_idle(http)
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "go on"}], n=3,
                                            max_tokens=400, temperature=0.7, stream=True,
                                            extra_body={"ignore_eos": True})
    for count, _ in enumerate(stream):
        if count == 8:
            break
    stream.close()
    after = wait_idle(http)
    assert after["nanovllm:num_requests_running"] == 0 and after["nanovllm:num_requests_waiting"] == 0
    assert after["nanovllm:kv_cache_usage_perc"] == 0
    generated = after["nanovllm:generation_tokens_total"] - before["nanovllm:generation_tokens_total"]
    assert 0 < generated < 3 * 400 / 2                                    # aborted, not run to the end
    finished = "nanovllm:request_success_total|length"
    assert after.get(finished, 0) == before.get(finished, 0)


def test_logprobs(client, offline):
    prompt = "What is the capital of France?"
    expected = offline.generate([prompt], SamplingParams(max_tokens=10, logprobs=3, **GREEDY), use_tqdm=False)[0]
    chosen = [lp[t] for t, lp in zip(expected["token_ids"], expected["logprobs"])]
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0, logprobs=3,
                                         extra_body={"ignore_eos": True})
    logprobs = response.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx(chosen, abs=1e-4)
    assert response.choices[0].text == expected["text"] and len(logprobs.tokens) == 10
    # greedy: the chosen token is the most likely one (keys are token strings, which may collide)
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert [max(top.values()) for top in logprobs.top_logprobs] == pytest.approx(chosen, abs=1e-4)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=10, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    chat_expected = offline.chat([{"role": "user", "content": prompt}],
                                 SamplingParams(max_tokens=10, logprobs=2, **GREEDY), use_tqdm=False)[0]
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [lp[t] for t, lp in zip(chat_expected["token_ids"], chat_expected["logprobs"])], abs=1e-4)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6)
               and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    streamed = [c for c in client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=10, temperature=0,
        logprobs=True, top_logprobs=2, stream=True, extra_body={"ignore_eos": True}) if c.choices[0].logprobs]
    assert [e.logprob for c in streamed for e in c.choices[0].logprobs.content] == \
        pytest.approx([c.logprob for c in content], abs=1e-6)


def test_metrics(client, http):
    before = wait_idle(http)
    response = client.completions.create(model=MODEL_NAME, prompt="count the tokens", max_tokens=7,
                                         temperature=0, extra_body={"ignore_eos": True})
    after = wait_idle(http)
    assert after["nanovllm:generation_tokens_total"] - before["nanovllm:generation_tokens_total"] == 7
    assert after["nanovllm:prompt_tokens_total"] - before["nanovllm:prompt_tokens_total"] == \
        response.usage.prompt_tokens
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert after[f"nanovllm:{name}_count"] == before.get(f"nanovllm:{name}_count", 0) + 1
    assert after["nanovllm:e2e_request_latency_seconds_sum"] > before.get("nanovllm:e2e_request_latency_seconds_sum", 0)
    assert after["nanovllm:prefix_cache_queries_total"] >= after["nanovllm:prefix_cache_hits_total"] >= 0
    assert 0 <= after["nanovllm:prefix_cache_hit_rate"] <= 1


def test_streamed_logprobs_come_with_their_tokens(client):
    """Each chunk carries its own tokens' logprobs (not all at the end); joined per choice they equal
    the whole response's, for completions (n=2, seeded) and chat."""
    kwargs = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=4, n=2,
                  logprobs=2, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        with_logprobs = [c for c in mine if c.logprobs and c.logprobs.tokens]
        assert len(with_logprobs) > 1 and mine[-1].finish_reason == "length"
        assert with_logprobs[0] is not mine[-1]                         # some arrived before the last chunk
        joined = {key: [v for c in with_logprobs for v in getattr(c.logprobs, key)]
                  for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        assert joined["tokens"] == choice.logprobs.tokens and len(joined["tokens"]) == 12
        assert joined["token_logprobs"] == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5)
        assert joined["text_offset"] == choice.logprobs.text_offset
        for got, want in zip(joined["top_logprobs"], choice.logprobs.top_logprobs, strict=True):
            assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()), abs=1e-5)
    chat_kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Say something"}], max_tokens=10,
                       temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = client.chat.completions.create(**chat_kwargs).choices[0].logprobs.content
    streamed = [c for c in client.chat.completions.create(stream=True, **chat_kwargs)
                if c.choices[0].logprobs and c.choices[0].logprobs.content]
    assert len(streamed) > 1
    entries = [e for c in streamed for e in c.choices[0].logprobs.content]
    assert [e.token for e in entries] == [e.token for e in content]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in content], abs=1e-5)
    assert [[t.logprob for t in e.top_logprobs] for e in entries] == \
        [pytest.approx([t.logprob for t in e.top_logprobs], abs=1e-5) for e in content]


# ---- many clients, and clients that leave ------------------------------------------------------

def test_concurrent_streams_with_hang_ups(server, offline, http):
    vocab = offline.config.hf_config.vocab_size
    prompts = mixed_prompts(vocab, lengths=[4 + (7 * i) % 60 for i in range(48)], seed=3)
    expected = offline.generate(prompts, SamplingParams(max_tokens=16, **GREEDY), use_tqdm=False)
    before = wait_idle(http)
    results, errors = {}, []
    quitters = set(range(0, 48, 4))                                   # 12 hang up after a few chunks

    def one(i: int) -> None:
        try:
            client = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)
            stream = client.completions.create(model=MODEL_NAME, prompt=prompts[i], max_tokens=16 if i not in quitters
                                               else 400, temperature=0, stream=True, extra_body={"ignore_eos": True})
            text = ""
            for n, chunk in enumerate(stream):
                text += chunk.choices[0].text
                if i in quitters and n == 2:
                    stream.close()
                    return
            results[i] = text
        except Exception as e:      # reported below; a thread cannot fail the test itself
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(48)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors
    assert sorted(results) == sorted(set(range(48)) - quitters)
    for i, text in results.items():
        assert text == expected[i]["text"], i
    idle = wait_idle(http)
    assert idle["nanovllm:num_requests_running"] == 0 and idle["nanovllm:kv_cache_usage_perc"] == 0
    finished = "nanovllm:request_success_total|length"
    assert idle.get(finished, 0) - before.get(finished, 0) == 36         # the quitters never finished
    # they asked for 400 tokens each: run to the end, they would have made 12 * 400 more
    generated = idle["nanovllm:generation_tokens_total"] - before["nanovllm:generation_tokens_total"]
    assert 36 * 16 <= generated < 36 * 16 + 12 * 200


def test_disconnected_non_streaming_client_is_aborted(server, http):
    before = wait_idle(http)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=0.3,
                   json=dict(model=MODEL_NAME, prompt="never mind", max_tokens=500, ignore_eos=True))
    after = wait_idle(http, timeout=5.0)
    assert after["nanovllm:num_requests_running"] == 0 and after["nanovllm:kv_cache_usage_perc"] == 0
    finished = "nanovllm:request_success_total|length"
    assert after.get(finished, 0) == before.get(finished, 0)           # aborted, not run to its end
    assert after["nanovllm:generation_tokens_total"] - before["nanovllm:generation_tokens_total"] < 500


# ---- errors --------------------------------------------------------------------------------------

BAD_COMPLETIONS = [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "min_p": 2}, "min_p"),
    ({"prompt": "hi", "top_k": -5}, "top_k"),
    ({"prompt": "hi", "seed": -1}, "seed"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "logprobs": 99}, "logprobs"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "stop_token_ids": [-3]}, "stop_token_ids"),
    ({"prompt": "hi", "min_tokens": 50, "max_tokens": 5}, "min_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "ignore_eos": "perhaps"}, "ignore_eos"),
    ({"prompt": "hi", "not_a_field": 1}, "not_a_field"),
    ({"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10 ** 6]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "word " * 600}, "prompt"),
    ({}, "prompt"),
]
BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 50, "logprobs": True}, "logprobs"),
]


def assert_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS)
def test_bad_completion_requests_are_400(http, body, param):
    assert_error(http.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize("body,param", BAD_CHATS)
def test_bad_chat_requests_are_400(http, body, param):
    assert_error(http.post("/v1/chat/completions", json=body), 400, param)


def test_bad_json_unknown_model_and_api_key(server, http, client):
    for route in ("/v1/completions", "/v1/chat/completions"):
        response = http.post(route, content=b'{"prompt": "unterminated', headers={"content-type": "application/json"})
        assert_error(response, 400, None)
        assert_error(http.post(route, content=b"[1, 2]", headers={"content-type": "application/json"}), 400, None)
    assert_error(http.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"}), 404, "model")
    assert http.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"}).json()["error"]["code"] == \
        "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        assert_error(httpx.post(f"{server}/v1/completions", json={"prompt": "hi"}, headers=headers), 401, None)
        assert_error(httpx.get(f"{server}/v1/models", headers=headers), 401, None)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL_NAME, prompt="hi", temperature=-1)
    assert raised.value.body["param"] == "temperature"


def test_server_still_serves_after_bad_requests(server, client, offline):
    for body in [b"garbage", b"{}", json.dumps({"prompt": [[]]}).encode()]:
        httpx.post(f"{server}/v1/completions", content=body, headers={"Authorization": f"Bearer {API_KEY}"})
    expected = offline.generate(["ok"], SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)[0]
    response = client.completions.create(model=MODEL_NAME, prompt="ok", max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert response.choices[0].text == expected["text"]
    assert httpx.get(f"{server}/health").status_code == 200


@pytest.mark.parametrize("engine_process", [False, True], ids=["step_raises_on_thread", "process_killed"])
def test_engine_failure_reaches_clients_and_health(path, engine_process):
    """In process (the app over an AsyncLLM whose engine fails mid-stream: a step raises on the
    engine thread, or the engine process is killed): the stream ends with an error event, later
    requests get a 500 error body, /health turns 503; nothing hangs."""
    import asyncio

    from nanovllm import AsyncLLM
    from nanovllm.serve.app import build_app

    llm = AsyncLLM(path, engine_process=engine_process, **ENGINE_ARGS)

    def break_engine() -> str:
        """Make the engine fail; the words its error will carry."""
        if engine_process:
            os.kill(llm._process.pid, signal.SIGKILL)
            return "died"

        def failing_step_updates(*args):
            raise RuntimeError("device fell over")
        llm.engine.step_updates = failing_step_updates
        return "device fell over"

    async def main():
        transport = httpx.ASGITransport(app=build_app(llm, MODEL_NAME))
        async with httpx.AsyncClient(transport=transport, base_url="http://nanovllm") as client:
            assert (await client.get("/health")).status_code == 200
            generated = llm.stats()["generation_tokens"]
            body = dict(prompt="hi", max_tokens=400, stream=True, ignore_eos=True)
            streamed = asyncio.ensure_future(client.post("/v1/completions", json=body))
            while llm.stats()["generation_tokens"] < generated + 3:        # the stream flows
                await asyncio.sleep(0.01)
            words = break_engine()
            events = [line for line in (await streamed).text.splitlines() if line]
            assert events[-1] == "data: [DONE]" and words in json.loads(events[-2][6:])["error"]["message"]
            assert len(events) < 400
            assert_error(await client.post("/v1/completions", json=dict(prompt="hi")), 500, None)
            assert (await client.get("/health")).status_code == 503

    try:
        asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        llm.shutdown()


# ---- the command line -----------------------------------------------------------------------------

def test_engine_arguments_become_flags():
    args, engine_args = parse_args(["/models/m", "--port", "9001", "--api-key", "k", "--max-model-len", "256",
                                    "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.5",
                                    "--tensor-parallel-size", "2", "--enforce-eager"])
    assert (args.model, args.port, args.api_key, args.host) == ("/models/m", 9001, "k", "127.0.0.1")
    assert engine_args == {"max_model_len": 256, "enable_prefix_caching": False, "gpu_memory_utilization": 0.5,
                           "tensor_parallel_size": 2, "enforce_eager": True}
    assert parse_args([])[0].model is None and parse_args([])[1] == {}      # engine defaults stay the engine's
    with pytest.raises(SystemExit):
        parse_args(["/models/m", "--max-model-len", "many"])


def test_console_script_bad_model_and_taken_port_exit_cleanly(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO)
    console = "import sys; from nanovllm.serve.cli import console; sys.argv = ['nanovllm'] + sys.argv[1:]; console()"
    shown = subprocess.run([sys.executable, "-c", console, "serve", "--help"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "--max-num-seqs" in shown.stdout and "--api-key" in shown.stdout
    missing = subprocess.run([sys.executable, "-m", "nanovllm.serve", str(tmp_path / "none"), "--device", "cpu"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "model" in missing.stderr and "Traceback" not in missing.stderr
    with socket.socket() as taken:      # the port is checked first: a missing model is not even looked at
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = subprocess.run([sys.executable, "-m", "nanovllm.serve", str(tmp_path / "none"), "--port", str(port)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert busy.returncode == 1 and f"--port {port}" in busy.stderr and "in use" in busy.stderr, busy.stderr
    assert "Traceback" not in busy.stderr and "model" not in busy.stderr


# ---- bench_serving.py and shutdown ---------------------------------------------------------------

def test_bench_serving_against_the_server(server, tmp_path):
    result_file = tmp_path / "result.json"
    command = [sys.executable, os.path.join(REPO, "bench_serving.py"), "--base-url", server, "--api-key", API_KEY,
               "--num-prompts", "6", "--request-rate", "20", "--min-input-len", "4", "--max-input-len", "20",
               "--min-output-len", "3", "--max-output-len", "12", "--max-token-id", "400",
               "--save-result", str(result_file)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(result_file.read_text())
    assert result["completed"] == 6 and result["failed"] == 0 and result["model"] == MODEL_NAME
    assert result["total_output_tokens"] == sum(r["output_tokens"] for r in result["requests"])
    assert all(3 <= r["output_tokens"] <= 12 for r in result["requests"])
    assert result["output_throughput"] > 0 and result["ttft_s"]["p99"] >= result["ttft_s"]["p50"] > 0
    assert "TTFT" in done.stdout and "p99" in done.stdout


def stream_then_signal(url: str, process: subprocess.Popen, sig: int, headers: dict | None = None,
                       max_tokens: int = 480) -> list[str]:
    """Open a long stream, send sig once it flows; the server must exit with 0. The stream's lines."""
    lines = []
    body = dict(prompt="a long story", max_tokens=max_tokens, ignore_eos=True, stream=True)

    def read_stream():
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60) as s:
            lines.extend(line for line in s.iter_lines() if line)

    reader = threading.Thread(target=read_stream)
    reader.start()
    deadline = time.monotonic() + 60
    while len(lines) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(sig)
    assert process.wait(60) == 0, process.stdout.read()
    reader.join(10)
    assert lines[-1] == "data: [DONE]" and any('"error"' in line for line in lines)    # ended, not cut
    assert len(lines) < max_tokens
    return lines


def test_demo_model_by_default_and_sigterm_stops_the_workers():
    """No MODEL serves the bundled demo model (it knows its sums); with tensor_parallel_size=2 the
    server has a worker process, and SIGTERM mid-stream ends the stream, stops the worker and
    exits with status 0."""
    port = free_port()
    server = start_server(None, port, "--device", "cpu", "--tensor-parallel-size", "2", "--max-model-len", "1024")
    try:
        wait_ready(server, port)
        children = child_pids(server.pid)
        assert children, "a tensor-parallel server has a worker process"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["nanovllm-demo"]
        answer = client.chat.completions.create(model="nanovllm-demo", temperature=0, max_tokens=20,
                                                messages=[{"role": "user", "content": "What is 123 + 456?"}])
        assert "579" in answer.choices[0].message.content
        stream_then_signal(f"http://127.0.0.1:{port}", server, signal.SIGTERM, max_tokens=1000)
        time.sleep(0.2)
        assert not [pid for pid in children if alive(pid)]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_sigint_stops_the_server_gracefully(server_process):
    """Last in this file: it stops the server the other tests used."""
    url, process = server_process
    children = child_pids(process.pid)
    stream_then_signal(url, process, signal.SIGINT, headers={"Authorization": f"Bearer {API_KEY}"})
    time.sleep(0.2)
    assert not [pid for pid in children if alive(pid)]
