"""Scheduler driven directly with a real BlockManager and a fake paged model. No tensors.

The fake model writes, for every token a step computes, a key of that token's whole prefix into the
token's KV slot (block_table[pos // block_size], pos % block_size), checks every slot it attends to
holds the key of the right prefix, and samples a token that is a pure function of the sequence so far.
So wrong block sharing, a lost block or a bad recompute after preemption fails loudly, and every
request's output must equal a plain loop over that function.
"""
import random
from collections import deque
from types import SimpleNamespace

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

EOS = 1


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                   max_model_len=256, eos_token_ids=(EOS,), scheduling_policy="fcfs",
                   pipeline_parallel_size=1) -> Scheduler:
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, eos_token_ids=eos_token_ids,
                             scheduling_policy=scheduling_policy, pipeline_parallel_size=pipeline_parallel_size)
    return Scheduler(config, BlockManager(num_blocks, block_size))


def toy_next_token(token_ids: list[int]) -> int:
    """A deterministic 'model': never EOS (1) or 2."""
    return 3 + hash(tuple(token_ids)) % 97


def reference_output(prompt: list[int], num_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(toy_next_token(ids))
    return ids[len(prompt):]


def prefix_keys(token_ids: list[int]) -> list[int]:
    keys, key = [], 0
    for t in token_ids:
        key = hash((key, t))
        keys.append(key)
    return keys


def toy_model(seq: Sequence) -> int:
    return toy_next_token(seq.token_ids)


def fake_model(sched: Scheduler, batch, kv: dict, next_token=toy_model) -> list[int | None]:
    """Compute one batch on the fake paged model; a sequence samples when its last token is computed."""
    size = sched.block_manager.block_size
    sampled = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        assert end <= len(seq.block_table) * size and end <= seq.num_tokens
        keys = prefix_keys(seq.token_ids[:end])
        for pos in range(end):
            slot = (seq.block_table[pos // size], pos % size)
            if pos >= start:
                kv[slot] = keys[pos]
            else:
                assert kv.get(slot) == keys[pos], f"seq {seq.seq_id} reads a wrong K/V at position {pos}"
        sampled.append(next_token(seq) if end == seq.num_tokens else None)
    return sampled


def record(sched: Scheduler, batch, sampled: list[int | None]) -> None:
    """Record a step whose tokens are already known: advance, then fill. sampled is aligned to
    batch.seqs, None where a prompt chunk samples nothing."""
    sched.fill(sched.advance(batch), [token_id for token_id in sampled if token_id is not None])


def step(sched: Scheduler, kv: dict, next_token=toy_model):
    """One engine step: schedule, run the fake model, record it; returns the batch and its samples."""
    batch = sched.schedule()
    sampled = fake_model(sched, batch, kv, next_token)
    record(sched, batch, sampled)
    return batch, sampled


def run(sched: Scheduler, kv: dict | None = None, max_steps: int = 5000, on_step=None,
        next_token=toy_model) -> list:
    """Step until every request finished; returns the batches. Fails on an empty step (livelock)."""
    kv = {} if kv is None else kv
    batches = []
    while not sched.is_finished():
        assert len(batches) < max_steps, "scheduler did not finish"
        batch, sampled = step(sched, kv, next_token)
        assert batch.seqs, f"empty step with {len(sched.running)} running, {len(sched.waiting)} waiting"
        batches.append(batch)
        if on_step:
            on_step(len(batches), batch, sampled)
    return batches


def request(prompt: list[int], **params) -> Sequence:
    return Sequence(prompt, SamplingParams(**params))


def test_random_run_respects_step_limits_and_finishes_everything():
    """Many requests, a tight pool (forcing preemption), chunked prompts and shared prefixes: no step
    exceeds max_num_seqs / max_num_batched_tokens, admission is FIFO, every request ends with the
    reference output, and the pool is empty at the end."""
    rng = random.Random(0)
    max_num_seqs, max_tokens_per_step, max_model_len = 4, 12, 48
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_tokens_per_step, max_model_len=max_model_len)
    prefixes = [[], [rng.randrange(3, 100) for _ in range(8)], [rng.randrange(3, 100) for _ in range(13)]]
    seqs = []
    for _ in range(40):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 100) for _ in range(rng.randint(1, 20))]
        seqs.append(request(prompt, max_tokens=rng.randint(1, 25)))
    pending = list(seqs)
    for seq in pending[:10]:
        sched.add(seq)
    del pending[:10]
    admitted = []

    def on_step(i, batch, sampled):
        assert len(batch.seqs) <= max_num_seqs and batch.num_tokens <= max_tokens_per_step
        assert all(n > 0 for n in batch.num_new_tokens)
        admitted.extend(s for s in batch.seqs if s not in admitted)
        if pending and i % 3 == 0:               # more requests keep arriving
            sched.add(pending.pop(0))

    run(sched, on_step=on_step)
    assert not pending
    assert admitted == seqs
    for seq in seqs:
        expected = min(seq.sampling_params.max_tokens, max_model_len - seq.num_prompt_tokens)
        assert seq.completion_token_ids == reference_output(seq.token_ids[:seq.num_prompt_tokens], expected)
        assert seq.finish_reason == "length" and seq.status == SequenceStatus.FINISHED
    assert sched.num_preemptions > 0                              # the run exercised preemption,
    assert any(s.num_cached_tokens for s in seqs)                  # prefix hits
    assert any(s.num_prompt_tokens > max_tokens_per_step for s in seqs)   # and chunking
    assert sched.block_manager.num_used_blocks == 0


