"""Multi-turn chat over a KV pool too small for the conversations: the prefix cache's host tier
(kv_offload_gib) against recomputing, and the copy bandwidth it reaches.

64 conversations of 8 turns (by default) start from 2,000-token histories; each turn sends the whole
history (plus the reply and a new 64-token user message since the last turn) and generates 64 tokens
(ignore_eos, greedy). Turns go round the conversations (turn 1 of every conversation, then turn 2...)
with 8 requests in flight, a new one sent as one finishes: a conversation comes back after the 63
others, so an LRU pool that holds a quarter of them has lost its history by then. The GPU pool is
sized to a quarter of the conversations' final histories (--num-kvcache-blocks to override).

Printed per run (host tier off, then on): TTFT p50/p90 of turn 1 (nothing cached in either run)
and of turns 2-8, output and total token throughput, the prefix-cache hit rate and the host tier's
counters. Then the copy bandwidth: a plain pinned host<->device copy of 1 GiB (the link's reference)
and the host tier's own offload and load paths on 256 blocks of the pool.

    python scripts/bench_multiturn.py --config configs/qwen3-8b.json              # random weights, one GPU
    python scripts/bench_multiturn.py --config configs/qwen3-8b.json --only on --kv-offload-gib 40
    python scripts/bench_multiturn.py --model /tmp/tiny --num-convs 4 --turns 2 --history-len 60 \\
        --reply-len 4 --user-len 8 --block-size 16 --kv-offload-gib 0.01     # a CPU smoke run
"""
import argparse
import gc
import random
import time

import numpy as np
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.checkpoints.bench_workload import add_model_arguments, model_engine_args


def conversation_turns(args, vocab_size: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each conversation's opening history and its user messages, random ids below 10000."""
    rng = random.Random(0)
    top = min(10000, vocab_size)
    histories = [[rng.randrange(10, top) for _ in range(args.history_len)] for _ in range(args.num_convs)]
    user_messages = [[[rng.randrange(10, top) for _ in range(args.user_len)] for _ in range(args.turns)]
                     for _ in range(args.num_convs)]
    return histories, user_messages


def run_workload(llm: LLM, args) -> dict:
    histories, user_messages = conversation_turns(args, llm.config.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=args.reply_len, ignore_eos=True)
    order = [(turn, conv) for turn in range(args.turns) for conv in range(args.num_convs)]
    ready = {conv: 0 for conv in range(args.num_convs)}        # the turn a conversation may send next
    ttft = {0: [], 1: []}                                        # turn 1, later turns
    replies, num_prompt_tokens, num_output_tokens, in_flight = {}, 0, 0, {}
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)     # warm-up
    before = llm.stats()
    start = time.perf_counter()
    while order or in_flight:
        while order and len(in_flight) < args.concurrency and ready[order[0][1]] == order[0][0]:
            turn, conv = order.pop(0)
            request_id = f"{conv}-{turn}"
            in_flight[request_id] = (turn, conv)
            num_prompt_tokens += len(histories[conv])
            llm.engine.add_request(list(histories[conv]), params, request_id=request_id)
        for output in llm.engine.step():
            turn, conv = in_flight.pop(output["request_id"])
            ttft[min(turn, 1)].append(output["metrics"]["time_to_first_token"])
            num_output_tokens += len(output["token_ids"])
            replies[(conv, turn)] = output["token_ids"]
            histories[conv] += output["token_ids"] + user_messages[conv][turn]
            ready[conv] = turn + 1
    elapsed = time.perf_counter() - start
    after = llm.stats()
    delta = {key: after[key] - before[key] for key in after if key.endswith(("hits", "queries", "offloaded", "loaded"))}
    return {"elapsed": elapsed, "ttft": ttft, "replies": replies, "prompt_tokens": num_prompt_tokens,
            "output_tokens": num_output_tokens, "stats": delta, "kv_offload_usage": after["kv_offload_usage"]}


def report(name: str, result: dict) -> None:
    def pct(values, q):
        return 1000 * float(np.percentile(values, q)) if values else float("nan")
    first, later = result["ttft"][0], result["ttft"][1]
    stats, elapsed = result["stats"], result["elapsed"]
    print(f"[{name}] {elapsed:.1f} s; TTFT turn 1 p50 {pct(first, 50):.0f} ms p90 {pct(first, 90):.0f} ms; "
          f"turns 2+ p50 {pct(later, 50):.0f} ms p90 {pct(later, 90):.0f} ms")
    print(f"[{name}] throughput {result['output_tokens'] / elapsed:,.0f} output tok/s, "
          f"{(result['prompt_tokens'] + result['output_tokens']) / elapsed:,.0f} total tok/s; prefix-cache hits "
          f"{stats['prefix_cache_hits']:,} of {stats['prefix_cache_queries']:,} prompt tokens "
          f"({stats['prefix_cache_host_hits']:,} from the host tier); blocks offloaded "
          f"{stats['kv_offload_blocks_offloaded']:,}, loaded {stats['kv_offload_blocks_loaded']:,}; "
          f"host tier {100 * result['kv_offload_usage']:.0f}% full")


