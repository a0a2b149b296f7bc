"""How far the KV cache types move the logits from a float32 engine's, on the same random weights.

One bfloat16 random checkpoint of the shape in --config (cached_random_checkpoint) is loaded three
times: dtype float32 with a float32 cache (the reference), bfloat16 with a bfloat16 cache ("auto")
and bfloat16 with a float8 cache ("fp8"); bfloat16 weights are exact in float32, so only the
arithmetic and the cache differ. Prompts are bench.py's kind (random ids below 10000, lengths
uniform in [100, 1024], random.seed(0)), greedy, max_tokens=2, without prefix caching, so each
prompt has two steps: the prefill (its logits sample the first token) and the first decode step,
the first that reads the K/V the prompt wrote to the cache.

Every engine must decode from the same token for the decode logits to be comparable, and a
prompt + token prefill would not read the cache. So the reference runs first, and the others are
made to sample the reference's first token at the end of each prompt's prefill (the runner's
sampler output is overwritten for those rows, before the next step reads it); the script checks
that every engine's first output token is the reference's. Logits are captured where the runner
samples them, row by row with the request id of each row's sequence, with enforce_eager=True.

Reported per engine and step against float32: the relative L2 error per prompt
||l - l32|| / ||l32 - mean(l32)|| (mean and max over prompts), the largest absolute error,
KL(softmax(l32) || softmax(l)) averaged over prompts, and how often the argmax agrees. The prefill
rows are the engine's own share: on the GPU a plain prefill attends over the step's 16-bit K/V, so
"fp8" and "auto" prefills match and the decode rows show what float8 storage adds. (On the CPU the
torch twins read the cache in prefills too, so there float8 shows in both steps.)

    PYTHONPATH=. python scripts/kv_cache_accuracy.py          # Qwen3-0.6B shape on the GPU
    PYTHONPATH=. python scripts/kv_cache_accuracy.py --device cpu --config tiny.json --num-prompts 8 --max-input-len 200
"""
import argparse
import gc
import json
import os
import random
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.checkpoints.random_checkpoint import cached_random_checkpoint

ENGINES = {   # name: (model dtype, kv_cache_dtype); the first is the reference
    "float32": ("float32", "auto"),
    "bf16, auto cache": ("bfloat16", "auto"),
    "bf16, fp8 cache": ("bfloat16", "fp8"),
}


@dataclass(slots=True)
class StepLogits:
    """float32 logits on the host, one row per prompt in prompt order, and the first tokens."""
    prefill: torch.Tensor         # [num_prompts, vocab]: the step that samples the first token
    decode: torch.Tensor          # [num_prompts, vocab]: the first decode step
    first_tokens: list[int]       # the first generated token of each prompt


class StepLogitsRecorder:
    """Wraps one runner's `launch` and `sampler`: keeps the logits of every sampled row under its
    request id and step kind, and optionally forces the token sampled at the end of a prefill."""

    def __init__(self, llm: LLM, forced_first_tokens: dict[Hashable, int] | None = None):
        self.prefill: dict[Hashable, torch.Tensor] = {}
        self.decode: dict[Hashable, torch.Tensor] = {}
        self.forced = forced_first_tokens
        self.step: tuple[bool, list[Hashable]] | None = None    # (is_prefill, request id of each row)
        runner = llm.engine.core.executor
        launch, sampler = runner.launch, runner.driver.sampler

        def recording_launch(batch, **kwargs):
            # ask before launch: the scheduler records the step after it
            self.step = (batch.is_prefill, [seq.request_id for seq in batch.sampled_seqs()])
            return launch(batch, **kwargs)

        def recording_sampler(logits, params):
            is_prefill, request_ids = self.step
            out = sampler(logits, params)
            rows = logits.float().cpu()
            kept = self.prefill if is_prefill else self.decode
            for row, request_id in enumerate(request_ids):
                if request_id in kept:
                    raise RuntimeError(f"request {request_id} sampled twice in {'prefill' if is_prefill else 'decode'}")
                kept[request_id] = rows[row]
            if is_prefill and self.forced is not None:
                out.token_ids = torch.tensor([self.forced[r] for r in request_ids], dtype=out.token_ids.dtype,
                                             device=out.token_ids.device)
            return out

        runner.launch, runner.driver.sampler = recording_launch, recording_sampler