def test_long_prompt_is_prefilled_in_chunks_and_samples_after_the_last():
    """Prompts longer than the token budget of 8 go in chunks of 8 plus the rest (17 leaves a single
    token, computed by a decode step), and no token is sampled before the last chunk."""
    for prompt_len in (17, 21, 24):
        sched = make_scheduler(max_num_batched_tokens=8)
        prompt = list(range(10, 10 + prompt_len))
        seq = request(prompt, max_tokens=2)
        sched.add(seq)
        kv, chunks = {}, []
        while seq.num_completion_tokens == 0:
            batch, sampled = step(sched, kv)
            assert batch.seqs == [seq]
            chunks.append(batch.num_new_tokens[0])
            assert (sampled[0] is not None) == (sum(chunks) == prompt_len)
        assert chunks == [8, 8, prompt_len - 16]
        run(sched, kv)
        assert seq.completion_token_ids == reference_output(prompt, 2)


def test_pool_exhaustion_preempts_the_newest_running_sequence():
    """Three 3-token prompts in a 4-block pool (block size 4): at the third step the first two each need
    a second block, so the newest (c) is preempted: blocks freed, back at the front of the queue
    ahead of d, which arrived later. It later finishes with the same tokens as an unpreempted run."""
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=3, max_num_batched_tokens=16)
    a, b, c, d = (request([10 + i, 20, 30], max_tokens=6) for i in range(4))
    for seq in (a, b, c, d):
        sched.add(seq)
    kv = {}
    batch, _ = step(sched, kv)                   # prefill a, b, c; d waits (max_num_seqs)
    assert batch.is_prefill and batch.seqs == [a, b, c]
    batch, _ = step(sched, kv)                   # decode: 5 tokens each, block 0 fills up
    assert not batch.is_prefill and batch.seqs == [a, b, c]

    batch = sched.schedule()
    assert batch.seqs == [a, b] and not batch.is_prefill
    assert c.status == SequenceStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert list(sched.waiting) == [c, d] and sched.running == [a, b]
    assert sched.num_preemptions == 1
    record(sched, batch, fake_model(sched, batch, kv))

    run(sched, kv)
    for seq in (a, b, c, d):
        assert seq.completion_token_ids == reference_output(seq.token_ids[:3], 6)
    assert sched.block_manager.num_used_blocks == 0


def test_admission_is_fifo_even_when_a_later_request_would_fit():
    """Head-of-line order: with 2 tokens of budget left, a 1-token request does not jump a 7-token one."""
    sched = make_scheduler(max_num_batched_tokens=8)
    a, b, c = (request(prompt, max_tokens=3) for prompt in (list(range(3, 9)), list(range(3, 10)), [5]))
    for seq in (a, b, c):
        sched.add(seq)
    batches = run(sched)
    assert batches[0].seqs == [a]                  # c would fit in the 2 tokens left, but b is first
    assert batches[1].seqs == [b, c] and batches[1].is_prefill
    assert all(s.num_completion_tokens == 3 for s in (a, b, c))


