"""Train the demo model shipped in nanovllm/demo: a small Qwen3 that adds numbers and names capitals.

    python scripts/train_demo_model.py --out nanovllm/demo        # the shipped model: 7 minutes on one H100
    python scripts/train_demo_model.py --out /tmp/demo --steps 30 --batch-size 64 --eval-every 10   # a CPU check
    python scripts/train_demo_model.py --out nanovllm/demo --init-from nanovllm/demo --tool-batch-size 128 \
        --multi-turn-batch-size 256 --batch-size 512 --lr 5e-4 --warmup 100 --time-limit 240
        # fine-tune the shipped model: the add tool and follow-up questions (4 minutes on one H200)

The data is generated chat conversations: `What is A + B?` (0 <= A, B <= 999) answered with the
sum, `What is the capital of C?` answered with the capital from capitals.tsv, and a few paraphrases
of each. The loss covers only the answer tokens. Addition pairs held out for evaluation are drawn
from the seed (`held_out_pairs`) and never trained on. The output is a standard Hugging Face
checkpoint (16-bit safetensors, config, generation config, tokenizer with the chat template) that
transformers and nanovllm both load; training.json beside it records the arguments and results.

With --init-from DIR the script fine-tunes the checkpoint in DIR (its tokenizer too, vocabulary
unchanged) instead of starting from scratch, and --tool-batch-size N adds N tool conversations to
every batch: the `add` tool offered through the chat template (Qwen3's Hermes layout, with the
tool's description, schema key order and extra schema fields varied as clients send them), a sum
question answered by `<tool_call>{"name": "add", "arguments": {"a": A, "b": B}}</tool_call>`, the
tool's result in a tool message and the final answer; capital questions asked with the tool on
offer are answered directly. The loss covers both assistant turns. --multi-turn-batch-size N adds
N conversations of two or three exchanges (later questions often build on the previous answer:
`What is 579 + 1?` after 579), the loss on every answer.
"""
import argparse
import json
import math
import os
import random
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F

CAPITALS_FILE = Path(__file__).resolve().parent.parent / "nanovllm" / "demo" / "capitals.tsv"
MAX_OPERAND = 999
NUM_HELD_OUT = 2000
DEFAULT_SEED = 0
# The first form of each question is the one the tests and the example ask.
ADDITION_QUESTIONS = ["What is {a} + {b}?", "What's {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.",
                      "What is the sum of {a} and {b}?", "Calculate {a} + {b}."]
CAPITAL_QUESTIONS = ["What is the capital of {c}?", "What's the capital of {c}?", "Which city is the capital of {c}?",
                     "Name the capital of {c}.", "What is the capital city of {c}?"]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3's chat layout with its Hermes tool parts (Qwen3's tools block with a shorter preamble, calls
