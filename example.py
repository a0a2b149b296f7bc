"""Ask a model a few questions through its chat template.

    python example.py                                   # the demo model shipped in the package
    python example.py --model ~/huggingface/Qwen3-0.6B  # a local Hugging Face checkpoint

The demo model (nanovllm.demo) is a 4.9M-parameter Qwen3 trained to add two numbers from 0 to 999
and to name the capital of a few dozen countries; it needs no download.
"""
import argparse

from nanovllm import LLM, SamplingParams
from nanovllm.demo import model_path

QUESTIONS = ["What is 123 + 456?", "What is 999 + 1?", "What's 58 plus 7?", "What is the capital of France?",
             "Which city is the capital of Japan?", "Name the capital of Kenya."]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=model_path(),
                        help="local Hugging Face checkpoint directory (default: the bundled demo model)")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    llm = LLM(args.model, device=args.device, tensor_parallel_size=args.tensor_parallel_size)
    conversations = [[{"role": "user", "content": question}] for question in QUESTIONS]
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    for question, output in zip(QUESTIONS, outputs):
        print(f"Q: {question}\nA: {output['text']}")


if __name__ == "__main__":
    main()
