"""Structured outputs on a tiny random model: whatever the weights, the seed or the temperature,
every answer under a JSON schema parses and validates (checked by the jsonschema package), regex
answers fullmatch, choices are one of the choices, EBNF answers parse; n > 1, logprobs, stop strings,
preemption, the overlapped loop and interrupted steps keep that true, and requests without
constraints get the tokens they got before."""
import json
import pickle
import re

import jsonschema
import pytest
import torch

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.core.sequence import Sequence
from nanovllm.engine_loop import ACCEPTED, OUTPUT, REFUSED, AddRequest, EngineLoop, Stop
from tests.conftest import mixed_prompts
from tests.test_interrupts import Injected, assert_consistent, fail_on_call, restore

# nested objects, arrays, enums, required and optional fields; bounded, so that a random model
# finishes well within MAX_TOKENS
SCHEMA = {
    "type": "object",
    "properties": {
        "s": {"type": "string", "maxLength": 3},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "e": {"enum": ["ab", "cd"]},
        "b": {"type": "boolean"},
        "l": {"type": "array", "items": {"enum": ["x", 7]}, "maxItems": 2},
        "o": {"type": "object", "properties": {"c": {"type": "string", "minLength": 1, "maxLength": 2}},
              "required": ["c"]},
    },
    "required": ["s", "n", "e", "l", "o"],
}
JSON = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ["yes", "no", 'a "quoted"\\ choice\n']
# a list of one to four items, each a digit or a parenthesised pair: not a regular language's
# output to check with one regex, so it is checked by a parser below
EBNF = r'''root ::= "[" item ("," item){0,3} "]"
item ::= [0-9] | "(" item " " item ")"'''
MAX_TOKENS = 100
SAMPLINGS = [dict(temperature=0), dict(temperature=0.7), dict(temperature=1.0, top_p=0.9),
             dict(temperature=1.0), dict(temperature=1.5, top_k=50)]


@pytest.fixture(scope="module")
def llm(model_paths):
    # a small pool: sequences are preempted and recomputed on the way
    return LLM(model_paths["gqa_tied"], kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=32,
               max_num_seqs=12)


def params(structured, i=0, **kwargs) -> SamplingParams:
    sampling = SAMPLINGS[i % len(SAMPLINGS)]
    return SamplingParams(**{**sampling, "seed": i, "max_tokens": MAX_TOKENS, "structured_outputs": structured,
                             **kwargs})


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    return mixed_prompts(500, lengths=[(7 * i) % 40 + 2 for i in range(n)], seed=seed)


def assert_valid_json(out) -> dict:
    assert out["finish_reason"] == "stop", out
    value = json.loads(out["text"])
    jsonschema.validate(value, SCHEMA)
    return value


def parse_ebnf(text: str) -> bool:
    """Is text a word of EBNF above?"""
    def item(i):
        if i < len(text) and text[i].isdigit():
            return i + 1
        if text.startswith("(", i):
            i = item(i + 1)
            if i is None or not text.startswith(" ", i):
                return None
            i = item(i + 1)
            return i + 1 if i is not None and text.startswith(")", i) else None
        return None
    if not text.startswith("["):
        return False
    i, count = item(1), 1
    while i is not None and text.startswith(",", i) and count < 4:
        i, count = item(i + 1), count + 1
    return i is not None and text[i:] == "]"


def assert_idle(llm) -> None:
    while not llm.engine.is_finished():       # a step may still be in flight for sequences that stopped
        assert llm.engine.step() == []
    assert_consistent(llm)
    assert llm.engine.core.scheduler.block_manager.num_used_blocks == 0


def test_json_schema_answers_validate_over_seeds_and_temperatures(llm):
    before = llm.engine.core.scheduler.num_preemptions
    outputs = llm.generate(prompts(10), [params(JSON, i) for i in range(10)], use_tqdm=False)
    values = [assert_valid_json(out) for out in outputs]
    assert len({json.dumps(v, sort_keys=True) for v in values}) > 5      # sampled, not one answer
    for out in outputs:     # the grammar ends with the stop token, which the text does not show
        assert out["token_ids"][-1] in llm.config.eos_token_ids
    assert llm.engine.core.scheduler.num_preemptions > before
    assert_idle(llm)