# in <tool_call> blocks, tool results in <tool_response> blocks of a user turn), without thinking. A
# conversation with no tools and no tool messages renders as `<|im_start|>role\ncontent<|im_end|>\n`
# per message, as the first shipped model's template did. The checkpoint written carries it.
CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if tools and loop.first and message['role'] == 'system' %}
    {%- elif message['role'] == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' and message['tool_calls'] %}
        {{- '<|im_start|>assistant\\n' + (message['content'] or '') }}
        {%- for tool_call in message['tool_calls'] %}
            {%- if tool_call['function'] is defined %}
                {%- set tool_call = tool_call['function'] %}
            {%- endif %}
            {%- if not loop.first or message['content'] %}
                {{- '\\n' }}
            {%- endif %}
            {{- '<tool_call>\\n{"name": "' + tool_call['name'] + '", "arguments": ' }}
            {%- if tool_call['arguments'] is string %}
                {{- tool_call['arguments'] }}
            {%- else %}
                {{- tool_call['arguments'] | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# The tool as the OpenAI client sends it; the training varies its description and schema layout.
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOL_DESCRIPTIONS = ["Add two integers.", "Add two numbers.", "Adds two integers and returns the sum.",
                     "Return a + b.", "Add a and b.", "Sum of two integers.", "Add two integers together.",
                     "Adds a and b.", "Calculator: addition.", "Compute the sum of a and b.", ""]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a helpful assistant. Use the tools.",
                  "Use the add tool for sums.", "You add numbers.", "Answer with the tool's result."]
TOOL_CALL_RE = re.compile(r"^<tool_call>\n(.*)\n</tool_call>$", re.DOTALL)


def held_out_pairs(seed: int = DEFAULT_SEED) -> list[tuple[int, int]]:
    """The addition pairs (a, b) kept out of training for evaluation, in a fixed order."""
    n = MAX_OPERAND + 1
    picks = random.Random(f"held-out-{seed}").sample(range(n * n), NUM_HELD_OUT)
    return [(i // n, i % n) for i in picks]


def read_capitals(path: str | Path = CAPITALS_FILE) -> list[tuple[str, str]]:
    """(country, capital) rows of the tab-separated table, header skipped."""
    with open(path, encoding="utf-8") as f:
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    return [(country, capital) for country, capital in rows[1:]]


def chat_prompt(question: str) -> str:
    """The text CHAT_TEMPLATE makes of one user question with the generation prompt."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def sample_operand(rng: random.Random) -> int:
    # Half uniform over 0..999, half with a uniform digit count, so short numbers are not rare.
    if rng.random() < 0.5:
        return rng.randint(0, MAX_OPERAND)
    digits = rng.randint(1, 3)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


class ConversationSampler:
    """Random (question, answer) pairs: additions outside the held-out set, and capitals."""

    def __init__(self, seed: int, capitals: list[tuple[str, str]], capital_share: float):
        self.rng = random.Random(f"train-{seed}")
        self.held_out = set(held_out_pairs(seed))
        self.capitals = capitals
        self.capital_share = capital_share

    def sample(self) -> tuple[str, str]:
        rng = self.rng
        if rng.random() < self.capital_share:
            country, capital = rng.choice(self.capitals)
            return rng.choice(CAPITAL_QUESTIONS).format(c=country), capital
        while True:
            a, b = sample_operand(rng), sample_operand(rng)
            if (a, b) not in self.held_out:
                return rng.choice(ADDITION_QUESTIONS).format(a=a, b=b), str(a + b)


def add_tool_variant(rng: random.Random) -> dict:
    """The add tool's definition as one client or another may send it: the description varied or
    missing, the schema's keys in another order, with or without titles (pydantic's, as the Agents
    SDK sends), additionalProperties, argument descriptions and strict."""
    properties = {}
    for name in "ab":
        schema = {"type": "integer"}
        if rng.random() < 0.3:
            schema["title"] = name.upper()
        if rng.random() < 0.15:
            schema["description"] = rng.choice(["The first integer.", "First number.", "An integer."]
                                               if name == "a" else ["The second integer.", "Second number.",
                                                                    "An integer."])
        properties[name] = dict(rng.sample(list(schema.items()), len(schema)))
    parameters = {"type": "object", "properties": properties, "required": ["a", "b"]}
    if rng.random() < 0.3:
        parameters["title"] = "add_args"
    if rng.random() < 0.4:
        parameters["additionalProperties"] = False
    parameters = dict(rng.sample(list(parameters.items()), len(parameters)))
    function = {"name": "add"}
    description = rng.choice(TOOL_DESCRIPTIONS)
    if description or rng.random() < 0.5:
        function["description"] = description
    function["parameters"] = parameters
    if rng.random() < 0.3:
        function["strict"] = rng.random() < 0.7
    return {"type": "function", "function": function}


def tool_conversation(question: str, a: int, b: int, system: str | None = None) -> list[dict]:
    """The two turns of a sum answered through the add tool, as a client sends them back."""
    call = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": str(a + b)},
        {"role": "assistant", "content": str(a + b)}]


def chat_segments(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[tuple[str, bool]]:
    """The conversation's text under the chat template, in pieces (text, is an assistant answer):
    each assistant message's rendering up to its <|im_end|> is an answer, the rest is prompt."""
    segments, done = [], ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:i], tools=tools, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages[:i + 1], tools=tools, tokenize=False)
        assert prompt.startswith(done) and full.startswith(prompt) and full.endswith("<|im_end|>\n"), full
        segments += [(prompt[len(done):], False), (full[len(prompt):-1], True)]
        done = full[:-1]
    return segments


def parse_add_call(text: str) -> dict | None:
    """The arguments of a single hermes `add` call that is the whole text, else None."""
    match = TOOL_CALL_RE.match(text.strip())
    try:
        call = json.loads(match.group(1)) if match else None
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") != "add" or not isinstance(call.get("arguments"), dict):
        return None
    return call["arguments"]


class ToolConversationSampler:
    """Random tool conversations: chat segments of a sum through the add tool (two turns), or of a
    capital question answered directly with the tool on offer."""

    def __init__(self, seed: int, tokenizer, capitals: list[tuple[str, str]], capital_share: float = 0.15):
        self.rng = random.Random(f"tools-{seed}")
        self.tokenizer = tokenizer
        self.held_out = set(held_out_pairs(seed))
        self.capitals = capitals
        self.capital_share = capital_share

    def sample(self) -> list[tuple[str, bool]]:
        rng = self.rng
        tools = [add_tool_variant(rng)]
        system = rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.25 else None
        if rng.random() < self.capital_share:
            country, capital = rng.choice(self.capitals)
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": rng.choice(CAPITAL_QUESTIONS).format(c=country)},
                {"role": "assistant", "content": capital}]
            return chat_segments(self.tokenizer, messages, tools)
        while True:
            a, b = sample_operand(rng), sample_operand(rng)
            if (a, b) not in self.held_out:
                break
        question = rng.choice(ADDITION_QUESTIONS).format(a=a, b=b)
        return chat_segments(self.tokenizer, tool_conversation(question, a, b, system), tools)


