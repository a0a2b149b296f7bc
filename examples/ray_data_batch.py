"""Offline generation for a very large prompt set with Ray Data: a pool of actors, each holding
one `LLM`, reads prompts in batches, generates, and writes JSON lines. Ray Data streams the
dataset through the pool, so the prompts never need to fit in one process's memory.

    pip install "ray[data]"
    python examples/ray_data_batch.py --model ~/huggingface/Qwen3-0.6B --input prompts.txt \\
        --output generations/ --replicas 8
    python examples/ray_data_batch.py --device cpu --num-prompts 200    # tiny demo model, on CPU

--input is a text file with one prompt per line (or a directory of them, local or s3://...).
With no --input, --num-prompts synthetic prompts are made. With no --model, a tiny random demo
checkpoint is built offline (its output is random text; the code path is the same). On a cluster
(see docs/ray.md) the model directory must exist on every node. For a handful of replicas and a
job that fits in memory, `nanovllm.ray.RayLLM` is simpler.
"""
import argparse
import os
import tempfile

import numpy as np
import ray

from nanovllm import LLM, SamplingParams
from nanovllm.checkpoints.random_checkpoint import write_tiny_model


class Generator:
    """One Ray Data actor: loads the engine once, then generates for each batch of prompts."""

    def __init__(self, model: str, engine_args: dict, sampling: dict):
        self.llm = LLM(model, **engine_args)
        self.params = SamplingParams(**sampling)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        prompts = [str(p) for p in batch["text"]]
        outputs = self.llm.generate(prompts, self.params, use_tqdm=False)
        return {
            "prompt": np.array(prompts, dtype=object),
            "text": np.array([o["text"] for o in outputs], dtype=object),
            "num_generated_tokens": np.array([len(o["token_ids"]) for o in outputs]),
            "finish_reason": np.array([o["finish_reason"] for o in outputs], dtype=object),
        }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local Hugging Face Qwen3 checkpoint directory (on every node)")
    parser.add_argument("--input", help="text file(s) with one prompt per line")
    parser.add_argument("--num-prompts", type=int, default=1000, help="synthetic prompts when no --input")
    parser.add_argument("--output", help="directory for JSON-lines results (default: print a few)")
    parser.add_argument("--replicas", type=int, default=2, help="engine actors in the pool")
    parser.add_argument("--batch-size", type=int, default=256, help="prompts per engine call")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, a local `ray start`, or a new local one)")
    args = parser.parse_args()

    path = args.model
    if path is None:
        path = os.path.join(tempfile.gettempdir(), "nanovllm-demo-model")
        if not os.path.isfile(os.path.join(path, "config.json")):
            write_tiny_model(path)
        print(f"No --model given: using the tiny random demo checkpoint at {path} (random text).")
    path = os.path.abspath(os.path.expanduser(path))

    ray.init(address=args.address)
    use_gpus = args.device == "cuda" or (args.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    tp = args.tensor_parallel_size
    if args.input:
        prompts = ray.data.read_text(args.input)
    else:
        prompts = ray.data.from_items([{"text": f"Question {i}: tell me about the number {i}."}
                                       for i in range(args.num_prompts)])
    generations = prompts.map_batches(
        Generator,
        fn_constructor_kwargs=dict(
            model=path,
            engine_args=dict(device="cuda" if use_gpus else "cpu", tensor_parallel_size=tp),
            sampling=dict(temperature=0.6, max_tokens=args.max_tokens, seed=0)),
        batch_size=args.batch_size,
        # a fixed pool: each actor loads the model once and keeps it for every batch it is given
        compute=ray.data.ActorPoolStrategy(size=args.replicas),
        # the engine spawns its tensor-parallel workers beside it, so one actor holds all its GPUs
        num_gpus=tp if use_gpus else 0,
        num_cpus=1 if use_gpus else tp,
    )
    if args.output:
        generations.write_json(args.output)
        print(f"Wrote the generations to {args.output}")
    else:
        total = 0
        for row in generations.iter_rows():
            if total < 3:
                print(f"\nPrompt: {row['prompt']!r}\nCompletion: {row['text']!r} ({row['finish_reason']})")
            total += 1
        print(f"\nGenerated for {total} prompts.")


if __name__ == "__main__":
    main()