def timed(fn) -> float:
    """Seconds fn takes on the device (or the host, on a CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def plain_copy_bandwidth(num_bytes: int = 1 << 30) -> None:
    """The link's reference: one pinned host buffer to and from the device, in GB/s."""
    if not torch.cuda.is_available():
        print("[copy] plain pinned copy: no CUDA device, skipped")
        return
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    for _ in range(2):      # the second of each is reported
        h2d = timed(lambda: device.copy_(host, non_blocking=True))
        d2h = timed(lambda: host.copy_(device, non_blocking=True))
    print(f"[copy] plain pinned copy of {num_bytes / 2**30:.0f} GiB: host->device {num_bytes / h2d / 1e9:.1f} GB/s, "
          f"device->host {num_bytes / d2h / 1e9:.1f} GB/s")


def host_tier_bandwidth(llm: LLM, max_blocks: int = 256) -> None:
    """The host tier's own paths (gather + device->host, host->device + scatter) on pool blocks.
    Run after the workload: it overwrites blocks of both tiers."""
    host = llm.engine.core.executor.driver.host_kv_cache
    n = min(max_blocks, host.num_blocks, llm.engine.core.executor.driver.num_kvcache_blocks)
    rng = np.random.default_rng(0)
    gpu_ids = rng.permutation(llm.engine.core.executor.driver.num_kvcache_blocks)[:n]
    pairs = np.stack([gpu_ids, np.arange(n)], axis=1)
    none = np.zeros((0, 2), np.int64)
    num_bytes = n * host.kv_cache.block_bytes
    for _ in range(2):
        offload = timed(lambda: host.transfer(pairs, none))
        load = timed(lambda: host.transfer(none, pairs[:, ::-1].copy()))
    print(f"[copy] host tier, {n} blocks of {host.kv_cache.block_bytes / 2**20:.2f} MiB: offload "
          f"{num_bytes / offload / 1e9:.1f} GB/s, load {num_bytes / load / 1e9:.1f} GB/s")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--num-convs", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--history-len", type=int, default=2000, help="tokens of each conversation's first prompt")
    parser.add_argument("--reply-len", type=int, default=64)
    parser.add_argument("--user-len", type=int, default=64, help="tokens of each later user message")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--num-kvcache-blocks", type=int, default=None,
                        help="the GPU pool (default: a quarter of the conversations' final histories)")
    parser.add_argument("--kv-offload-gib", type=float, default=40.0, help="the host tier of the 'on' run")
    parser.add_argument("--only", choices=["off", "on"], default=None, help="one run instead of both")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()

    final_len = args.history_len + (args.turns - 1) * (args.reply_len + args.user_len) + args.reply_len
    if final_len > args.max_model_len:
        parser.error(f"the last turn reaches {final_len} tokens, beyond --max-model-len {args.max_model_len}")
    num_blocks = args.num_kvcache_blocks or max(-(-args.max_model_len // args.block_size),
                                                -(-args.num_convs * final_len // (4 * args.block_size)))
    print(f"{args.num_convs} conversations x {args.turns} turns, histories {args.history_len} -> {final_len} "
          f"tokens; GPU pool {num_blocks} blocks x {args.block_size} tokens = {num_blocks * args.block_size:,} "
          f"tokens ({num_blocks * args.block_size / (args.num_convs * final_len):.0%} of the final histories)")
    results = {}
    for name in ("off", "on"):
        if args.only and name != args.only:
            continue
        llm = LLM(**model_engine_args(args), max_model_len=args.max_model_len, kvcache_block_size=args.block_size,
                  num_kvcache_blocks=num_blocks, kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager,
                  kv_offload_gib=args.kv_offload_gib if name == "on" else 0.0)
        results[name] = run_workload(llm, args)
        report(name, results[name])
        if name == "on":
            host_tier_bandwidth(llm)
        llm.shutdown()
        del llm
        gc.collect()
    if len(results) == 2:
        same = sum(results["off"]["replies"][key] == reply for key, reply in results["on"]["replies"].items())
        print(f"replies equal in both runs: {same} of {len(results['on']['replies'])} (random weights in "
              f"bfloat16: a recomputed prefix may round differently from the one computed turn by turn)")
    plain_copy_bandwidth()


if __name__ == "__main__":
    main()