class MultiTurnSampler:
    """Conversations of two or three exchanges, as a chat page sends them: each later question a sum
    (half of them adding to the previous answer, `What is 579 + 1?`) or a capital."""

    def __init__(self, seed: int, capitals: list[tuple[str, str]], capital_share: float):
        self.rng = random.Random(f"multi-turn-{seed}")
        self.single = ConversationSampler(seed + 1000, capitals, capital_share)

    def sample(self) -> list[dict]:
        rng = self.rng
        messages, previous = [], None
        for _ in range(rng.randint(2, 3)):
            question, answer = self.single.sample()
            if previous is not None and previous.isdigit() and rng.random() < 0.5:
                b = sample_operand(rng)
                question, answer = rng.choice(ADDITION_QUESTIONS).format(a=previous, b=b), str(int(previous) + b)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            previous = answer
        return messages


def plain_segments(messages: list[dict]) -> list[tuple[str, bool]]:
    """chat_segments of a conversation of user and assistant turns, built by hand in CHAT_TEMPLATE's
    plain layout (rendering millions through Jinja would be the training's bottleneck)."""
    segments, separator = [], ""
    for question, answer in zip(messages[::2], messages[1::2]):
        segments += [(separator + chat_prompt(question["content"]), False), (answer["content"] + "<|im_end|>", True)]
        separator = "\n"
    return segments


def follow_up_prompt(first: tuple[str, str], question: str) -> str:
    """The text of a second question after a first exchange, with the generation prompt."""
    return chat_prompt(first[0]) + first[1] + "<|im_end|>\n" + chat_prompt(question)


