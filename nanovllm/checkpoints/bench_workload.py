"""The requests of nano-vllm's benchmark, which bench.py, bench_serving.py and the scripts under
scripts/ all run: prompt and output lengths uniform in [100, 1024], random token ids up to 10000,
drawn from seed 0 in one order (every prompt, then every output length), so that each tool sees
the same requests. And the model the benchmarks run: a checkpoint, or random weights of a shape."""
import argparse
import random

from nanovllm.checkpoints.random_checkpoint import cached_shape


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model DIR or --config SHAPE.json, one of them required."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="local Hugging Face checkpoint directory of a supported family")
    source.add_argument("--config", help="config.json of a model shape (see configs/); weights are random")


def model_engine_args(args: argparse.Namespace) -> dict:
    """LLM's model path and load format for add_model_arguments' choice: a shape's weights are
    drawn on the device (load_format="dummy") instead of read."""
    if args.model:
        return {"model": args.model, "load_format": "auto"}
    return {"model": cached_shape(args.config), "load_format": "dummy"}


def bench_requests(num_requests: int = 256, input_len: tuple[int, int] = (100, 1024),
                   output_len: tuple[int, int] = (100, 1024),
                   max_token_id: int = 10000) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per request; lengths are inclusive ranges."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, max_token_id) for _ in range(rng.randint(*input_len))]
               for _ in range(num_requests)]
    return [(prompt, rng.randint(*output_len)) for prompt in prompts]
