"""What speculative decoding costs and gains on one GPU (random weights of the given shapes):

1. A verify step of k + 1 = 2..6 tokens per sequence (the target over its paged cache from a CUDA
   graph of k + 1 tokens a sequence, then the rejection sampler) against a plain decode step (CUDA
   graph, then the sampler), at batch 1, 4, 16 and 64 with 1K-token contexts, and the verify step
   run eagerly: the ratio says up to which batch verification is nearly free
   (SPECULATION_MAX_RUNNING in engine/scheduler.py should sit there).
2. A draft's cost per proposal: one decode step of the draft shape (default Qwen3-0.6B) at the same
   batches, and from 1 and 2 the expected time per output token at acceptance rates 0.5..0.9.
3. End to end at batch 1: time per output token of greedy generation with n-gram speculation and
   without it (the same engine, its proposer switched off), and with the draft shape as a draft
   model, each with its acceptance rate. Random weights rarely repeat themselves and a random draft
   never agrees with a random target, so pass --model (and --draft-model) with real checkpoints to
   see acceptance; with random weights the draft row shows the draft's overhead.

    PYTHONPATH=. python scripts/spec_verify_timing.py
    PYTHONPATH=. python scripts/spec_verify_timing.py --model ~/huggingface/Qwen3-8B
"""
import argparse
import gc
import time


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/qwen3-8b.json", help="target shape (random weights)")
    parser.add_argument("--draft-config", default="configs/qwen3-0.6b.json", help="draft shape (random weights)")
    parser.add_argument("--model", default=None, help="a real target checkpoint for the end-to-end part")
    parser.add_argument("--draft-model", default=None, help="a real draft checkpoint for the end-to-end part")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="k of the end-to-end part")
    parser.add_argument("--output-len", type=int, default=256)
    return parser.parse_args()