def test_json_object_regex_choice_and_grammar_beside_unconstrained_requests(llm, hf_greedy):
    kinds = [StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
             StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(choice=CHOICES),
             StructuredOutputsParams(grammar=EBNF), None]
    batch = prompts(12, seed=1)
    requests = [params(kinds[i % 5], i) for i in range(12)]
    for i in range(4, 12, 5):      # the unconstrained rows: greedy, judged by transformers
        requests[i] = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(batch, requests, use_tqdm=False)
    objects = []
    for i, out in enumerate(outputs):
        kind, text = i % 5, out["text"]
        if kind == 4:
            assert out["token_ids"] == hf_greedy(llm.config.model, batch[i], 16)
            continue
        if kind == 0:
            # any object: a random model may write one string key until max_tokens (no schema
            # bounds it); those that end are objects
            if out["finish_reason"] == "stop":
                objects.append(json.loads(text))
            else:
                assert out["finish_reason"] == "length" and text.startswith("{")
            continue
        assert out["finish_reason"] == "stop", out
        if kind == 1:
            assert re.fullmatch(REGEX, text), text
        elif kind == 2:
            assert text in CHOICES
        else:
            assert parse_ebnf(text), text
    assert objects and all(isinstance(value, dict) for value in objects)
    assert_idle(llm)


def test_n_completions_each_follow_the_grammar(llm):
    outputs = llm.generate(prompts(3, seed=2), [params(JSON, 3, n=3), params(JSON, 1, n=2),
                                                params(StructuredOutputsParams(regex=REGEX), 2, n=2)],
                           use_tqdm=False)
    for out in outputs[:2]:
        values = [assert_valid_json(completion) for completion in out["outputs"]]
        assert len({json.dumps(v) for v in values}) > 1
    assert all(re.fullmatch(REGEX, c["text"]) for c in outputs[2]["outputs"])
    assert_idle(llm)


def test_logprobs_are_the_models_own(llm, hf_model_cache, hf_greedy):
    """The chosen tokens' logprobs (and the top alternatives) are the model's, before the mask:
    judged against transformers on the prompt and the constrained completion."""
    hf_greedy(llm.config.model, [5], 1)          # loads the transformers model
    model = hf_model_cache[llm.config.model]
    prompt = prompts(1, seed=3)[0]
    out = llm.generate([prompt], params(JSON, 1, logprobs=2), use_tqdm=False)[0]
    assert_valid_json(out)
    assert len(out["logprobs"]) == len(out["token_ids"])
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out["token_ids"]])).logits[0, len(prompt) - 1:-1]
    expected = torch.log_softmax(logits.float(), dim=-1)
    for position, (token_id, entry) in enumerate(zip(out["token_ids"], out["logprobs"])):
        assert entry[token_id] == pytest.approx(expected[position, token_id].item(), abs=1e-3)
        assert {t for t in entry if t != token_id} <= set(expected[position].topk(2).indices.tolist())


def test_stop_strings_cut_a_structured_answer(llm):
    outputs = llm.generate(prompts(3, seed=4), [params(JSON, i, stop=['"e"']) for i in range(3)], use_tqdm=False)
    for out in outputs:
        assert out["finish_reason"] == "stop" and '"e"' not in out["text"]
        assert out["text"].startswith('{"s": "')