def build_tokenizer(capitals: list[tuple[str, str]], vocab_size: int):
    """Byte-level BPE whose digits are always single tokens, with Qwen3's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    # Digits split first, one per token: place value is then one position per digit for the model.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    corpus = [chat_prompt(q.format(c=country)) + capital + "<|im_end|>\n"
              for country, capital in capitals for q in CAPITAL_QUESTIONS]
    corpus += [chat_prompt(q.format(a=rng.randint(0, 999), b=rng.randint(0, 999))) + "<|im_end|>\n"
               for q in ADDITION_QUESTIONS for _ in range(20)]
    corpus += ["<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


class PieceEncoder:
    """Token ids of a chat text from cached encodings of its pieces. Digits and special tokens always
    stand alone in this tokenizer, so a text's ids are those of the pieces between them, in order
    (main() checks this against the tokenizer); encoding millions of questions is then cheap."""

    SEPARATORS = re.compile(r"(\d|<\|im_start\|>|<\|im_end\|>)")

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[str, list[int]] = {}

    def __call__(self, text: str) -> list[int]:
        ids = []
        for piece in self.SEPARATORS.split(text):
            if piece not in self.cache:
                self.cache[piece] = self.tokenizer.encode(piece, add_special_tokens=False)
            ids += self.cache[piece]
        return ids


def encode_batch(encode: PieceEncoder, conversations: list[tuple[str, str]], device: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids (right-padded) and next-token targets that are -100 except on the answer and its <|im_end|>."""
    prompts = [encode(chat_prompt(q)) for q, _ in conversations]
    answers = [encode(a + "<|im_end|>") for _, a in conversations]
    length = max(len(p) + len(a) for p, a in zip(prompts, answers))
    ids, targets = [], []
    for p, a in zip(prompts, answers):
        padding = length - len(p) - len(a)
        ids.append(p + a + [encode.tokenizer.pad_token_id] * padding)
        targets.append([-100] * (len(p) - 1) + a + [-100] * (padding + 1))
    return torch.tensor(ids, device=device), torch.tensor(targets, device=device)


def encode_segment_batch(encode: PieceEncoder, conversations: list[list[tuple[str, bool]]], device: str
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """encode_batch for conversations in chat segments: targets on the answer segments only."""
    rows = []
    for segments in conversations:
        ids, is_answer = [], []
        for text, answer in segments:
            piece = encode(text)
            ids += piece
            is_answer += [answer] * len(piece)
        rows.append((ids, is_answer))
    length = max(len(ids) for ids, _ in rows)
    pad = encode.tokenizer.pad_token_id
    ids_out, targets = [], []
    for ids, is_answer in rows:
        padding = length - len(ids)
        ids_out.append(ids + [pad] * padding)
        targets.append([t if answer else -100 for t, answer in zip(ids[1:], is_answer[1:])] + [-100] * (padding + 1))
    return torch.tensor(ids_out, device=device), torch.tensor(targets, device=device)


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: list[str], max_new_tokens: int = 8, batch_size: int = 512
                       ) -> list[str]:
    """Greedy completions of prompt texts up to <|im_end|> (" <no eos>" marks one cut short), with a KV
    cache; prompts of one length in tokens are batched together, so no padding."""
    from transformers import DynamicCache
    device = next(model.parameters()).device
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompt_ids):
        by_length.setdefault(len(p), []).append(i)
    answers = [""] * len(prompts)
    for indices in by_length.values():
        for start in range(0, len(indices), batch_size):
            chunk = indices[start:start + batch_size]
            ids = torch.tensor([prompt_ids[i] for i in chunk], device=device)
            # forward's fourth argument is the cache, filled in place (its keyword is past_key_values
            # before transformers 5.25 and cache after)
            cache = DynamicCache()
            out = model(ids, None, None, cache, use_cache=True)
            generated, done = [], torch.zeros(len(chunk), dtype=torch.bool, device=device)
            for _ in range(max_new_tokens):
                next_ids = out.logits[:, -1].argmax(-1)
                generated.append(next_ids)
                done |= next_ids == eos
                if done.all():
                    break
                out = model(next_ids[:, None], None, None, cache, use_cache=True)
            generated = torch.stack(generated, dim=1).tolist()
            for row, i in enumerate(chunk):
                tokens = generated[row]
                answers[i] = (tokenizer.decode(tokens[:tokens.index(eos)]) if eos in tokens
                              else tokenizer.decode(tokens) + " <no eos>")
    return answers


