"""Generate for a few prompts.

    python example.py --model ~/huggingface/Qwen3-0.6B

With no --model, a tiny random demo checkpoint is built offline and used instead: the code path is
the same, but its output is random text.
"""
import argparse
import os
import tempfile

from nanovllm import LLM, SamplingParams
from nanovllm.utils.random_checkpoint import write_tiny_model


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local Hugging Face Qwen3 checkpoint directory")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    path = args.model
    if path is None:
        path = os.path.join(tempfile.gettempdir(), "nanovllm-demo-model")
        if not os.path.isfile(os.path.join(path, "config.json")):
            write_tiny_model(path)
        print(f"No --model given: using the tiny random demo checkpoint at {path}. "
              "Its weights are random, so its output is random text.")

    llm = LLM(path, device=args.device, tensor_parallel_size=args.tensor_parallel_size)
    questions = ["introduce yourself", "list all prime numbers within 100"]
    if llm.tokenizer.chat_template:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                     add_generation_prompt=True) for q in questions]
    else:
        prompts = questions
    outputs = llm.generate(prompts, SamplingParams(temperature=0.6, max_tokens=args.max_tokens))
    for question, output in zip(questions, outputs):
        print(f"\nPrompt: {question!r}\nCompletion: {output['text']!r} ({output['finish_reason']})")


if __name__ == "__main__":
    main()
