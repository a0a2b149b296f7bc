"""Per-step progress for streaming consumers (LLMEngine.step_updates), the incremental detokenizer
under it, and LLM.chat."""
import os
import shutil

import pytest
from transformers import AutoTokenizer

from nanovllm import LLM, SamplingParams
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from tests.conftest import mixed_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer(model_paths):
    return AutoTokenizer.from_pretrained(model_paths["gqa_tied"])


def stream(tokenizer, text: str, stop: list[str]) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed text's tokens one at a time; the deltas handed out after each."""
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, stop)
    deltas = []
    for n in range(1, len(ids) + 1):
        detokenizer.update(ids[:n], final=n == len(ids))
        deltas.append(detokenizer.delta(final=n == len(ids)))
    return deltas, detokenizer


def test_multibyte_characters_are_never_split(tokenizer):
    text = "naïve café — 你好 🙂 end"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.encode("ascii", "ignore").split()) + 8     # characters span several tokens
    assert any("\ufffd" in tokenizer.decode(ids[:n]) for n in range(1, len(ids)))
    deltas, _ = stream(tokenizer, text, [])
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


@pytest.mark.parametrize("text, stop, visible", [
    ("abc STOP def", ["STOP"], "abc "),                      # the stop string spans two tokens
    ("a STOX b STOP c", ["STOP"], "a STOX b "),              # a near miss is released, not lost
    ("one two three", ["two", "ne t"], "o"),                 # the earliest of several stops wins
    ("no stop here at all", ["STOP"], "no stop here at all"),
])
def test_stop_strings_are_never_shown(tokenizer, text, stop, visible):
    deltas, detokenizer = stream(tokenizer, text, stop)
    shown = ""
    for delta in deltas:
        shown += delta
        assert visible.startswith(shown)          # never a character of the stop string
    assert shown == visible == detokenizer.visible_text


def test_text_that_could_become_a_stop_string_is_held_back(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, ["STOP"])
    ids = tokenizer.encode("abc ST")
    detokenizer.update(ids)
    assert detokenizer.delta() == "abc "          # "ST" may still become "STOP"
    assert detokenizer.delta(final=True) == "ST"  # the request ended: nothing can follow