def test_ignore_eos_goes_on_unconstrained_after_the_grammar_ends(llm):
    out = llm.generate(prompts(1, seed=5), params(StructuredOutputsParams(choice=["yes", "no"]), 0, ignore_eos=True,
                                                 max_tokens=12), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 12
    ids = out["token_ids"]
    end = min(i for i, t in enumerate(ids) if t in llm.config.eos_token_ids)
    assert llm.tokenizer.decode(ids[:end]) in ("yes", "no")


BAD = [("json", StructuredOutputsParams(json={"type": "frobnicate"})),
       ("json", StructuredOutputsParams(json='{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}')),
       ("regex", StructuredOutputsParams(regex="a(b")),
       ("grammar", StructuredOutputsParams(grammar='root ::= "a" | ')),
       ("grammar", StructuredOutputsParams(grammar='start ::= "a"'))]


def test_a_grammar_that_cannot_compile_is_a_value_error_naming_the_field(llm):
    good = params(JSON, 0)
    for field, structured in BAD:
        with pytest.raises(ValueError, match=rf"structured_outputs\.{field}\b"):
            llm.generate(prompts(2), [good, SamplingParams(structured_outputs=structured)], use_tqdm=False)
        with pytest.raises(ValueError, match=rf"structured_outputs\.{field}\b"):
            llm.engine.add_request(prompts(1)[0], SamplingParams(structured_outputs=structured))
        assert_idle(llm)                              # nothing was queued, no block taken
    assert_valid_json(llm.generate(prompts(1), good, use_tqdm=False)[0])
    assert_idle(llm)


def test_constrained_steps_sample_after_the_step_before_is_collected(llm, monkeypatch):
    """The overlapped loop: a constrained step's model runs before the host waits for the step in
    flight, its sampling only after (its mask needs that step's token). Unconstrained batches
    sample as they launch, with no mask."""
    runner, calls = llm.engine.core.executor, []
    for name in ("launch", "collect", "sample"):
        original = getattr(runner, name)

        def traced(*args, _original=original, _name=name, **kwargs):
            calls.append((_name, kwargs.get("sample", True)) if _name == "launch" else
                         (_name, args[1] is not None) if _name == "sample" and len(args) > 1 else (_name,))
            return _original(*args, **kwargs)
        monkeypatch.setattr(runner, name, traced)
    llm.generate(prompts(2, seed=6), params(JSON, 0, max_tokens=8), use_tqdm=False)
    decode = calls[calls.index(("collect",)) - 1:]       # from the first step with a step in flight
    assert decode[:3] == [("launch", False), ("collect",), ("sample", True)]
    calls.clear()
    llm.generate(prompts(2, seed=6), SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert ("sample", True) not in calls and all(call[1] for call in calls if call[0] == "launch")


@pytest.mark.parametrize("target, k, after, error", [("collect", 3, False, Injected), ("fill", 4, True, KeyboardInterrupt),
                                                     ("sample", 2, True, Injected)])
def test_interrupted_steps_leave_every_matcher_consistent(llm, target, k, after, error):
    """A constrained request of another caller lives through an interrupted generate (its pending
    token dropped, its sequence recomputed): its matcher has accepted exactly its collected tokens,
    so its answer still validates; the engine then serves constrained requests as before."""
    survivor = llm.engine.add_request(prompts(1, seed=7)[0], params(JSON, 3))
    for _ in range(4):
        llm.engine.step()
    obj = llm.engine.core.scheduler if target == "fill" else llm.engine.core.executor
    fail_on_call(obj, target, k, error, after)
    try:
        with pytest.raises(error):
            llm.generate(prompts(2, seed=8), [params(JSON, i) for i in range(2)], use_tqdm=False)
    finally:
        restore(obj, target)
    assert_consistent(llm)
    finished = []
    while not llm.engine.is_finished():
        finished += llm.engine.step()
    assert [out["request_id"] for out in finished] == [survivor]
    assert_valid_json(finished[0])
    assert_idle(llm)


def test_chat_renders_tools_and_template_kwargs(llm):
    template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}|{% endif %}"
                "{% if enable_thinking is defined and not enable_thinking %}NOTHINK|{% endif %}"
                "{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}"
                "{% if m.tool_calls %}CALL {{ m.tool_calls[0]['function']['name'] }}{% endif %}|{% endfor %}"
                "assistant:")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "1"}]
    original, llm.tokenizer.chat_template = llm.tokenizer.chat_template, template
    try:
        out = llm.chat(messages, params(StructuredOutputsParams(choice=["yes", "no"])), use_tqdm=False, tools=tools,
                       chat_template_kwargs={"enable_thinking": False})[0]
        prompt = llm.tokenizer.decode(out["prompt_token_ids"])
        assert prompt == "TOOLS:get_weather;|NOTHINK|user: Paris?|assistant: CALL get_weather|tool: sunny|assistant:"
        assert out["text"] in ("yes", "no")
        assert "NOTHINK" not in llm.tokenizer.decode(llm.apply_chat_template(messages[:1]))
        with pytest.raises(TypeError, match="tools"):
            llm.chat(messages, tools={"name": "x"})
        with pytest.raises(ValueError, match="chat_template_kwargs"):
            llm.chat(messages, chat_template_kwargs={"tokenize": True})
    finally:
        llm.tokenizer.chat_template = original
    assert_idle(llm)