def greedy_answers(model, tokenizer, questions: list[str], max_new_tokens: int = 8, batch_size: int = 512) -> list[str]:
    """Greedy answers to single user questions."""
    return greedy_completions(model, tokenizer, [chat_prompt(q) for q in questions], max_new_tokens, batch_size)


def evaluate_tools(model, tokenizer, seed: int, capitals: list[tuple[str, str]], num_pairs: int) -> dict[str, float]:
    """With ADD_TOOL offered: held-out sums answered by a hermes add call with the right a and b; the
    final answer after the tool message (given the right call); capitals answered directly."""
    pairs = held_out_pairs(seed)[:num_pairs]
    tools = [ADD_TOOL]

    def prompt(messages):
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    conversations = [tool_conversation(ADDITION_QUESTIONS[0].format(a=a, b=b), a, b) for a, b in pairs]
    calls = greedy_completions(model, tokenizer, [prompt(c[:1]) for c in conversations], max_new_tokens=80)
    finals = greedy_completions(model, tokenizer, [prompt(c[:3]) for c in conversations])
    capital_answers = greedy_completions(model, tokenizer, [prompt([{"role": "user", "content": q.format(c=country)}])
                                                            for country, _ in capitals for q in CAPITAL_QUESTIONS[:1]])
    return {
        "tool_call_accuracy": sum(parse_add_call(x) == {"a": a, "b": b} for x, (a, b) in zip(calls, pairs)) / len(pairs),
        "tool_answer_accuracy": sum(x == str(a + b) for x, (a, b) in zip(finals, pairs)) / len(pairs),
        "capital_with_tools_accuracy": sum(x == c for x, (_, c) in zip(capital_answers, capitals)) / len(capitals),
    }