@pytest.mark.parametrize("only_r1_due", [False, True])
def test_step_updates_stream_what_generate_returns(model_paths, only_r1_due):
    """With `due` saying no to r0 and r2, they report once, at their end, with every token."""
    due = (lambda request_id: request_id == "r1") if only_r1_due else None
    llm = LLM(model_paths["gqa_tied"], kvcache_block_size=16)
    prompts = mixed_prompts(llm.config.hf_config.vocab_size, lengths=(12, 30, 5))
    expected = llm.generate(prompts, GREEDY, use_tqdm=False)
    full = expected[1]["text"]
    stop = next(full[i:i + 3] for i in range(len(full) // 2, len(full) - 3)
                if full[i:i + 3].strip() and full.find(full[i:i + 3]) == i)
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]), GREEDY]
    ids = [llm.engine.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
    texts, tokens, finals = {i: "" for i in ids}, {i: [] for i in ids}, {}
    num_updates = {i: 0 for i in ids}
    while not llm.engine.is_finished():
        for update in llm.engine.step_updates(due):
            num_updates[update.request_id] += 1
            assert update.request_id not in finals
            texts[update.request_id] += update.delta_text
            tokens[update.request_id] += update.new_token_ids
            assert update.text == texts[update.request_id] or not update.finished
            assert stop not in texts["r1"]
            if update.finished:
                finals[update.request_id] = update
                assert update.output["request_id"] == update.request_id
    assert sorted(finals) == ids
    assert num_updates["r1"] > 1 and (num_updates["r0"] == num_updates["r2"] == 1) == only_r1_due
    for i in (0, 2):
        out = finals[ids[i]].output
        assert tokens[ids[i]] == out["token_ids"] == expected[i]["token_ids"]
        assert texts[ids[i]] == out["text"] == expected[i]["text"]
        assert out["outputs"][0]["text"] == out["text"]
    cut = finals["r1"]
    assert cut.finish_reason == "stop" and texts["r1"] == full[:full.find(stop)] == cut.output["text"]
    assert tokens["r1"] == expected[1]["token_ids"][:len(tokens["r1"])]
    assert llm.engine.core.scheduler.block_manager.num_used_blocks == 0


def test_step_updates_carry_each_completions_new_logprobs(model_paths):
    """n=2 with logprobs: each update holds its completion's new tokens and their logprobs; joined per
    index they equal what generate returns. A request without logprobs gets None."""
    llm = LLM(model_paths["gqa_tied"], kvcache_block_size=16)
    prompt = mixed_prompts(llm.config.hf_config.vocab_size, lengths=(20,), seed=5)[0]
    params = SamplingParams(n=2, temperature=1.0, seed=8, max_tokens=12, ignore_eos=True, logprobs=3)
    expected = llm.generate([prompt], params, use_tqdm=False)[0]
    llm.engine.add_request(prompt, params, request_id="n2")
    llm.engine.add_request(prompt, GREEDY, request_id="plain")
    tokens, logprobs, outputs, steps = {0: [], 1: []}, {0: [], 1: []}, {}, 0
    while not llm.engine.is_finished():
        steps += 1
        for update in llm.engine.step_updates():
            assert update.request_id not in outputs                 # nothing after the request's output
            if update.output is not None:
                outputs[update.request_id] = update.output
            if update.request_id == "plain":
                assert update.new_logprobs is None
                continue
            assert len(update.new_logprobs) == len(update.new_token_ids)
            tokens[update.index] += update.new_token_ids
            logprobs[update.index] += update.new_logprobs
    assert steps > 5 and sorted(outputs) == ["n2", "plain"]
    for want in expected["outputs"]:
        assert tokens[want["index"]] == want["token_ids"]
        for got, exp in zip(logprobs[want["index"]], want["logprobs"], strict=True):
            assert got.keys() == exp.keys() and all(abs(got[t] - exp[t]) < 1e-5 for t in got)
    assert [c["token_ids"] for c in outputs["n2"]["outputs"]] == [c["token_ids"] for c in expected["outputs"]]


def test_chat_applies_the_template(model_paths, tmp_path):
    llm = LLM(model_paths["gqa_tied"], kvcache_block_size=16)
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    text = llm.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = llm.tokenizer.encode(text)
    single = llm.chat(conversation, GREEDY, use_tqdm=False)
    assert single[0]["prompt_token_ids"] == ids
    assert single[0]["token_ids"] == llm.generate([ids], GREEDY, use_tqdm=False)[0]["token_ids"]
    other = [{"role": "user", "content": "Hi"}]
    both = llm.chat([conversation, other], GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in both] == [single[0]["token_ids"],
                                              llm.chat(other, GREEDY, use_tqdm=False)[0]["token_ids"]]
    with pytest.raises(TypeError, match="messages"):
        llm.chat([{"role": "user"}], GREEDY, use_tqdm=False)
    no_template = tmp_path / "no_template"
    shutil.copytree(model_paths["gqa_tied"], no_template)
    os.remove(no_template / "chat_template.jinja")
    with pytest.raises(ValueError, match="chat template"):
        LLM(str(no_template), kvcache_block_size=16).chat(conversation, use_tqdm=False)


def test_stats_count_tokens_and_cache_hits(model_paths):
    llm = LLM(model_paths["gqa_tied"], kvcache_block_size=16)
    prompt = mixed_prompts(llm.config.hf_config.vocab_size, lengths=(40,))[0]
    llm.generate([prompt], GREEDY, use_tqdm=False)
    llm.generate([prompt], GREEDY, use_tqdm=False)
    stats = llm.stats()
    assert stats["prompt_tokens"] == stats["prefix_cache_queries"] == 80
    assert stats["prefix_cache_hits"] == 32                 # two full blocks of 16, short of the last token
    assert stats["generation_tokens"] == 32
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0


def test_random_token_streams_decode_like_the_whole(tokenizer):
    """Random token streams (many of them byte pieces of multi-byte characters): the deltas, joined,
    are at every step a prefix of tokenizer.decode of the whole stream, and equal it at the end;
    with a stop string, the text ends right before its first occurrence."""
    import random
    rng = random.Random(3)
    pieces = tokenizer.encode("naïve café — 你好 🙂 Привет") + list(range(3, 200))
    for trial in range(40):
        ids = [rng.choice(pieces) for _ in range(rng.randint(1, 30))]
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        stop = [whole[len(whole) // 2:len(whole) // 2 + 2]] if trial % 2 and len(whole) > 4 else []
        expected = whole[:whole.find(stop[0])] if stop else whole
        detokenizer = IncrementalDetokenizer(tokenizer, stop)
        shown = ""
        for n in range(1, len(ids) + 1):
            detokenizer.update(ids[:n], final=n == len(ids))
            shown += detokenizer.delta(final=n == len(ids))
            assert expected.startswith(shown), (ids, stop)
        assert shown == expected == detokenizer.visible_text, (ids, stop)