def run_scripted(seqs: list[Sequence], script: list[list[int]], **config) -> None:
    """Run seqs to completion where seqs[i] emits script[i] token by token, then 50s."""
    sched = make_scheduler(**config)
    outputs = {seq.seq_id: out for seq, out in zip(seqs, script)}

    def next_token(seq: Sequence) -> int:
        out, k = outputs[seq.seq_id], seq.num_completion_tokens
        return out[k] if k < len(out) else 50

    for seq in seqs:
        sched.add(seq)
    run(sched, next_token=next_token)
    assert sched.block_manager.num_used_blocks == 0


def test_stop_reasons():
    """max_tokens and max_model_len -> "length"; EOS (any configured id) and stop_token_ids -> "stop",
    EOS ignored under ignore_eos; no stop token counts before min_tokens."""
    prompt = [10, 11, 12]
    cases = [  # (params, tokens the model emits, expected completion, reason)
        (dict(max_tokens=3), [], [50, 50, 50], "length"),
        (dict(max_tokens=9), [7, EOS, 7], [7, EOS], "stop"),
        (dict(max_tokens=9), [7, 2, 7], [7, 2], "stop"),                      # second EOS id
        (dict(max_tokens=4, ignore_eos=True), [EOS, EOS, 7], [EOS, EOS, 7, 50], "length"),
        (dict(max_tokens=9, stop_token_ids=[7]), [5, 7, 5], [5, 7], "stop"),
        (dict(max_tokens=9, min_tokens=3), [EOS, EOS, EOS, 7], [EOS, EOS, EOS], "stop"),
        (dict(max_tokens=9, min_tokens=2, stop_token_ids=[7]), [7, 5, 7], [7, 5, 7], "stop"),
        (dict(max_tokens=100), [], [50] * 7, "length"),                        # max_model_len=10
    ]
    seqs = [request(prompt, **params) for params, _, _, _ in cases]
    run_scripted(seqs, [case[1] for case in cases], max_model_len=10, eos_token_ids=(EOS, 2))
    for seq, (params, _, expected, reason) in zip(seqs, cases):
        assert (seq.completion_token_ids, seq.finish_reason) == (expected, reason), params


def test_second_request_with_same_prefix_reports_cached_tokens():
    """Admitted after the first request's prefill, a request sharing its first 17 tokens reuses 16
    of them (whole blocks of 4, short of its own last token); one sharing exactly 16 tokens reuses 12."""
    sched = make_scheduler(block_size=4)
    shared = list(range(30, 47))                              # 17 tokens
    first = request(shared + [5, 6], max_tokens=4)
    sched.add(first)
    kv = {}
    step(sched, kv)
    assert first.num_cached_tokens == 0
    longer, exact = request(shared + [7], max_tokens=4), request(shared[:16], max_tokens=4)
    sched.add(longer)
    sched.add(exact)
    batch, _ = step(sched, kv)
    assert batch.seqs == [longer, exact] and batch.num_new_tokens == [18 - 16, 16 - 12]
    assert (longer.num_cached_tokens, exact.num_cached_tokens) == (16, 12)
    assert longer.block_table[:4] == first.block_table[:4]
    assert exact.block_table[:3] == first.block_table[:3] and exact.block_table[3] != first.block_table[3]
    run(sched, kv)
    assert longer.completion_token_ids == reference_output(shared + [7], 4)
    assert exact.completion_token_ids == reference_output(shared[:16], 4)


def test_block_pool_is_released_when_all_requests_finish():
    """Shared prefixes, a chunked prompt and preemptions still leave no block held at the end."""
    sched = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=3, max_num_batched_tokens=8, max_model_len=40)
    for n in (1, 5, 9, 30, 4, 9):
        sched.add(request(list(range(3, 3 + n)), max_tokens=7))
    run(sched)
    assert sched.num_preemptions > 0
    assert sched.block_manager.num_used_blocks == 0
    assert all(block.ref_count == 0 for block in sched.block_manager.blocks)


def eos_sometimes(ids: list[int]) -> int:
    """A 'model' that ends a sequence about one time in twelve."""
    h = hash(tuple(ids)) % 96
    return EOS if h < 8 else 3 + h


def random_requests(sched: Scheduler, rng: random.Random) -> list[Sequence]:
    """30 requests of 1 to 29 prompt tokens, some sharing a 9-token prefix, added to sched."""
    prefixes = [[], [rng.randrange(3, 100) for _ in range(9)]]
    seqs = [request(rng.choice(prefixes) + [rng.randrange(3, 100) for _ in range(rng.randint(1, 20))],
                    max_tokens=rng.randint(1, 25)) for _ in range(30)]
    for seq in seqs:
        sched.add(seq)
    return seqs