def median_ms(fn, reps: int = 30, warmup: int = 5) -> float:
    """Median device time of fn in ms, by CUDA events around each call."""
    import numpy as np
    import torch
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def step_ms(llm, batch: int, context: int, query_len: int) -> float:
    """Median ms of one step over `batch` sequences of `context` tokens, each computing its last
    query_len positions: a plain decode step (graph replay and sampler) when query_len is 1, else a
    verify step (a CUDA graph where the runner has one, else eager; then the rejection sampler) with
    random proposals."""
    import numpy as np
    import torch

    from nanovllm.sample.sampler import SamplingTensors
    from nanovllm.sample.rejection_sampler import VerifyTensors, rejection_sample
    from nanovllm.executor.step_inputs import StepInputs
    runner, vocab = llm.engine.core.executor, llm.config.model_config.vocab_size
    block_size = llm.config.kvcache_block_size
    blocks = -(-context // block_size)
    tables = np.arange(batch * blocks).reshape(batch, blocks)
    positions = np.tile(np.arange(context - query_len, context), batch)
    seq_of_token = np.repeat(np.arange(batch), query_len)
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    cu = np.arange(batch + 1) * query_len
    rows = batch * query_len
    inputs = StepInputs(query_len > 1, np.random.randint(0, vocab, rows), positions, slots,
                        np.full(batch, context), cu, tables, np.arange(rows) if query_len > 1 else cu[1:] - 1)
    sampling = SamplingTensors(torch.full((rows,), 0.6, device="cuda"), torch.randint(0, 2**62, (rows,), device="cuda"))
    if query_len == 1:
        return median_ms(lambda: runner.driver.sampler(runner.driver.execute(inputs), sampling))
    drafts = torch.randint(0, vocab, (batch, query_len), device="cuda")
    drafts[:, -1] = -1
    verify = VerifyTensors(drafts.flatten(), torch.arange(batch, device="cuda").repeat_interleave(query_len),
                           torch.arange(query_len, device="cuda").repeat(batch), batch)
    return median_ms(lambda: rejection_sample(runner.driver.execute(inputs), sampling, verify))


def verify_graphs(llm, query_len: int, max_num_seqs: int):
    """CUDA graphs of steps of query_len tokens a sequence for llm's runner (as speculation captures
    for k + 1 = query_len), at every batch size up to max_num_seqs."""
    from nanovllm.worker.cuda_graph import StepGraphs
    config, runner = llm.config, llm.engine.core.executor
    return StepGraphs(runner.driver.model, runner.driver.backend, max_num_seqs, config.min_kvcache_blocks,
                      config.model_config.hidden_size, config.torch_dtype, runner.driver.device, query_len=query_len,
                      pool=runner.driver.graphs[0].pool)


def load(path_or_config: str, **engine_args):
    from nanovllm import LLM
    from nanovllm.checkpoints.random_checkpoint import cached_shape
    if path_or_config.endswith(".json"):
        return LLM(cached_shape(path_or_config), load_format="dummy", **engine_args)
    return LLM(path_or_config, **engine_args)


def release(llm) -> None:
    import torch
    llm.shutdown()
    gc.collect()
    torch.cuda.empty_cache()


def main():
    args = parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    max_len = args.context + args.output_len + 64
    target = load(args.config, max_model_len=max_len, max_num_seqs=max(batches))
    target.engine.core.executor.driver.kv_cache.tensor.normal_()      # never time on zeros
    print(f"target {args.config}: step ms at {args.context}-token contexts (verify / decode in brackets)")
    print("batch | decode | " + " | ".join(f"verify {n}" for n in range(2, 7)) + " | verify 5 eager")
    runner = target.engine.core.executor
    decode_graphs = runner.driver.graphs[0]
    decode_ms = {batch: step_ms(target, batch, args.context, 1) for batch in batches}
    verify_ms = {}
    for query_len in range(2, 7):
        runner.driver.graphs = [decode_graphs, verify_graphs(target, query_len, max(batches))]
        for batch in batches:
            verify_ms[batch, query_len] = step_ms(target, batch, args.context, query_len)
    runner.driver.graphs = [decode_graphs]
    for batch in batches:
        cells = [f"{verify_ms[batch, n]:7.3f} ({verify_ms[batch, n] / decode_ms[batch]:.2f}x)" for n in range(2, 7)]
        eager = step_ms(target, batch, args.context, 5)
        cells.append(f"{eager:7.3f} ({eager / decode_ms[batch]:.2f}x)")
        print(f"{batch:5d} | {decode_ms[batch]:7.3f} | " + " | ".join(cells))
    release(target)

    draft = load(args.draft_config, max_model_len=max_len, max_num_seqs=max(batches))
    draft.engine.core.executor.driver.kv_cache.tensor.normal_()
    draft_ms = {batch: step_ms(draft, batch, args.context, 1) for batch in batches}
    release(draft)
    print(f"\ndraft {args.draft_config}: ms per proposal (one decode step) " +
          ", ".join(f"batch {b}: {ms:.3f}" for b, ms in draft_ms.items()))
    print("\nexpected ms per output token, k = 4: (verify(k+1) + k * draft) / E[tokens per step], "
          "E = (1 - a^(k+1)) / (1 - a); plain decode in brackets")
    k = 4
    for batch in batches:
        cells = []
        for a in (0.5, 0.6, 0.7, 0.8, 0.9):
            per_step = (1 - a ** (k + 1)) / (1 - a)
            ngram = verify_ms[batch, k + 1] / per_step
            drafted = (verify_ms[batch, k + 1] + k * draft_ms[batch]) / per_step
            cells.append(f"a={a}: ngram {ngram:.2f} draft {drafted:.2f}")
        print(f"batch {batch:3d} ({decode_ms[batch]:.2f}): " + " | ".join(cells))

    from nanovllm.checkpoints.random_checkpoint import cached_shape
    k = args.num_speculative_tokens
    draft_model = args.draft_model or cached_shape(args.draft_config)
    print(f"\nend to end, batch 1, {args.output_len} tokens, greedy:")
    llm = load(args.model or args.config, max_model_len=max_len, max_num_seqs=8,
               speculative_config={"method": "ngram", "num_speculative_tokens": k})
    proposer = llm.engine.core.proposer
    for name, use in (("plain", None), (f"ngram k={k}", proposer)):
        llm.engine.core.proposer = use
        time_per_token(llm, name, args)
    release(llm)
    if args.model and not args.draft_model:
        print("(a real target needs a real --draft-model: the draft row is skipped)")
        return
    llm = load(args.model or args.config, max_model_len=max_len, max_num_seqs=8,
               speculative_config={"model": draft_model, "num_speculative_tokens": k})
    time_per_token(llm, f"draft k={k}", args)
    release(llm)


def time_per_token(llm, name: str, args) -> None:
    """One batch-1 greedy generation on a repetitive prompt (after a warm-up): ms per output token."""
    from nanovllm import SamplingParams
    words = "one two three four five six seven eight nine ten " * 12
    prompt = llm.tokenizer.encode(f"Repeat this list exactly, ten more times: {words}")[-args.context // 2:]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    before = llm.stats()
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    elapsed = time.perf_counter() - start
    after = llm.stats()
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    rate = f", acceptance {accepted / drafted:.0%} of {drafted} proposals" if drafted else ""
    print(f"{name:>12}: {1000 * elapsed / len(out['token_ids']):.3f} ms per output token{rate}")


if __name__ == "__main__":
    main()
