"""Host time of one JSON-schema constrained step, piece by piece: bench.py's tokenizer (151,936 text
pieces, with --config) and schema, ROWS sequences advanced together by tokens drawn uniformly from
their own masks (as a random model's would be), through StructuredOutputManager as the engine calls
it: catch_up (after a step is collected), token_bitmask (before it is sampled), and on a GPU the copy
of the masks and the kernel that applies them to [ROWS, vocab] logits.

    PYTHONPATH=. python scripts/profile_masks.py --config configs/qwen3-0.6b.json [--rows 256]

Prints the median per step of each piece, xgrammar's mask fill alone with each thread count, and
whether a Python thread keeps running while the fill works (it releases the interpreter lock).
"""
import argparse
import os
import statistics
import threading
import time

import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer

from bench import BENCH_SCHEMA
from nanovllm import SamplingParams, StructuredOutputsParams
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.structured_output import StructuredOutputManager
from nanovllm.kernels.token_bitmask import apply_token_bitmask
from nanovllm.utils.random_checkpoint import cached_shape


def allowed_tokens(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab_size])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/qwen3-0.6b.json")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--warmup-steps", type=int, default=30, help="steps before measuring (past the schema's start)")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    import xgrammar      # the `structured` extra

    path = cached_shape(args.config, text_pieces=True)
    tokenizer, config = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    vocab_size = config.vocab_size
    eos = config.eos_token_id if isinstance(config.eos_token_id, int) else config.eos_token_id[0]
    cuda = torch.cuda.is_available()
    manager = StructuredOutputManager(tokenizer, vocab_size, (eos,), pin_memory=cuda)
    structured = StructuredOutputsParams(json=BENCH_SCHEMA, disable_any_whitespace=True)
    params = SamplingParams(structured_outputs=structured, ignore_eos=True)
    seqs = []
    for i in range(args.rows):
        seq = Sequence([1, 2, 3], params, request_id=i)
        seq.grammar = manager.new_grammar(structured, ignore_eos=True)
        seqs.append(seq)
    logits = torch.randn(args.rows, vocab_size, dtype=torch.bfloat16, device="cuda") if cuda else None
    rng = np.random.default_rng(0)
    cores = len(os.sched_getaffinity(0))
    fills = {n: xgrammar.BatchGrammarMatcher(n) for n in sorted({1, 2, 4, 8, cores // 2, cores} - {0})}
    fill_buffer = xgrammar.allocate_token_bitmask(args.rows, vocab_size)
    timings: dict[str, list[float]] = {}

    def timed(name, fn, *fn_args):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn(*fn_args)
        if cuda and name.startswith("device"):
            torch.cuda.synchronize()
        timings.setdefault(name, []).append((time.perf_counter() - start, time.process_time() - start_cpu))
        return result

    for step in range(args.warmup_steps + args.steps):
        if step == args.warmup_steps:
            timings.clear()
        timed("catch_up (after collecting)", lambda: [seq.grammar.catch_up(seq) for seq in seqs])
        masks = timed("token_bitmask", manager.token_bitmask, seqs)
        matchers = [seq.grammar.matcher for seq in seqs]
        for n, fill in fills.items():
            timed(f"  xgrammar fill alone, {n} threads", fill.batch_fill_next_token_bitmask, matchers, fill_buffer)
        if cuda:
            torch.cuda.synchronize()
            bitmask, rows = timed("device: copy of the masks (waited)", masks.to, torch.device("cuda"))
            masked = logits.clone()
            timed("device: apply kernel (waited)", apply_token_bitmask, masked, bitmask, rows)
        for seq, row in zip(seqs, masks.bitmask.numpy()):
            seq.token_ids.append(int(rng.choice(allowed_tokens(row, vocab_size))))

    print(f"{args.rows} rows, vocabulary {vocab_size}, {cores} cores, fill threads up to "
          f"{manager.max_fill_threads}; median of {args.steps} steps after {args.warmup_steps}")
    print(f"  {'':40s} {'wall':>7s}    {'CPU (all threads)':>7s}")
    for name, samples in timings.items():
        wall, cpu = (1e3 * statistics.median(column) for column in zip(*samples))
        print(f"  {name:40s} {wall:7.3f} ms {cpu:7.3f} ms")

    # the interpreter lock: a Python loop counting in a second thread while the fill runs
    for n, fill in fills.items():
        counts, stop = [0], threading.Event()

        def count():
            while not stop.is_set():
                counts[0] += 1
        worker = threading.Thread(target=count)
        worker.start()
        time.sleep(0.05)
        before, start = counts[0], time.perf_counter()
        time.sleep(0.05)
        rate_alone = (counts[0] - before) / (time.perf_counter() - start)
        before, start = counts[0], time.perf_counter()
        for _ in range(5):
            fill.batch_fill_next_token_bitmask(matchers, fill_buffer)
        elapsed = time.perf_counter() - start
        rate = (counts[0] - before) / elapsed
        stop.set()
        worker.join()
        print(f"  {n} fill threads: a Python thread ran at {rate / rate_alone:.0%} of its speed alone during "
              f"the fill, which took {1e3 * elapsed / 5:.2f} ms per call beside it")


if __name__ == "__main__":
    main()