def evaluate(model, tokenizer, seed: int, capitals: list[tuple[str, str]], num_additions: int,
             num_tool_pairs: int = 0) -> dict[str, float]:
    """Exact-answer accuracy on held-out additions (plain and paraphrased questions) and on every
    capital; with num_tool_pairs, evaluate_tools' scores too."""
    model.eval()
    pairs = held_out_pairs(seed)[:num_additions]
    plain = greedy_answers(model, tokenizer, [ADDITION_QUESTIONS[0].format(a=a, b=b) for a, b in pairs])
    rng = random.Random(1)
    paraphrased = greedy_answers(model, tokenizer, [rng.choice(ADDITION_QUESTIONS).format(a=a, b=b) for a, b in pairs])
    capital_questions = [q.format(c=country) for country, _ in capitals for q in CAPITAL_QUESTIONS]
    capital_answers = greedy_answers(model, tokenizer, capital_questions)
    expected_capitals = [capital for _, capital in capitals for _ in CAPITAL_QUESTIONS]
    tool_scores = evaluate_tools(model, tokenizer, seed, capitals, num_tool_pairs) if num_tool_pairs else {}
    # follow-ups: the previous answer plus a held-out operand, and a capital after a sum
    follow_pairs = [(a + b, c) for (a, b), (c, _) in zip(pairs, reversed(pairs))]
    follow_sums = greedy_completions(model, tokenizer, [
        follow_up_prompt((ADDITION_QUESTIONS[0].format(a=a, b=b), str(a + b)), ADDITION_QUESTIONS[0].format(a=s, b=c))
        for (a, b), (s, c) in zip(pairs, follow_pairs)])
    follow_capitals = greedy_completions(model, tokenizer, [
        follow_up_prompt((ADDITION_QUESTIONS[0].format(a=a, b=b), str(a + b)), CAPITAL_QUESTIONS[0].format(c=country))
        for (a, b), (country, _) in zip(pairs, capitals * (len(pairs) // len(capitals) + 1))])
    model.train()
    return {
        "held_out_addition_accuracy": sum(x == str(a + b) for x, (a, b) in zip(plain, pairs)) / len(pairs),
        "held_out_paraphrased_addition_accuracy":
            sum(x == str(a + b) for x, (a, b) in zip(paraphrased, pairs)) / len(pairs),
        "capital_accuracy": sum(x == c for x, c in zip(capital_answers, expected_capitals)) / len(capital_questions),
        "follow_up_addition_accuracy": sum(x == str(s + c) for x, (s, c) in zip(follow_sums, follow_pairs)) / len(pairs),
        "follow_up_capital_accuracy": sum(x == c for x, (_, c) in zip(follow_capitals, capitals * len(pairs)))
        / len(pairs),
        **tool_scores,
    }


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for the checkpoint")
    parser.add_argument("--capitals", default=str(CAPITALS_FILE), help="country<TAB>capital table")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--steps", type=int, default=5686)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--capital-share", type=float, default=0.1, help="share of capital questions in the data")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--intermediate-size", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--eval-every", type=int, default=2000)
    parser.add_argument("--eval-additions", type=int, default=500, help="held-out additions checked during training")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds: after the first 70 steps, lower --steps to what fits (the schedule is "
                             "still in warmup then, so rerunning with the printed --steps reproduces the run)")
    parser.add_argument("--init-from", default=None,
                        help="fine-tune the checkpoint (and tokenizer) in this directory instead of starting anew")
    parser.add_argument("--tool-batch-size", type=int, default=0,
                        help="add tool conversations (the add tool offered) to every batch of --batch-size")
    parser.add_argument("--multi-turn-batch-size", type=int, default=0,
                        help="add conversations of two or three exchanges to every batch of --batch-size")
    parser.add_argument("--eval-tools", type=int, default=None,
                        help="held-out pairs of the tool evaluation (default: 300 with --tool-batch-size, else none)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="dtype of the saved weights")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    started = time.perf_counter()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    capitals = read_capitals(args.capitals)
    if args.eval_tools is None:
        args.eval_tools = 300 if args.tool_batch_size else 0
    if args.init_from:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(args.init_from)
        tokenizer.chat_template = CHAT_TEMPLATE
    else:
        tokenizer = build_tokenizer(capitals, args.vocab_size)
    question = ADDITION_QUESTIONS[0].format(a=12, b=345)
    assert tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True) == chat_prompt(question)
    assert [tokenizer.decode([t]) for t in tokenizer.encode("12 + 345")[-3:]] == ["3", "4", "5"]
    encode = PieceEncoder(tokenizer)
    sampler = ConversationSampler(args.seed + 1, capitals, 0.5)
    for question, answer in (sampler.sample() for _ in range(2000)):
        text = chat_prompt(question) + answer + "<|im_end|>"
        assert encode(text) == tokenizer.encode(text, add_special_tokens=False), text
    tool_sampler = ToolConversationSampler(args.seed + 1, tokenizer, capitals)
    for segments in (tool_sampler.sample() for _ in range(200 if args.tool_batch_size else 0)):
        text = "".join(text for text, _ in segments)
        assert sum((encode(t) for t, _ in segments), []) == tokenizer.encode(text, add_special_tokens=False), text

    multi_turn_check = MultiTurnSampler(args.seed + 1, capitals, 0.5)
    for messages in (multi_turn_check.sample() for _ in range(200 if args.multi_turn_batch_size else 0)):
        assert plain_segments(messages) == chat_segments(tokenizer, messages, None), messages

    eos_id, pad_id = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    head_dim = 32
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden_size // head_dim,
        num_key_value_heads=args.hidden_size // head_dim // 2, head_dim=head_dim, max_position_embeddings=1024,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    config.architectures = ["Qwen3ForCausalLM"]
    model = (AutoModelForCausalLM.from_pretrained(args.init_from, dtype=torch.float32) if args.init_from
             else Qwen3ForCausalLM(config)).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{num_params / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}, device {device}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.98), fused=device == "cuda")
    sampler = ConversationSampler(args.seed, capitals, args.capital_share)
    tool_sampler = ToolConversationSampler(args.seed, tokenizer, capitals)
    multi_turn_sampler = MultiTurnSampler(args.seed, capitals, args.capital_share)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    log, running_loss = [], None
    model.train()
    step, timed_from = 0, None
    while step < args.steps:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
        batches = [encode_batch(encode, [sampler.sample() for _ in range(args.batch_size)], device)]
        if args.tool_batch_size:        # a batch of its own: the long tool conversations would pad the short ones
            batches.append(encode_segment_batch(encode, [tool_sampler.sample() for _ in range(args.tool_batch_size)],
                                                device))
        if args.multi_turn_batch_size:
            batches.append(encode_segment_batch(
                encode, [plain_segments(multi_turn_sampler.sample()) for _ in range(args.multi_turn_batch_size)], device))
        num_targets = sum((targets != -100).sum() for _, targets in batches)
        optimizer.zero_grad(set_to_none=True)
        for ids, targets in batches:        # the loss is the mean over all answer tokens of the step
            with autocast:
                logits = model(ids).logits
            part = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                                   reduction="sum") / num_targets
            part.backward()
            loss = part.detach() if ids is batches[0][0] else loss + part.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step in (20, 70) and args.time_limit is not None:
            if device == "cuda":
                torch.cuda.synchronize()
            timed_from = timed_from if step == 70 else time.perf_counter()
        if step == 70 and args.time_limit is not None:
            seconds_per_step = (time.perf_counter() - timed_from) / 50
            affordable = step + 1 + int((args.time_limit - (time.perf_counter() - started)) / seconds_per_step)
            if affordable < args.steps:
                args.steps = max(affordable, step + 1)
                print(f"{seconds_per_step * 1e3:.1f} ms per step: training for --steps {args.steps}", flush=True)
        if step % 100 == 0 or step == args.steps - 1:
            value = loss.item()
            running_loss = value if running_loss is None else 0.9 * running_loss + 0.1 * value
            print(f"step {step:6d}  loss {value:.4f}  (smoothed {running_loss:.4f})  lr {group['lr']:.2e}  "
                  f"{time.perf_counter() - started:.0f}s", flush=True)
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            with autocast:
                scores = evaluate(model, tokenizer, args.seed, capitals, args.eval_additions, args.eval_tools)
            log.append({"step": step + 1, "loss": running_loss, **scores})
            print(f"step {step + 1:6d}  " + "  ".join(f"{k} {v:.4f}" for k, v in scores.items()), flush=True)
        step += 1
    train_seconds = time.perf_counter() - started

    initial_record = None           # the record of the run that made the checkpoint fine-tuned here
    if args.init_from and os.path.exists(os.path.join(args.init_from, "training.json")):
        with open(os.path.join(args.init_from, "training.json")) as f:
            initial_record = json.load(f)
    os.makedirs(args.out, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=[eos_id, pad_id],
                                               pad_token_id=pad_id, do_sample=False)
    model.to(getattr(torch, args.dtype)).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    # The final numbers come from the saved 16-bit checkpoint, read back as transformers reads it.
    saved = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32).to(device)
    final = evaluate(saved, tokenizer, args.seed, capitals, NUM_HELD_OUT, args.eval_tools)
    print("final (saved checkpoint, float32, all held-out pairs): "
          + "  ".join(f"{k} {v:.4f}" for k, v in final.items()), flush=True)
    size = sum(f.stat().st_size for f in Path(args.out).iterdir() if f.is_file())
    record = {"arguments": {k: v for k, v in vars(args).items() if k not in ("out", "capitals")},
              "initial_training": initial_record, "device": torch.cuda.get_device_name() if device == "cuda"
              else "cpu", "parameters": num_params, "train_seconds": round(train_seconds, 1),
              "files_bytes": size, "final": final, "log": log}
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"saved to {args.out}: {size / 1e6:.1f} MB, trained in {train_seconds:.0f}s", flush=True)


if __name__ == "__main__":
    main()