def bench_prompts(num_prompts: int, min_len: int, max_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """bench.py's prompts: random token ids below 10000 (or the vocabulary), uniform lengths."""
    rng = random.Random(seed)
    top = min(10000, vocab_size - 1)
    return [[rng.randint(0, top) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_prompts)]


def capture_step_logits(path: str, prompts: list[list[int]], dtype: str, kv_cache_dtype: str, device: str,
                        forced_first_tokens: list[int] | None = None) -> StepLogits:
    """Run the prompts greedily for two tokens in a fresh engine; its prefill and first decode
    logits. With forced_first_tokens, each prompt's first token is that one, whatever the logits."""
    llm = LLM(path, dtype=dtype, kv_cache_dtype=kv_cache_dtype, device=device, enforce_eager=True,
              enable_prefix_caching=False, max_model_len=max(len(p) for p in prompts) + 2)
    try:
        forced = None if forced_first_tokens is None else dict(enumerate(forced_first_tokens))
        recorder = StepLogitsRecorder(llm, forced)
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            llm.engine.add_request(prompt, params, request_id=i)
        outputs = {}
        while not llm.engine.is_finished():
            outputs.update((o["request_id"], o) for o in llm.engine.step())
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    ids = range(len(prompts))
    if sorted(outputs) != list(ids) or sorted(recorder.prefill) != list(ids) or sorted(recorder.decode) != list(ids):
        raise RuntimeError("not every prompt got exactly one prefill and one decode step")
    first_tokens = [outputs[i]["token_ids"][0] for i in ids]
    if forced_first_tokens is not None and first_tokens != forced_first_tokens:
        raise RuntimeError("the forced first tokens did not reach the outputs")
    return StepLogits(torch.stack([recorder.prefill[i] for i in ids]), torch.stack([recorder.decode[i] for i in ids]),
                      first_tokens)


def logits_errors(reference: torch.Tensor, logits: torch.Tensor) -> dict[str, float]:
    """Errors of [prompts, vocab] logits against reference ones, per prompt then summarised. The
    L2 error is relative to the reference's spread around its mean (a softmax ignores the mean)."""
    reference, logits = reference.double(), logits.double()
    spread = (reference - reference.mean(dim=-1, keepdim=True)).norm(dim=-1)
    relative = (logits - reference).norm(dim=-1) / spread
    log_p, log_q = torch.log_softmax(reference, dim=-1), torch.log_softmax(logits, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    return {
        "rel_l2_mean": relative.mean().item(),
        "rel_l2_max": relative.max().item(),
        "max_abs": (logits - reference).abs().max().item(),
        "kl_mean": kl.mean().item(),
        "top1_agree": (logits.argmax(dim=-1) == reference.argmax(dim=-1)).double().mean().item(),
    }


def markdown_table(rows: list[tuple[str, str, dict[str, float]]], num_prompts: int) -> str:
    lines = ["| step | engine | rel. L2 mean | rel. L2 max | max abs | KL mean | top-1 agree |",
             "|---|---|---|---|---|---|---|"]
    for step, engine, e in rows:
        agree = round(e["top1_agree"] * num_prompts)
        lines.append(f"| {step} | {engine} | {e['rel_l2_mean']:.2e} | {e['rel_l2_max']:.2e} | {e['max_abs']:.3f} "
                     f"| {e['kl_mean']:.2e} | {agree}/{num_prompts} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/qwen3-0.6b.json", help="config.json of a model shape")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-input-len", type=int, default=100)
    parser.add_argument("--max-input-len", type=int, default=1024)
    args = parser.parse_args()
    if not 1 <= args.min_input_len <= args.max_input_len:
        parser.error("--min-input-len must be at least 1 and at most --max-input-len")
    if args.num_prompts < 1:
        parser.error("--num-prompts must be at least 1")

    path = cached_random_checkpoint(args.config)
    with open(os.path.join(path, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    prompts = bench_prompts(args.num_prompts, args.min_input_len, args.max_input_len, vocab_size)
    results: dict[str, StepLogits] = {}
    for name, (dtype, kv_cache_dtype) in ENGINES.items():
        reference = results.get("float32")
        results[name] = capture_step_logits(path, prompts, dtype, kv_cache_dtype, args.device,
                                            None if reference is None else reference.first_tokens)

    reference = results.pop("float32")
    rows = [(step, name, logits_errors(getattr(reference, step), getattr(logits, step)))
            for step in ("prefill", "decode") for name, logits in results.items()]
    spread = (reference.decode - reference.decode.mean(dim=-1, keepdim=True)).std(dim=-1).mean().item()
    print(f"\n{args.config}, {args.device}: {args.num_prompts} prompts of {args.min_input_len}-{args.max_input_len} "
          f"random tokens; errors against the float32 engine (its decode logits' std: {spread:.3f}); "
          f"every engine decodes from float32's first token\n")
    print(markdown_table(rows, args.num_prompts))


if __name__ == "__main__":
    main()
