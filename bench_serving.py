"""Online serving benchmark: bench.py's requests sent over HTTP to a running `nanovllm serve`.

Requests arrive as a Poisson process at --request-rate per second (inf: all at once) and stream
from /v1/completions. The default workload is bench.py's: 256 requests, prompt and output lengths
each uniform in [100, 1024] (random.seed(0)), random token ids below 10000, temperature 0.6,
ignore_eos. Reports request and output-token throughput and TTFT, TPOT and end-to-end latency
(mean, p50, p90, p99).

    nanovllm serve ~/huggingface/Qwen3-0.6B --port 8000 &
    python bench_serving.py --port 8000 --request-rate 16 --save-result rate16.json

Needs aiohttp besides nanovllm, which draws the requests (`pip install "nanovllm[bench]"`).
"""
import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field

import aiohttp

from nanovllm.checkpoints.bench_workload import bench_requests


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0          # seconds from sending to the first text
    latency: float = 0.0       # seconds from sending to the last byte
    error: str = ""
    chunk_times: list[float] = field(default_factory=list, repr=False)

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def arrival_delays(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Gaps between arrivals of a Poisson process (all zero at an infinite rate)."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    return [rng.expovariate(request_rate) for _ in range(num_requests)]


async def send_request(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int,
                       temperature: float) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(prompt_len=len(prompt))
    start = time.perf_counter()
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for line in response.content:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    now = time.perf_counter()
                    if not result.chunk_times:
                        result.ttft = now - start
                    result.chunk_times.append(now)
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens == max_tokens
        if not result.ok:
            result.error = f"got {result.output_tokens} tokens, asked for {max_tokens}"
    except aiohttp.ClientError as e:
        result.error = repr(e)
    return result


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:      # nearest rank
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {"mean": sum(ordered) / len(ordered), "p50": at(0.50), "p90": at(0.90), "p99": at(0.99)}


def summarize(results: list[RequestResult], duration: float, args: argparse.Namespace) -> dict:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
        "num_requests": len(results), "completed": len(done), "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + sum(r.prompt_len for r in done)) / duration,
        "total_output_tokens": output_tokens,
        "ttft_s": percentiles([r.ttft for r in done]),
        "tpot_s": percentiles([r.tpot for r in done if r.output_tokens > 1]),
        "latency_s": percentiles([r.latency for r in done]),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def print_summary(summary: dict) -> None:
    print(f"requests: {summary['completed']} completed, {summary['failed']} failed in {summary['duration_s']:.2f} s "
          f"(rate {summary['request_rate']})")
    print(f"request throughput: {summary['request_throughput']:.2f} req/s, output throughput: "
          f"{summary['output_throughput']:.2f} tok/s, total: {summary['total_token_throughput']:.2f} tok/s")
    for name in ("ttft_s", "tpot_s", "latency_s"):
        p = summary[name]
        if p:
            print(f"{name[:-2].upper():>8} ms: mean {p['mean'] * 1e3:9.2f}  p50 {p['p50'] * 1e3:9.2f}  "
                  f"p90 {p['p90'] * 1e3:9.2f}  p99 {p['p99'] * 1e3:9.2f}")
    for error in summary["errors"]:
        print("error:", error)


async def run(args: argparse.Namespace) -> dict:
    base = args.base_url or f"http://{args.host}:{args.port}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    workload = bench_requests(args.num_prompts, (args.min_input_len, args.max_input_len),
                              (args.min_output_len, args.max_output_len), args.max_token_id)
    delays = arrival_delays(args.num_prompts, args.request_rate, args.seed)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(headers=headers, connector=connector, timeout=timeout) as session:
        model = args.model
        if model is None:
            async with session.get(f"{base}/v1/models") as response:
                model = (await response.json())["data"][0]["id"]
        url = f"{base}/v1/completions"
        warmup = await send_request(session, url, model, [1, 2, 3], 4, args.temperature)
        if not warmup.ok:
            raise SystemExit(f"warm-up request failed: {warmup.error}")
        tasks = []
        start = time.perf_counter()
        for (prompt, max_tokens), delay in zip(workload, delays):
            await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send_request(session, url, model, prompt, max_tokens, args.temperature)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    summary = summarize(results, duration, args)
    summary.update(model=model, base_url=base, workload=dict(
        num_prompts=args.num_prompts, input_len=[args.min_input_len, args.max_input_len],
        output_len=[args.min_output_len, args.max_output_len], max_token_id=args.max_token_id,
        temperature=args.temperature))
    if args.save_result:
        summary["requests"] = [{k: v for k, v in asdict(r).items() if k != "chunk_times"} for r in results]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--base-url", default=None, help="instead of --host/--port, e.g. http://10.0.0.2:8000")
    parser.add_argument("--model", default=None, help="served model name (default: the server's only model)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests per second; inf: all at once")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--min-input-len", type=int, default=100)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--min-output-len", type=int, default=100)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--max-token-id", type=int, default=10000, help="prompt token ids are drawn in [0, this]")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--save-result", default=None, metavar="FILE.json", help="write the summary and every request")
    args = parser.parse_args()
    summary = asyncio.run(run(args))
    print_summary(summary)
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"saved to {args.save_result}")


if __name__ == "__main__":
    main()
