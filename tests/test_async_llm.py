"""AsyncLLM on the CPU: streamed outputs against the engine's own offline outputs, aborts that
free KV blocks, engine failures (an error in its loop, its process killed) that reach every
caller, and shutdown. The engine runs in its own process, as a server runs it; tests that inject
failures through `llm.engine` run it on a thread (engine_process=False)."""
import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from nanovllm import LLM, AsyncLLM, SamplingParams
from nanovllm.async_llm import EngineClosedError, EngineDeadError
from nanovllm.engine_loop import portable_exception
from tests.conftest import alive, child_pids, mixed_prompts

ENGINE_ARGS = dict(device="cpu", max_model_len=512, kvcache_block_size=16, num_kvcache_blocks=96)


@pytest.fixture(scope="module")
def path(model_paths) -> str:
    return model_paths["gqa_tied"]


@pytest.fixture(scope="module")
def llm(path):
    llm = AsyncLLM(path, **ENGINE_ARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def threaded(path):
    """The engine on a thread of this process, where tests can reach it (llm.engine)."""
    llm = AsyncLLM(path, engine_process=False, **ENGINE_ARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def offline(path):
    with LLM(path, **ENGINE_ARGS) as llm:
        yield llm


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


async def stream_all(llm: AsyncLLM, prompt, params, request_id=None) -> list[dict]:
    return [out async for out in llm.generate(prompt, params, request_id)]


def engine_idle(llm: AsyncLLM) -> bool:
    """What a user sees of an idle engine: no request running or waiting, no KV block used."""
    stats = llm.stats()
    return stats["kv_cache_usage"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def stop_string_from(text: str, length: int) -> str:
    """Plain letters from the second half of a greedy output: a stop string it is known to reach."""
    match = re.search("[A-Za-z ]{%d}" % length, text[len(text) // 3:])
    assert match, f"no {length} plain letters in {text!r}"
    return match.group()


def check_stream_matches(outs: list[dict], expected: dict) -> None:
    assert {o["index"] for o in outs} == {0}
    assert outs[-1]["finished"] and not any(o["finished"] for o in outs[:-1])
    assert "".join(o["delta_text"] for o in outs) == outs[-1]["text"] == expected["text"]
    assert [t for o in outs for t in o["delta_token_ids"]] == outs[-1]["token_ids"] == expected["token_ids"]
    for i, out in enumerate(outs):      # cumulative fields grow by the deltas
        assert out["text"] == "".join(o["delta_text"] for o in outs[:i + 1])
    assert outs[-1]["finish_reason"] == expected["finish_reason"]
    assert set(outs[-1]["metrics"]) >= {"time_to_first_token", "time_per_output_token", "latency"}
    assert "num_cached_tokens" in outs[-1]


def test_concurrent_streams_equal_offline_outputs(llm, offline):
    vocab = offline.config.hf_config.vocab_size
    prompts = mixed_prompts(vocab, lengths=(3, 40, 17, 100, 9, 64))
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5),
              SamplingParams(temperature=1.0, top_k=20, seed=1, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=33, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.5, top_p=0.9, seed=3, max_tokens=12)]
    expected = offline.generate(prompts, params, use_tqdm=False)

    async def main():
        return await asyncio.gather(*(stream_all(llm, p, sp) for p, sp in zip(prompts, params)))

    streamed = run(main())
    for outs, exp in zip(streamed, expected):
        check_stream_matches(outs, exp)
    streamed_logprobs = [lp for out in streamed[4] for lp in out["delta_logprobs"]]      # as they came
    for got, want in zip(streamed_logprobs, expected[4]["logprobs"], strict=True):
        assert got.keys() == want.keys() and all(abs(got[t] - want[t]) < 1e-5 for t in got)
    assert streamed[4][-1]["logprobs"] == streamed_logprobs
    assert all(out["delta_logprobs"] is None for out in streamed[0])                  # not asked for
    assert max(len(outs) for outs in streamed) > 10      # outputs arrive as tokens come, not at the end


def test_a_slow_reader_gets_joined_deltas(llm, offline):
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = offline.generate(["slow reader"], params, use_tqdm=False)[0]

    async def main():
        outs = []
        async for out in llm.generate("slow reader", params):
            outs.append(out)
            await asyncio.sleep(0.2)        # several engine steps pass per read
        return outs

    outs = run(main())
    check_stream_matches(outs, expected)
    assert len(outs) < 30 and any(len(o["delta_token_ids"]) > 1 for o in outs)


def test_many_streams_hear_every_few_steps(threaded, offline, monkeypatch):
    """With more live requests than STREAMS_PER_STEP, each hears from the engine every
    ceil(live / STREAMS_PER_STEP) steps: fewer, joined outputs, equal to offline all the same; the
    first output is never held back, and a request alone hears every step. (On a thread, where
    the engine loop sees the patched constant.)"""
    import nanovllm.engine_loop
    llm = threaded
    monkeypatch.setattr(nanovllm.engine_loop, "STREAMS_PER_STEP", 2)
    vocab = offline.config.hf_config.vocab_size
    prompts = mixed_prompts(vocab, lengths=(5, 9, 13, 7, 11, 6))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = offline.generate(prompts, params, use_tqdm=False)

    async def main():
        return await asyncio.gather(*(stream_all(llm, p, params) for p in prompts))

    streamed = run(main())
    for outs, exp in zip(streamed, expected):
        check_stream_matches(outs, exp)
        assert len(outs[0]["delta_token_ids"]) == 1                 # the first token came alone
        assert len(outs) <= 40 // 2 + 2                             # every 2 or 3 steps after it
    alone = run(stream_all(llm, prompts[0], params))
    check_stream_matches(alone, expected[0])
    assert len(alone) > 40 // 2 + 2                            # not held back (a slow reader may still join)


def test_stop_string_never_appears_in_deltas(llm, offline):
    prompt = "The capital of France"
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    text = offline.generate([prompt], greedy, use_tqdm=False)[0]["text"]
    stop = stop_string_from(text, 3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    expected = offline.generate([prompt], params, use_tqdm=False)[0]
    assert expected["finish_reason"] == "stop" and stop not in expected["text"]
    outs = run(stream_all(llm, prompt, params))
    check_stream_matches(outs, expected)
    sent = ""
    for out in outs:
        sent += out["delta_text"]
        assert stop not in sent


def check_n_stream_matches(outs: list[dict], expected: dict) -> None:
    """Per completion index: the deltas join to offline's completion (text, tokens, logprobs), the
    cumulative fields grow by them, and one output ends it; only the last output ends the request."""
    n = len(expected["outputs"])
    assert {o["index"] for o in outs} == set(range(n))
    assert outs[-1]["finished"] and not any(o["finished"] for o in outs[:-1])
    for want in expected["outputs"]:
        mine = [o for o in outs if o["index"] == want["index"]]
        text, token_ids, logprobs = "", [], []
        for out in mine:
            text, token_ids = text + out["delta_text"], token_ids + out["delta_token_ids"]
            logprobs += out["delta_logprobs"]
            assert out["text"] == text and out["token_ids"] == token_ids
        assert text == want["text"] and token_ids == want["token_ids"]
        for got, exp in zip(logprobs, want["logprobs"], strict=True):
            assert got.keys() == exp.keys() and all(abs(got[t] - exp[t]) < 1e-5 for t in got)
        assert [o["finish_reason"] for o in mine] == [None] * (len(mine) - 1) + [want["finish_reason"]]
    assert [c["token_ids"] for c in outs[-1]["outputs"]] == [c["token_ids"] for c in expected["outputs"]]


@pytest.mark.parametrize("slow", [False, True])
def test_an_n_stream_delivers_every_completion(llm, offline, slow):
    """n=3, seeded, with logprobs; completion 1 stops early on a stop token so the three end at
    different steps. A slow reader gets deltas joined per completion, never across them."""
    prompt = "three ways to say it"
    params = SamplingParams(n=3, temperature=1.0, seed=13, max_tokens=30, ignore_eos=True, logprobs=1)
    free = offline.generate([prompt], params, use_tqdm=False)[0]["outputs"]
    params.stop_token_ids = [free[1]["token_ids"][5]]
    expected = offline.generate([prompt], params, use_tqdm=False)[0]
    assert expected["outputs"][1]["finish_reason"] == "stop" and len(expected["outputs"][1]["token_ids"]) <= 6

    async def main():
        outs = []
        async for out in llm.generate(prompt, params):
            outs.append(out)
            if slow:
                await asyncio.sleep(0.15)       # several engine steps pass per read
        return outs

    outs = run(main())
    check_n_stream_matches(outs, expected)
    num_tokens = sum(len(c["token_ids"]) for c in expected["outputs"])
    if slow:
        assert len(outs) < num_tokens / 2 and any(len(o["delta_token_ids"]) > 1 for o in outs)
    else:
        assert len(outs) > num_tokens / 2       # outputs arrive as tokens come, not at the end


def test_leaving_an_n_stream_early_frees_every_completion(llm):
    long = SamplingParams(n=4, temperature=1.0, max_tokens=400, ignore_eos=True)

    async def main():
        indices = set()
        async for out in llm.generate("many long answers", long):
            indices.add(out["index"])
            if len(indices) == 4:
                break

    run(main())
    assert wait_until(lambda: engine_idle(llm))


def test_leaving_early_aborts_and_frees_blocks(llm):
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        seen = 0
        async for out in llm.generate("a long answer please", long):
            seen += len(out["delta_token_ids"])
            if seen >= 3:
                break
        return seen

    assert run(main()) >= 3
    assert wait_until(lambda: engine_idle(llm))


def test_abort_by_request_id_ends_the_stream(llm):
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        outs = []
        async for out in llm.generate("abort me", long, request_id="to-abort"):
            outs.append(out)
            if len(outs) == 2:
                assert await llm.abort("to-abort") is True
        assert await llm.abort("to-abort") is False
        return outs

    outs = run(main())
    assert outs[-1]["finished"] and outs[-1]["finish_reason"] == "abort"
    assert len(outs[-1]["token_ids"]) < 400
    assert outs[-1]["text"] == "".join(o["delta_text"] for o in outs)
    assert outs[-1]["token_ids"] == [t for o in outs for t in o["delta_token_ids"]]
    assert wait_until(lambda: engine_idle(llm))


def test_bad_requests_raise_and_the_engine_keeps_serving(llm, offline):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def main():
        with pytest.raises(ValueError, match="prompt"):
            await stream_all(llm, "", params)
        with pytest.raises(ValueError, match="prompt"):
            await stream_all(llm, [10 ** 9], params)
        with pytest.raises(TypeError, match="sampling_params"):
            await stream_all(llm, "hi", {"temperature": 0})
        running = llm.generate("first", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), "dup")
        await running.__anext__()
        with pytest.raises(ValueError):
            await stream_all(llm, "second", params, request_id="dup")
        await running.aclose()
        return await stream_all(llm, "still fine", params)

    outs = run(main())
    check_stream_matches(outs, offline.generate(["still fine"], params, use_tqdm=False)[0])


def test_engine_loop_error_reaches_every_caller(path):
    llm = AsyncLLM(path, engine_process=False, **ENGINE_ARGS)
    step_updates = llm.engine.step_updates
    calls = []

    def failing_step_updates(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device fell over")
        return step_updates(*args)

    llm.engine.step_updates = failing_step_updates    # set while the thread idles, before any request
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main():
        results = await asyncio.gather(*(stream_all(llm, f"prompt {i}", params) for i in range(3)),
                                       return_exceptions=True)
        with pytest.raises(EngineDeadError):
            await stream_all(llm, "after the failure", params)
        return results

    try:
        results = run(main())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "device fell over" in str(results[0]) and isinstance(results[0].__cause__, RuntimeError)
        assert not llm.is_alive
    finally:
        llm.shutdown()
    assert not any(thread.is_alive() for thread in llm._threads)


def test_engine_loop_idles_without_work(threaded):
    llm = threaded
    calls = []
    step_updates = llm.engine.step_updates

    def counted(*args):
        calls.append(1)
        return step_updates(*args)

    llm.engine.step_updates = counted
    try:
        run(stream_all(llm, "hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
        assert wait_until(lambda: llm.engine.is_finished())
        time.sleep(0.05)
        before = len(calls)
        time.sleep(0.5)
        assert len(calls) == before and before >= 4
    finally:
        del llm.engine.step_updates


@pytest.mark.parametrize("engine_process", [True, False])
def test_shutdown_ends_waiting_callers_and_the_engine(path, engine_process):
    llm = AsyncLLM(path, engine_process=engine_process, **ENGINE_ARGS)
    children = child_pids(os.getpid())
    if engine_process:
        assert llm._process.pid in children
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        stream = llm.generate("shut me down", long)
        first = await stream.__anext__()
        assert not first["finished"]
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        with pytest.raises(EngineClosedError):
            async for _ in stream:
                pass
        with pytest.raises(EngineClosedError):
            await stream_all(llm, "after shutdown", long)

    run(main())
    assert not any(thread.is_alive() for thread in llm._threads)
    if engine_process:          # it exited by itself (no terminate/kill), and left no process behind
        assert llm._process.exitcode == 0
        assert not [pid for pid in child_pids(os.getpid()) - (children - {llm._process.pid}) if alive(pid)]
        assert not alive(llm._process.pid)
    else:
        assert llm.engine.core is None          # the engine itself was shut down
    assert not llm.is_alive
    llm.shutdown()                                      # idempotent


def test_killed_engine_process_reaches_every_caller(path):
    """SIGKILL of the engine process mid-stream: every caller gets EngineDeadError at once, later
    requests too, /health's is_alive turns False, and shutdown returns without waiting."""
    llm = AsyncLLM(path, **ENGINE_ARGS)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def one(prompt: str, started: asyncio.Event) -> list[dict]:
        outs = []
        async for out in llm.generate(prompt, long):
            outs.append(out)
            started.set()
        return outs

    async def main():
        events = [asyncio.Event() for _ in range(3)]
        tasks = [asyncio.ensure_future(one(f"prompt {i}", e)) for i, e in enumerate(events)]
        await asyncio.gather(*(e.wait() for e in events))
        os.kill(llm._process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=10)
        noticed_in = time.monotonic() - killed_at
        with pytest.raises(EngineDeadError, match="died"):
            await stream_all(llm, "after the kill", long)
        with pytest.raises(EngineDeadError):
            await llm.abort("anything")
        return results, noticed_in

    try:
        results, noticed_in = run(main())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "exit code -9" in str(results[0].__cause__) and noticed_in < 5
        assert not llm.is_alive
    finally:
        started = time.monotonic()
        llm.shutdown()
    assert time.monotonic() - started < 5
    assert not any(thread.is_alive() for thread in llm._threads) and not alive(llm._process.pid)


FORGOTTEN_SHUTDOWN = """
import asyncio, sys
from nanovllm import AsyncLLM, SamplingParams
if __name__ == "__main__":
    llm = AsyncLLM(sys.argv[1], device="cpu", max_model_len=512, kvcache_block_size=16, num_kvcache_blocks=96)
    print("engine pid", llm._process.pid, flush=True)
    async def main():
        async for out in llm.generate("hi", SamplingParams(max_tokens=400, ignore_eos=True)):
            return out["delta_token_ids"]       # leaves a request running
    print(asyncio.run(main()), flush=True)
"""


def test_a_forgotten_shutdown_does_not_hang_exit(path, tmp_path):
    """A script that never calls shutdown, with a request still running, exits at once and takes
    the engine process with it."""
    script = tmp_path / "forgetful.py"
    script.write_text(FORGOTTEN_SHUTDOWN)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, str(script), path], capture_output=True, text=True, timeout=120,
                          cwd=repo, env=env)
    assert done.returncode == 0, done.stderr
    engine_pid = int(re.search(r"engine pid (\d+)", done.stdout).group(1))
    assert not alive(engine_pid)


@pytest.mark.parametrize("engine_process", [True, False])
def test_bad_engine_arguments_raise_from_the_constructor(path, engine_process):
    before = child_pids(os.getpid())
    with pytest.raises(TypeError, match="unknown engine argument"):
        AsyncLLM(path, engine_process=engine_process, device="cpu", not_an_argument=1)
    with pytest.raises(ValueError, match="model"):
        AsyncLLM(path + "-missing", engine_process=engine_process, device="cpu")
    with pytest.raises(ValueError, match="max_model_len"):
        AsyncLLM(path, engine_process=engine_process, device="cpu", max_model_len=1)
    with pytest.raises(TypeError, match="engine_process"):
        AsyncLLM(path, engine_process="yes", device="cpu")
    assert not [pid for pid in child_pids(os.getpid()) - before if alive(pid)]      # no engine process left


def test_a_request_id_that_does_not_pickle_is_refused(llm, offline):
    """The engine process gets requests through a pipe: an id that cannot go there is a TypeError
    for that request alone."""
    class LocalId:                  # a class defined in a function does not pickle
        pass

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def main():
        with pytest.raises(TypeError, match="pickle"):
            await stream_all(llm, "hello", params, request_id=LocalId())
        with pytest.raises(TypeError, match="request_id"):
            await stream_all(llm, "hello", params, request_id=["not", "hashable"])
        return await stream_all(llm, "hello", params)

    check_stream_matches(run(main()), offline.generate(["hello"], params, use_tqdm=False)[0])


def test_an_engine_error_that_does_not_pickle_becomes_a_runtime_error():
    class LocalError(Exception):    # defined in a function: does not pickle
        pass

    kept = ValueError("bad prompt")
    assert portable_exception(kept) is kept
    replaced = portable_exception(LocalError("device fell over"))
    assert type(replaced) is RuntimeError and "LocalError('device fell over')" in str(replaced)
