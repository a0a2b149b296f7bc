"""The requests of nano-vllm's benchmark, which bench.py, bench_serving.py and the scripts under
scripts/ all run: prompt and output lengths uniform in [100, 1024], random token ids up to 10000,
drawn from seed 0 in one order (every prompt, then every output length), so that each tool sees
the same requests."""
import random


def bench_requests(num_requests: int = 256, input_len: tuple[int, int] = (100, 1024),
                   output_len: tuple[int, int] = (100, 1024),
                   max_token_id: int = 10000) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per request; lengths are inclusive ranges."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, max_token_id) for _ in range(rng.randint(*input_len))]
               for _ in range(num_requests)]
    return [(prompt, rng.randint(*output_len)) for prompt in prompts]
