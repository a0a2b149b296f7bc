"""The bundled demo model's accuracy through the engine (LLM.chat, temperature 0), with and without
the `add` tool: held-out additions (`What is A + B?`, pairs it never trained on) answered directly;
the capital questions of every country in every phrasing; with ADD_TOOL offered, the same additions
answered by a call that the server's hermes parser reads as `add` with the right a and b, and the
final answer after the tool message (the conversation the client sends back: the model's own call,
the tool's result); capitals asked with the tool on offer, answered directly.

    PYTHONPATH=. python scripts/demo_tool_accuracy.py --pairs 300        # on the CPU
"""
import argparse
import importlib.util
import json
import os
from pathlib import Path

from nanovllm import LLM, SamplingParams
from nanovllm.demo import capitals, model_path
from nanovllm.serve.tool_parsers import HermesToolParser

ROOT = Path(__file__).resolve().parent.parent


def training_script():
    spec = importlib.util.spec_from_file_location("train_demo_model", ROOT / "scripts" / "train_demo_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse(text: str) -> tuple[str, list[dict]]:
    """(content, tool calls) as the server's hermes parser reads the whole output."""
    parser = HermesToolParser()
    first, last = parser.feed(text), parser.finish()
    calls = {}
    for piece in first.tool_calls + last.tool_calls:
        call = calls.setdefault(piece["index"], {"name": None, "arguments": ""})
        call["name"] = piece["function"].get("name", call["name"])
        call["arguments"] += piece["function"]["arguments"]
    return first.content + last.content, list(calls.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=300, help="held-out addition pairs")
    parser.add_argument("--model", default=model_path())
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    training = training_script()
    with open(os.path.join(args.model, "training.json")) as f:
        seed = json.load(f)["arguments"]["seed"]
    # the end of the held-out list: the training script's own evaluation reads its start
    pairs = training.held_out_pairs(seed)[-args.pairs:]
    countries = capitals()
    tools = [training.ADD_TOOL]
    params = SamplingParams(temperature=0, max_tokens=64)
    questions = [f"What is {a} + {b}?" for a, b in pairs]
    capital_questions = [q.format(c=country) for country, _ in countries for q in training.CAPITAL_QUESTIONS]
    expected_capitals = [capital for _, capital in countries for _ in training.CAPITAL_QUESTIONS]
    with LLM(args.model, device=args.device, kvcache_block_size=16, num_kvcache_blocks=2048) as llm:
        def chat(conversations, tools=None):
            return [o["text"] for o in llm.chat(conversations, params, use_tqdm=False, tools=tools)]

        sums = chat([[{"role": "user", "content": q}] for q in questions])
        caps = chat([[{"role": "user", "content": q}] for q in capital_questions])
        calls_text = chat([[{"role": "user", "content": q}] for q in questions], tools)
        calls = [parse(text)[1] for text in calls_text]
        right_calls = [len(c) == 1 and c[0]["name"] == "add" and json.loads(c[0]["arguments"]) == {"a": a, "b": b}
                       for c, (a, b) in zip(calls, pairs)]
        # the client sends back the model's own call with the tool's result
        follow_ups = [[{"role": "user", "content": q},
                       {"role": "assistant", "content": "", "tool_calls": [
                           {"id": "call_0", "type": "function", "function": {
                               "name": "add", "arguments": json.loads(c[0]["arguments"]) if ok else {"a": a, "b": b}}}]},
                       {"role": "tool", "tool_call_id": "call_0", "content": str(a + b)}]
                      for q, c, ok, (a, b) in zip(questions, calls, right_calls, pairs)]
        finals = chat(follow_ups, tools)
        caps_with_tools = chat([[{"role": "user", "content": q}] for q in capital_questions], tools)
    results = {
        "additions, no tools": (sum(x == str(a + b) for x, (a, b) in zip(sums, pairs)), len(pairs)),
        "capitals, no tools": (sum(x == c for x, c in zip(caps, expected_capitals)), len(caps)),
        "add tool call (hermes parse, right a and b)": (sum(right_calls), len(pairs)),
        "answer after the tool message": (sum(x == str(a + b) for x, (a, b) in zip(finals, pairs)), len(pairs)),
        "capitals with the tool offered (no call, right capital)":
            (sum(x == c for x, c in zip(caps_with_tools, expected_capitals)), len(caps)),
    }
    for name, (right, total) in results.items():
        print(f"{name}: {right}/{total}")
    wrong = [(q, t) for q, t, ok in zip(questions, calls_text, right_calls) if not ok][:5]
    for question, text in wrong:
        print(f"wrong call: {question!r} -> {text!r}")


if __name__ == "__main__":
    main()