def test_structured_requests_cross_the_engine_process_boundary(llm):
    """What AsyncLLM sends its engine process (pickled commands) carries the structured outputs;
    a bad grammar is refused for that request only."""
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(("))
    commands = [pickle.loads(pickle.dumps([AddRequest("good", prompts(1)[0], params(JSON, 2)),
                                           AddRequest("bad", prompts(1)[0], bad)]))]
    items = []

    def receive(block):
        if commands:
            return commands.pop()
        return [Stop()] if llm.engine.is_finished() else []
    EngineLoop(llm.engine, receive, lambda message: items.extend(message[0])).run()
    assert (ACCEPTED, "good") in items
    refused = [item for item in items if item[0] == REFUSED]
    assert refused[0][1] == "bad" and "structured_outputs.regex" in str(refused[0][2])
    final = [item[2] for item in items if item[0] == OUTPUT and item[2]["finished"]]
    assert len(final) == 1 and final[0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(final[0]["text"]), SCHEMA)
    assert_idle(llm)


def test_utf8_guard_allows_exactly_the_continuations_python_decodes(llm):
    """After a lone lead byte E0, ED, F0 or F4, a continuation byte is allowed exactly when the two
    can begin a valid UTF-8 sequence (judged by Python's decoder)."""
    manager = llm.engine._grammars()
    guard, vocab = manager.utf8_guard, manager.tokenizer_info.decoded_vocab
    singles = {token[0]: token_id for token_id, token in enumerate(vocab) if len(token) == 1 and token[0] >= 0x80}
    for lead, allowed in guard.allowed_after.items():
        for byte in range(0x80, 0xC0):
            if byte not in singles:
                continue
            token_id = singles[byte]
            bit = bool((int(allowed[token_id // 32]) >> (token_id % 32)) & 1)
            tail = b"\x80" * (2 if lead >= 0xF0 else 1)
            try:
                (bytes([lead, byte]) + tail).decode("utf-8")
                valid = True
            except UnicodeDecodeError:
                valid = False
            assert bit == valid, (hex(lead), hex(byte))
        assert guard.lead_of[singles[lead]] == lead


def test_masks_stay_exact_over_steps_with_changing_rows(llm):
    """token_bitmask fills two host buffers in turn, holding only the constrained rows: poisoned
    before each step, with constrained and unconstrained sequences joining, leaving, reordering and
    ending their grammars, each step's masks are still exactly what a fresh matcher fed the same
    tokens fills, for the rows they name; the matchers end exactly when xgrammar says they do."""
    manager = llm.engine._grammars()
    xgr, vocab_size = manager.xgr, manager.vocab_size
    kinds = [JSON, StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(choice=CHOICES),
             StructuredOutputsParams(grammar=EBNF), None]
    seqs = []
    for i in range(15):
        structured = kinds[i % len(kinds)]
        seq = Sequence([1 + i, 2, 3], SamplingParams(structured_outputs=structured, ignore_eos=i % 3 == 0))
        if structured is not None:
            seq.grammar = manager.new_grammar(structured, seq.sampling_params.ignore_eos)
        seqs.append(seq)
    generator = torch.Generator().manual_seed(0)
    checked_rows = 0
    for step in range(40):
        batch = [seqs[i] for i in torch.randperm(len(seqs), generator=generator)[:int(4 + step % 11)].tolist()]
        for buffer in manager.buffers:
            buffer.fill_(0x2AAAAAAA)
        masks = manager.token_bitmask(batch)
        constrained = [row for row, seq in enumerate(batch) if seq.grammar is not None and seq.grammar.constrains]
        for seq in batch:
            if seq.grammar is not None:
                assert seq.grammar.constrains == (not seq.grammar.rejected and not seq.grammar.matcher.is_terminated())
        if masks is None:
            assert not constrained
            continue
        assert masks.rows.tolist() == constrained
        bitmask, rows = masks.to(torch.device("cpu"))
        assert torch.equal(bitmask, masks.bitmask) and rows.tolist() == constrained
        for i, row in enumerate(constrained):
            seq = batch[row]
            fresh = xgr.GrammarMatcher(manager.compile(seq.sampling_params.structured_outputs))
            for token_id in seq.completion_token_ids:
                assert fresh.accept_token(token_id)
            want = xgr.allocate_token_bitmask(1, vocab_size)
            fresh.fill_next_token_bitmask(want)
            lead = manager.utf8_guard.lead_of.get(seq.token_ids[-1]) if seq.completion_token_ids else None
            if lead is not None:
                want[0] &= manager.utf8_guard.allowed_after[lead]
            assert torch.equal(masks.bitmask[i], want[0]), (step, row)
            checked_rows += 1
        for i, row in enumerate(constrained):      # each constrained row takes a token its mask allows
            allowed = ((masks.bitmask[i].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
            choices = allowed[:vocab_size].nonzero().flatten()
            batch[row].append_token(int(choices[torch.randint(len(choices), (1,), generator=generator)]))
        for row, seq in enumerate(batch):
            if row not in constrained:
                seq.append_token(5)
    assert checked_rows > 100
    assert any(seq.grammar is not None and not seq.grammar.constrains for seq in seqs)   # some grammars ended