def compute_on_fake_device(sched: Scheduler, batch, kv: dict, pending: list[int]) -> tuple[list[Sequence], list[int]]:
    """Write and check the K/V of every token a batch computes, reading a pending token from
    `pending` (the step in flight's tokens); its sampled sequences and their tokens."""
    def ids_of(seq: Sequence) -> list[int]:
        return seq.token_ids + [pending[seq.pending_row]] if seq.pending_row is not None else seq.token_ids

    size = sched.block_manager.block_size
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        end = seq.num_computed_tokens + n
        keys = prefix_keys(ids_of(seq)[:end])
        for pos in range(end):
            slot = (seq.block_table[pos // size], pos % size)
            if pos >= seq.num_computed_tokens:
                kv[slot] = keys[pos]
            else:
                assert kv.get(slot) == keys[pos], f"seq {seq.seq_id} reads a wrong K/V at {pos}"
    sampled = batch.sampled_seqs()
    # a sequence whose pending token is its last is not run again just to be thrown away
    assert all(s.num_completion_tokens < s.sampling_params.max_tokens and s.num_tokens < sched.max_model_len
               for s in sampled)
    return sampled, [eos_sometimes(ids_of(s)) for s in sampled]


def assert_plain_loop_outputs(sched: Scheduler, seqs: list[Sequence]) -> None:
    """Every request ended with eos_sometimes' output, preemptions and prefix hits happened, and the
    pool is released."""
    for seq in seqs:
        ids = seq.token_ids[:seq.num_prompt_tokens]
        limit = min(seq.sampling_params.max_tokens, sched.max_model_len - len(ids))
        expected = []
        while len(expected) < limit and EOS not in expected:
            expected.append(eos_sometimes(ids + expected))
        assert seq.completion_token_ids == expected
        assert seq.finish_reason == ("stop" if expected[-1] == EOS else "length")
    assert sched.num_preemptions > 0 and any(s.num_cached_tokens for s in seqs)
    assert sum(s.finish_reason == "stop" for s in seqs) >= 3
    assert sched.block_manager.num_used_blocks == 0


def test_overlapped_steps_match_the_plain_loop():
    """The engine's overlapped order: step N+1 is scheduled and computed, reading step N's tokens
    'on the device' through the pending rows, before N's tokens are filled in. With EOS
    stops (so a finished sequence's next step is already queued), preemption of sequences whose
    token is pending, chunking and prefix hits, every request still ends with the output of a plain
    loop, every K/V read is right, and the pool is released."""
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=12, max_model_len=48)
    seqs = random_requests(sched, random.Random(1))
    kv, in_flight, steps = {}, None, 0                # in_flight: (sampled seqs, their tokens)
    while not sched.is_finished() or in_flight:
        steps += 1
        assert steps < 5000, "did not finish"
        batch = sched.schedule()
        launched = compute_on_fake_device(sched, batch, kv, in_flight[1] if in_flight else []) if batch.seqs else None
        if in_flight:
            sched.fill(*in_flight)
        in_flight = None
        if launched:
            sched.advance(batch)
            in_flight = launched
    assert_plain_loop_outputs(sched, seqs)


def test_pipeline_batches_in_flight_match_the_plain_loop():
    """The engine's order under two pipeline stages: two batches stay in flight while the next is
    scheduled, and the oldest is collected once the next is launched or when nothing can be. The
    next may take the oldest's sequences, reading their tokens 'on the device' at the oldest's row
    offset (a slot per step in flight), never those of the newer one. Decode batches take half the
    running sequences. With EOS stops, preemption, chunking and prefix hits, every request ends
    with a plain loop's output and every K/V read is right."""
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=12, max_model_len=48,
                           pipeline_parallel_size=2)
    seqs = random_requests(sched, random.Random(2))
    device_ids = {}       # row -> sampled id, as Worker.keep_token_ids keeps them: a slot per step
    kv, in_flight, launches, shared, steps = {}, deque(), 0, 0, 0    # in_flight: (batch, sampled seqs, tokens)
    while not sched.is_finished() or in_flight:
        steps += 1
        assert steps < 5000, "did not finish"
        busy = {seq for batch, _, _ in list(in_flight)[len(in_flight) == 2:] for seq in batch.seqs}
        num_running = len(sched.running)
        batch = sched.schedule(busy)
        assert not busy & set(batch.seqs)
        assert batch.is_prefill or len(batch.seqs) <= -(-num_running // 2)
        launched = None
        if batch.seqs:
            shared += bool(in_flight and set(batch.seqs) & set(in_flight[0][0].seqs))
            offset = launches % 3 * 4
            launches += 1
            sampled, tokens = compute_on_fake_device(sched, batch, kv, device_ids)
            device_ids.update((offset + row, token) for row, token in enumerate(tokens))
            launched = (batch, sampled, tokens, offset)
        if in_flight and (launched is None or len(in_flight) == 2):
            _, sampled, tokens = in_flight.popleft()
            sched.fill(sampled, tokens)
        if launched:
            batch, sampled, tokens, offset = launched
            sched.advance(batch, offset)
            in_flight.append((batch, sampled, tokens))
    assert shared > 10
    assert_plain_loop_outputs(sched, seqs)


def prioritized(prompts_and_priorities, **params) -> list[Sequence]:
    return [Sequence(prompt, SamplingParams(**params), priority=priority) for prompt, priority in prompts_and_priorities]


def admission_order(sched: Scheduler, late: dict | None = None) -> list[Sequence]:
    """Run to the end; the sequences in the order they were first scheduled. late: {step: seq} adds
    seq after that step."""
    admitted = []

    def on_step(i, batch, sampled):
        admitted.extend(s for s in batch.seqs if s not in admitted)
        if late and i in late:
            sched.add(late[i])

    run(sched, on_step=on_step)
    return admitted


def test_priority_policy_admits_by_priority_then_arrival():
    """One request runs at a time: under "priority" they are admitted by (priority, arrival), a late
    arrival with the lowest value included (it jumps the queue, not the request running); under
    "fcfs" in arrival order whatever their priority. Outputs are the reference's either way."""
    rng = random.Random(2)
    specs = [([rng.randrange(3, 100) for _ in range(rng.randint(1, 9))], rng.choice([-1, 0, 0, 3, 7]))
             for _ in range(10)]
    late_spec = ([5, 6, 7], -5)
    for policy in ("priority", "fcfs"):
        sched = make_scheduler(max_num_seqs=1, scheduling_policy=policy)
        seqs = prioritized(specs, max_tokens=3)
        (late,) = prioritized([late_spec], max_tokens=3)
        for seq in seqs:
            sched.add(seq)
        # each request takes 3 steps: the late one arrives while the second admitted one runs
        admitted = admission_order(sched, late={4: late})
        if policy == "priority":
            expected = sorted(seqs, key=lambda s: (s.priority, seqs.index(s)))
            assert expected != seqs                              # the priorities do reorder
            assert admitted == expected[:2] + [late] + expected[2:]
        else:
            assert admitted == seqs + [late]
        for seq in seqs + [late]:
            assert seq.completion_token_ids == reference_output(seq.token_ids[:seq.num_prompt_tokens], 3)


def test_priority_preemption_takes_the_largest_priority_value():
    """As test_pool_exhaustion_preempts_the_newest_running_sequence, with priorities a=0, b=5, c=1:
    running is [a, c, b], and when the pool runs dry b (the largest value) is preempted, though c
    was admitted after it under fcfs order. Among equal values the latest arrival goes first."""
    for priorities, victim in (((0, 5, 1), 1), ((0, 1, 1), 2), ((2, 2, 2), 2)):
        sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=3, max_num_batched_tokens=16,
                               scheduling_policy="priority")
        seqs = prioritized([([10 + i, 20, 30], p) for i, p in enumerate(priorities)], max_tokens=6)
        for seq in seqs:
            sched.add(seq)
        kv = {}
        order = sorted(seqs, key=lambda s: (s.priority, seqs.index(s)))
        batch, _ = step(sched, kv)
        assert batch.seqs == order
        step(sched, kv)                              # decode: the first block of each fills up
        batch = sched.schedule()
        preempted = seqs[victim]
        assert batch.seqs == [s for s in order if s is not preempted]
        assert preempted.status == SequenceStatus.WAITING and preempted.block_table == []
        assert sched.num_preemptions == 1 and list(sched.waiting) == [preempted]
        record(sched, batch, fake_model(sched, batch, kv))
        run(sched, kv)
        for seq in seqs:
            assert seq.completion_token_ids == reference_output(seq.token_ids[:3], 6)
        assert sched.block_manager.num_used_blocks == 0
