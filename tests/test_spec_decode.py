"""Speculative decoding keeps the engine's outputs: greedy runs give the same tokens, text, finish
reasons and logprobs as the engine without it (under chunked prefill, preemption, prefix hits, n=2
and every kind of stop), and sampled runs draw from the target's distribution: the rejection sampler
on fixed logits against hand-computed filtered distributions (with a sampler that accepts every
proposal as the negative control), and end to end against the plain engine. Seeds are fixed, so
every statistical check is deterministic on a given device."""
import json
import math
import os
import shutil

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.sample.sampler import Sampler, SamplingTensors
from nanovllm.spec_decode.ngram_proposer import NgramProposer
from nanovllm.sample.rejection_sampler import VerifyTensors, rejection_sample
from tests.conftest import mixed_prompts
from tests.test_sampler import LOGITS_8, distinct_seeds, reference_probs

ENGINE = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256, max_num_seqs=32)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
EOS_PROMPT = [100, 200] * 4          # greedy output repeats a token for a while, then a new one: the EOS
LOOP_PROMPT = [20] * 5               # greedy output settles into one repeated token


# ---- configuration and the proposer -------------------------------------------------------------

@pytest.mark.parametrize("config, words", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "unknown method"),
    ({"num_speculative_tokens": 2}, "unknown method"),
    ({**NGRAM, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({**NGRAM, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({**NGRAM, "lookahead": 2}, "unknown key"),
    ({**NGRAM, "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_config(model_paths, config, words):
    with pytest.raises(ValueError, match="speculative_config") as error:
        Config.from_engine_args(model_paths["gqa_tied"], speculative_config=config)
    assert words in str(error.value)


def test_good_speculative_config(model_paths):
    spec = Config.from_engine_args(model_paths["gqa_tied"], speculative_config=NGRAM).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
            spec.model) == ("ngram", 3, 1, 4, None)


def test_ngram_proposer_takes_the_longest_suffix_and_its_latest_match():
    proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    # suffix [1, 2, 3] occurs at 0 (followed by 9) and at 5 (followed by 7 8): the latest wins
    assert proposer.propose_tokens([1, 2, 3, 9, 4, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]
    # no 3-gram match; the 2-gram [5, 6] matched at 0 beats the later 1-gram [6] at 6
    assert proposer.propose_tokens([5, 6, 1, 2, 4, 4, 6, 3, 5, 6], 3) == [1, 2, 4]
    assert proposer.propose_tokens([1, 2, 3, 4], 2) == []                          # nothing repeats
    assert proposer.propose_tokens([4, 1, 2, 4], 5) == [1, 2, 4, 1, 2]             # fewer follow: the period goes on
    assert NgramProposer(2, 3).propose_tokens([4, 1, 2, 4], 2) == []               # below prompt_lookup_min
    assert proposer.propose_tokens([7, 7], 3) == [7, 7, 7]


# ---- the scheduler's reservation and release of slots, without a model ---------------------------

class FixedProposer:
    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def propose(self, seqs, ks: list[int]) -> list[list[int]]:
        return [self.tokens[:k] for k in ks]


def test_scheduler_reserves_slots_for_proposals_and_returns_the_unused():
    from types import SimpleNamespace

    from nanovllm.core.block_manager import BlockManager
    from nanovllm.core.scheduler import Scheduler
    from nanovllm.core.sequence import Sequence
    config = SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, eos_token_ids=(1,),
                             scheduling_policy="fcfs", pipeline_parallel_size=1)
    sched = Scheduler(config, BlockManager(8, 4), num_speculative_tokens=5)
    proposer = FixedProposer([7, 8, 9, 10, 11])

    def schedule_with_drafts():      # as the engine core does: the proposer fills what the scheduler allows
        batch = sched.schedule()
        if not batch.is_prefill and sched.speculates():
            sched.add_drafts(batch, proposer.propose(batch.seqs, sched.draft_lengths(batch)))
        return batch

    seq = Sequence([3, 4, 5], SamplingParams(temperature=0, max_tokens=20))
    sched.add(seq)
    prefill = sched.schedule()
    sched.advance(prefill)
    sched.fill(prefill.seqs, [6])                       # 4 tokens, 3 computed: one block
    batch = schedule_with_drafts()
    assert batch.draft_token_ids == [[7, 8, 9, 10, 11]] and batch.num_new_tokens == [6]
    assert len(seq.block_table) == 3                    # positions up to 8 (3 + 1 + 5 - 1) reserved
    sched.advance(batch)
    assert seq.num_computed_tokens == 4                 # the proposals count only once accepted
    grown = sched.fill_verified([seq], [[7, 8, 5]], [[None] * 3], [2], [5], lambda s: None)
    assert grown == [seq] and seq.token_ids == [3, 4, 5, 6, 7, 8, 5]
    assert seq.num_computed_tokens == 6 and len(seq.block_table) == 2    # the third block went back
    assert sched.block_manager.num_used_blocks == 2
    assert (sched.num_drafts, sched.num_draft_tokens, sched.num_accepted_tokens) == (1, 5, 2)
    # 4 tokens made of max_tokens 7: 2 proposals (and the token after them) at most; a stop id among
    # a step's tokens ends the sequence there
    seq.sampling_params.max_tokens, seq.sampling_params.stop_token_ids = 7, [8]
    batch = schedule_with_drafts()
    assert batch.draft_token_ids == [[7, 8]]
    sched.advance(batch)
    sched.fill_verified([seq], [[7, 8, 9]], [[None] * 3], [2], [2], lambda s: None)
    assert seq.token_ids[-2:] == [7, 8] and seq.finish_reason == "stop"
    assert sched.block_manager.num_used_blocks == 0


# ---- the rejection sampler on fixed logits -------------------------------------------------------

def chi_square_pvalue(observed: list[list[float]], expected: list[list[float]], df: int) -> float:
    """P(chi-square with df degrees of freedom >= the statistic): the regularised upper gamma."""
    o, e = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    statistic = ((o - e) ** 2 / e).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic / 2))


def goodness_of_fit(counts: list[float], probs: list[float]) -> float:
    """p-value of counts drawn from probs (all positive)."""
    total = sum(counts)
    return chi_square_pvalue([counts], [[p * total for p in probs]], len(counts) - 1)


def homogeneity(a: list[int], b: list[int]) -> float:
    """p-value of two samples of tokens drawn from one distribution (a contingency table)."""
    support = sorted(set(a) | set(b))
    table = [[sample.count(t) for t in support] for sample in (a, b)]
    columns, total = [x + y for x, y in zip(*table)], len(a) + len(b)
    expected = [[len(sample) * column / total for column in columns] for sample in (a, b)]
    return chi_square_pvalue(table, expected, len(support) - 1)


def verify_rows_of(num_seqs: int, drafts: list[int]) -> VerifyTensors:
    """num_seqs sequences, each proposing `drafts`, rows laid out as in a verify step."""
    k = len(drafts)
    return VerifyTensors(torch.tensor(drafts + [-1]).repeat(num_seqs), torch.arange(num_seqs).repeat_interleave(k + 1),
                         torch.arange(k + 1).repeat(num_seqs), num_seqs)


def row_sampling(rows: int, temperature: float, salt: int = 0, **filters) -> SamplingTensors:
    sampling = SamplingTensors(torch.full((rows,), temperature), distinct_seeds(rows, salt), temperature == 0)
    if "top_k" in filters:
        sampling.top_k = torch.full((rows,), filters["top_k"], dtype=torch.int64)
    if "top_p" in filters:
        sampling.top_p = torch.full((rows,), filters["top_p"])
    if "min_p" in filters:
        sampling.min_p = torch.full((rows,), filters["min_p"])
    return sampling


def accept_every_proposal(logits, sampling, verify):
    """The negative control: a sampler that keeps every proposal and samples the bonus token."""
    out = Sampler()(logits, sampling)
    has_draft = verify.draft_token_ids >= 0
    out.token_ids = torch.where(has_draft, verify.draft_token_ids, out.token_ids)
    return out, torch.bincount(verify.seq_of_row, weights=has_draft.float()).long()


def total_variation(a: torch.Tensor, b: torch.Tensor, vocab: int) -> float:
    fa, fb = (torch.bincount(t, minlength=vocab).double() / len(t) for t in (a, b))
    return 0.5 * float((fa - fb).abs().sum())


def follows(tokens: torch.Tensor, expected: list[float], plain: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """tokens are drawn from `expected`: never a token of probability 0, a chi-square test against
    the expected counts, and a total variation from a plain sample within twice that between two
    plain samples (plus a little slack for the sample size)."""
    vocab = len(expected)
    counts = torch.bincount(tokens, minlength=vocab).double()
    if any(count > 0 and p == 0 for count, p in zip(counts.tolist(), expected)):
        return False
    support = [i for i, p in enumerate(expected) if p > 0]
    if len(support) > 1:
        if goodness_of_fit(counts[support].tolist(), [expected[i] for i in support]) < 1e-3:
            return False
    noise = total_variation(*plain, vocab)
    return total_variation(tokens, plain[0], vocab) <= 2 * noise + 2 / math.sqrt(len(tokens))


FILTERS = [dict(temperature=1.0), dict(temperature=0.8, top_k=5, top_p=0.85), dict(temperature=1.3, min_p=0.15)]


@pytest.mark.parametrize("settings", FILTERS, ids=["plain", "top_k_top_p", "min_p"])
@pytest.mark.parametrize("drafts", [[0, 5], [4, 2]], ids=["likely_drafts", "unlikely_first_draft"])
def test_rejection_sampler_emits_the_target_distribution(settings, drafts):
    """Every emitted position (the first token; the second, where the first proposal was kept) is
    distributed as the filtered target; a proposal is kept with probability p(proposal); the sampler
    that accepts everything fails the same check."""
    num_seqs = 4000
    filters = {k: v for k, v in settings.items() if k != "temperature"}
    expected = reference_probs(LOGITS_8, settings["temperature"], **filters)
    rows = num_seqs * (len(drafts) + 1)
    logits = torch.tensor([LOGITS_8]).repeat(rows, 1)
    verify = verify_rows_of(num_seqs, drafts)
    plain = tuple(Sampler()(logits[:num_seqs], row_sampling(num_seqs, settings["temperature"], salt, **filters))
                  .token_ids for salt in (1, 2))
    for sampler, honest in ((rejection_sample, True), (accept_every_proposal, False)):
        out, num_accepted = sampler(logits, row_sampling(rows, settings["temperature"], **filters), verify)
        by_seq = out.token_ids.view(num_seqs, -1)
        first, second = by_seq[:, 0], by_seq[num_accepted >= 1, 1]
        if not honest:
            assert not follows(first, expected, plain)
            continue
        assert follows(first, expected, plain)
        # (a first proposal of probability 0 is never kept, so no second token to check)
        assert follows(second, expected, plain) if expected[drafts[0]] else not len(second)
        kept = (num_accepted >= 1).double().mean().item()
        assert abs(kept - expected[drafts[0]]) < 4.5 * math.sqrt(max(kept * (1 - kept), 1e-4) / num_seqs)
        # what follows the kept proposals is their row's own token (a rejection's or the bonus)
        assert ((num_accepted >= 0) & (num_accepted <= len(drafts))).all()


def test_greedy_rows_accept_while_the_argmax_matches():
    logits = torch.tensor([LOGITS_8] * 4 + [[0.0] * 7 + [5.0]] * 4)      # argmax 2, then argmax 7
    verify = VerifyTensors(torch.tensor([2, 2, 1, -1, 7, 3, 7, -1]), torch.tensor([0] * 4 + [1] * 4),
                           torch.tensor([0, 1, 2, 3] * 2), 2)
    sampling = SamplingTensors(torch.zeros(8), torch.zeros(8, dtype=torch.int64), all_greedy=True)
    out, num_accepted = rejection_sample(logits, sampling, verify)
    assert num_accepted.tolist() == [2, 1]
    assert out.token_ids[:3].tolist() == [2, 2, 2] and out.token_ids[4:6].tolist() == [7, 7]
    # beside sampled rows: the second sequence at temperature 1 on a point mass at 7 keeps its
    # first proposal, rejects 3 (probability e^-50) and emits 7 in its place
    logits[4:] = torch.tensor([0.0] * 7 + [50.0])
    sampling = SamplingTensors(torch.tensor([0.0] * 4 + [1.0] * 4), distinct_seeds(8))
    out, num_accepted = rejection_sample(logits, sampling, verify)
    assert num_accepted.tolist() == [2, 1]
    assert out.token_ids[:3].tolist() == [2, 2, 2] and out.token_ids[4:6].tolist() == [7, 7]


# ---- engines -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def eos_model(model_paths, tmp_path_factory):
    """A copy of a tiny model whose EOS is the first new token of EOS_PROMPT's greedy output after
    a stretch that speculation guesses; returns (path, that output, the EOS step)."""
    path = str(tmp_path_factory.mktemp("spec_model"))
    shutil.copytree(model_paths["gqa_tied"], path, dirs_exist_ok=True)
    probe = LLM(path, **ENGINE)
    tokens = probe.generate([EOS_PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                            use_tqdm=False)[0]["token_ids"]
    step = next(i for i in range(8, 40) if tokens[i] not in tokens[:i])
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, tokens[step]]}, f)
    return path, tokens, step


@pytest.fixture(scope="module")
def base(eos_model):
    return LLM(eos_model[0], **ENGINE)


@pytest.fixture(scope="module")
def spec(eos_model):
    return LLM(eos_model[0], **ENGINE, speculative_config=NGRAM)


def assert_same_outputs(expected: list[dict], got: list[dict]) -> None:
    for want, have in zip(expected, got, strict=True):
        assert len(want["outputs"]) == len(have["outputs"])
        for a, b in zip(want["outputs"], have["outputs"]):
            assert (b["token_ids"], b["text"], b["finish_reason"]) == (a["token_ids"], a["text"], a["finish_reason"])
            if a["logprobs"] is not None:
                assert len(a["logprobs"]) == len(b["logprobs"])
                for la, lb in zip(a["logprobs"], b["logprobs"]):
                    assert la.keys() == lb.keys()
                    assert all(abs(la[t] - lb[t]) < 1e-4 for t in la)


def spec_counts(llm: LLM) -> tuple[int, int, int]:
    stats = llm.stats()
    return (stats["spec_decode_num_drafts"], stats["spec_decode_num_draft_tokens"],
            stats["spec_decode_num_accepted_tokens"])


def assert_no_blocks_held(llm: LLM) -> None:
    assert llm.engine.is_finished() and llm.engine.core.scheduler.block_manager.num_used_blocks == 0
    assert all(b.ref_count == 0 for b in llm.engine.core.scheduler.block_manager.blocks)


def test_greedy_outputs_and_logprobs_equal_the_plain_engine(base, spec):
    prompts = mixed_prompts(500, lengths=(12, 3, 40, 7), seed=3) + [EOS_PROMPT, LOOP_PROMPT]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    before = spec_counts(spec)
    expected = base.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(expected, spec.generate(prompts, params, use_tqdm=False))
    drafts, draft_tokens, accepted = (a - b for a, b in zip(spec_counts(spec), before))
    assert drafts > 10 and 0 < accepted < draft_tokens     # proposals were made, some kept, some not
    assert_no_blocks_held(spec)


def test_every_stop_kind_is_exact(base, spec, eos_model):
    """EOS, stop ids, stop strings, max_tokens below k, min_tokens: where several tokens arrive in
    one step, nothing after the stop is emitted."""
    _, tokens, step = eos_model
    text = base.tokenizer.decode(tokens, skip_special_tokens=True)
    stop_string = next(text[i:i + 2] for i in range(len(text) // 3, len(text)) if text[i:i + 2].strip()
                       and text.find(text[i:i + 2]) == i)
    greedy = dict(temperature=0, max_tokens=40)
    cases = [SamplingParams(**greedy),                                               # EOS at `step`
             SamplingParams(**greedy, ignore_eos=True),
             SamplingParams(**greedy, ignore_eos=True, stop_token_ids=[tokens[step - 3]]),
             SamplingParams(**greedy, ignore_eos=True, stop=[stop_string]),
             SamplingParams(**greedy, min_tokens=step + 3),                         # EOS banned until then
             SamplingParams(**{**greedy, "max_tokens": 1}),
             SamplingParams(**{**greedy, "max_tokens": 2}),
             SamplingParams(**{**greedy, "max_tokens": 11}, ignore_eos=True)]
    prompts = [EOS_PROMPT] * len(cases) + [LOOP_PROMPT] * 3
    cases += [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 3, 5)]
    expected = base.generate(prompts, cases, use_tqdm=False)
    assert expected[0]["token_ids"] == tokens[:step + 1] and expected[0]["finish_reason"] == "stop"
    assert expected[3]["finish_reason"] == "stop" and stop_string not in expected[3]["text"]
    assert len(expected[4]["token_ids"]) > step + 1
    assert [len(o["token_ids"]) for o in expected[5:8]] == [1, 2, 11]
    assert_same_outputs(expected, spec.generate(prompts, cases, use_tqdm=False))
    assert_no_blocks_held(spec)


def test_a_repetitive_output_is_mostly_accepted(spec):
    before = spec_counts(spec)
    spec.generate([LOOP_PROMPT], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)
    drafts, draft_tokens, accepted = (a - b for a, b in zip(spec_counts(spec), before))
    assert accepted / draft_tokens > 0.8
    # three proposals per step, nearly all kept: about 4 tokens per step
    assert drafts < 60 / 3


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_chunked_prefill_and_preemption_keep_outputs(base, eos_model, proposer):
    """A pool of 16 blocks of 16 tokens for six prompts of 39-69 tokens growing by 24: chunks of
    32 tokens (a draft model catches up in chunks too), and preemptions with proposals' blocks
    reserved."""
    config = NGRAM if proposer == "ngram" else {"model": eos_model[0], "num_speculative_tokens": 3}
    tight = LLM(eos_model[0], kvcache_block_size=16, num_kvcache_blocks=16, max_model_len=256,
                max_num_seqs=8, max_num_batched_tokens=32, speculative_config=config)
    prompts = [p * 3 for p in mixed_prompts(500, lengths=(15, 20, 23, 14, 18, 13), seed=9)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    assert_same_outputs(base.generate(prompts, params, use_tqdm=False), tight.generate(prompts, params, use_tqdm=False))
    assert tight.engine.core.scheduler.num_preemptions > 0 and spec_counts(tight)[2] > 0
    assert_no_blocks_held(tight)
    tight.shutdown()


def test_prefix_hits_and_n_greater_than_one(base, spec):
    prompt = mixed_prompts(500, lengths=(20,), seed=4)[0] * 2
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = base.generate([prompt], params, use_tqdm=False)
    first = spec.generate([prompt], params, use_tqdm=False)
    again = spec.generate([prompt], params, use_tqdm=False)
    assert again[0]["num_cached_tokens"] >= 32
    assert_same_outputs(expected, first)
    assert_same_outputs(expected, again)
    pair = spec.generate([prompt], SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True),
                         use_tqdm=False)[0]
    assert [o["token_ids"] for o in pair["outputs"]] == [expected[0]["token_ids"]] * 2
    assert_no_blocks_held(spec)


def test_streaming_delivers_several_tokens_a_step(base, spec):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=0)
    request_id = spec.engine.add_request(LOOP_PROMPT, params)
    pieces, text, logprobs, output = [], "", [], None
    while output is None:
        for update in spec.engine.step_updates():
            assert update.request_id == request_id
            pieces.append(update.new_token_ids)
            text += update.delta_text
            logprobs += update.new_logprobs
            output = update.output
    assert max(map(len, pieces)) > 1
    assert sum(pieces, []) == output["token_ids"] and text == output["text"] and logprobs == output["logprobs"]
    assert_same_outputs(base.generate([LOOP_PROMPT], params, use_tqdm=False), [output])


def test_seeded_sampling_is_reproducible(spec):
    params = [SamplingParams(temperature=1.0, top_k=20, seed=s, max_tokens=24, ignore_eos=True, n=2) for s in (5, 5, 6)]
    outputs = spec.generate([LOOP_PROMPT] * 3, params, use_tqdm=False)
    ids = [[o["token_ids"] for o in out["outputs"]] for out in outputs]
    assert ids[0] == ids[1] and ids[0] != ids[2] and ids[0][0] != ids[0][1]


def test_abort_and_interrupt_leave_no_block(base, spec):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = [spec.engine.add_request(p, params) for p in (LOOP_PROMPT, EOS_PROMPT)]
    for _ in range(4):
        spec.engine.step()
    assert spec.engine.core.scheduler.block_manager.num_used_blocks > 0
    for request_id in ids:
        assert spec.engine.abort(request_id)
    assert_no_blocks_held(spec)
    # Ctrl-C while the host waits for a verify step: the call's requests are gone, the engine works
    collect = spec.engine.core.executor.collect_verified
    calls = [0]

    def interrupted(step):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return collect(step)
    spec.engine.core.executor.collect_verified = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            spec.generate([LOOP_PROMPT, EOS_PROMPT], params, use_tqdm=False)
    finally:
        spec.engine.core.executor.collect_verified = collect
    assert calls[0] == 2
    assert_no_blocks_held(spec)
    assert_same_outputs(base.generate([LOOP_PROMPT], params, use_tqdm=False),
                        spec.generate([LOOP_PROMPT], params, use_tqdm=False))


class GreedyProposer:
    """Proposes the greedy continuation of a transformers copy of the target (a perfect greedy
    draft): under sampling, some proposals are kept and some not."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def propose(self, seqs, ks: list[int]) -> list[list[int]]:
        proposals = []
        for seq, k in zip(seqs, ks):
            ids = list(seq.token_ids)
            for _ in range(k):
                ids.append(int(self.model(torch.tensor([ids])).logits[0, -1].argmax()))
            proposals.append(ids[len(seq.token_ids):])
        return proposals


def test_sampled_outputs_follow_the_plain_engines_distribution(base, spec, eos_model, monkeypatch):
    """Seeded requests at temperature 1 with top_k and top_p, verifying a perfect greedy draft's
    proposals (some kept, some not): each emits exactly the plain engine's tokens for its seed (the
    verify step draws each position with the plain sampler's noise), and the tokens at each
    position are distributed as the plain engine's under other seeds (a chi-square test of two
    independent samples)."""
    from transformers import AutoModelForCausalLM
    num_requests, num_tokens = 192, 3
    # every request verifies proposals, however many run at once (the engine steps aside above a few)
    monkeypatch.setattr("nanovllm.core.scheduler.SPECULATION_MAX_RUNNING", num_requests)
    params = [SamplingParams(temperature=1.0, top_k=4, top_p=0.95, seed=s, max_tokens=num_tokens, ignore_eos=True)
              for s in range(2 * num_requests)]
    plain = [o["token_ids"] for o in base.generate([LOOP_PROMPT] * 2 * num_requests, params, use_tqdm=False)]
    proposer = spec.engine.core.proposer
    spec.engine.core.proposer = GreedyProposer(AutoModelForCausalLM.from_pretrained(eos_model[0]).eval())
    try:
        before = spec_counts(spec)
        speculated = [o["token_ids"] for o in spec.generate([LOOP_PROMPT] * num_requests, params[:num_requests],
                                                            use_tqdm=False)]
        drafts, draft_tokens, accepted = (a - b for a, b in zip(spec_counts(spec), before))
    finally:
        spec.engine.core.proposer = proposer
    assert drafts >= num_requests and 0.1 * draft_tokens < accepted < 0.9 * draft_tokens
    assert speculated == plain[:num_requests]
    for position in range(num_tokens):
        a = [tokens[position] for tokens in plain[num_requests:]]
        b = [tokens[position] for tokens in speculated]
        assert homogeneity(a, b) > 1e-3, (position, a, b)


def test_seeded_outputs_equal_the_plain_engines(base, spec):
    """n-gram proposals on a repetitive output at temperature 0.8 with top_p, n=2, logprobs: every
    seeded completion, its logprobs and finish reason are the plain engine's."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, n=2, max_tokens=24, ignore_eos=True, logprobs=2)
              for s in range(4)]
    before = spec_counts(spec)
    got = spec.generate([LOOP_PROMPT] * 4, params, use_tqdm=False)
    assert spec_counts(spec)[2] > before[2]
    assert_same_outputs(base.generate([LOOP_PROMPT] * 4, params, use_tqdm=False), got)


# ---- serving -------------------------------------------------------------------------------------

def test_async_llm_streams_speculated_tokens(base, eos_model):
    """AsyncLLM with speculative_config (engine on a thread of this process): the stream's deltas
    add up to the plain engine's output, some deltas hold several tokens, and stats count drafts."""
    import asyncio

    from nanovllm import AsyncLLM
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm = AsyncLLM(eos_model[0], engine_process=False, **ENGINE, speculative_config=NGRAM)
    try:
        async def stream():
            return [out async for out in llm.generate(LOOP_PROMPT, params)]
        outs = asyncio.run(asyncio.wait_for(stream(), timeout=120))
        stats = llm.stats()
    finally:
        llm.shutdown()
    expected = base.generate([LOOP_PROMPT], params, use_tqdm=False)[0]
    assert [t for o in outs for t in o["delta_token_ids"]] == expected["token_ids"]
    assert "".join(o["delta_text"] for o in outs) == expected["text"]
    assert max(len(o["delta_token_ids"]) for o in outs) > 1
    assert stats["spec_decode_num_accepted_tokens"] > 0


def test_metrics_and_serve_flag(spec):
    from prometheus_client import generate_latest

    from nanovllm.serve.cli import parse_args
    from nanovllm.serve.metrics import ServerMetrics
    spec.generate([LOOP_PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    stats = spec.stats()
    text = generate_latest(ServerMetrics(spec.stats, "tiny").registry).decode()
    for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
        assert stats[name] > 0
        assert f'nanovllm:{name}_total{{model_name="tiny"}} {float(stats[name])}' in text
    _, engine_args = parse_args(["model", "--speculative-config", json.dumps(NGRAM)])
    assert engine_args["speculative_config"] == NGRAM
    with pytest.raises(SystemExit):
        parse_args(["model", "--speculative-config", "{ngram"])


# ---- a draft model -------------------------------------------------------------------------------

def edited_copy(source: str, destination: str, **changes) -> str:
    shutil.copytree(source, destination, dirs_exist_ok=True)
    with open(os.path.join(destination, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    with open(os.path.join(destination, "config.json"), "w") as f:
        json.dump(config, f)
    return destination


def test_bad_draft_models(model_paths, tmp_path):
    target = model_paths["gqa_tied"]
    for draft, words in ((edited_copy(target, str(tmp_path / "vocab"), vocab_size=600), "vocabulary"),
                         (edited_copy(target, str(tmp_path / "family"), architectures=["GPT2LMHeadModel"]), "GPT2"),
                         (str(tmp_path / "missing"), "not a local directory")):
        with pytest.raises(ValueError, match="speculative_config") as error:
            Config.from_engine_args(target, speculative_config={"model": draft, "num_speculative_tokens": 2})
        assert words in str(error.value)
    with pytest.raises(ValueError, match="speculative_config: unknown key"):
        Config.from_engine_args(target, speculative_config={"model": target, "num_speculative_tokens": 2,
                                                            "prompt_lookup_max": 3})


def test_draft_model_keeps_greedy_outputs(base, eos_model, model_paths):
    """A draft of another shape (same vocabulary) changes nothing; the target itself as its own
    draft has every proposal accepted."""
    prompts = mixed_prompts(500, lengths=(12, 40, 3), seed=8) + [EOS_PROMPT]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    expected = base.generate(prompts, params, use_tqdm=False)
    for draft, least_accepted in ((model_paths["mha_untied"], 0.0), (eos_model[0], 0.99)):
        llm = LLM(eos_model[0], **ENGINE, speculative_config={"model": draft, "num_speculative_tokens": 3})
        assert_same_outputs(expected, llm.generate(prompts, params, use_tqdm=False))
        drafts, draft_tokens, accepted = spec_counts(llm)
        assert drafts >= len(prompts) and accepted >= least_accepted * draft_tokens
        assert_no_blocks_held(llm)
        assert_no_draft_shadows(llm)         # freed as their sequences finished, not at the next draft
        llm.shutdown()


def assert_no_draft_shadows(llm: LLM) -> None:
    proposer = llm.engine.core.proposer
    assert not proposer.shadows and proposer.block_manager.num_used_blocks == 0


def test_an_aborted_sequence_frees_its_draft_shadow_at_once(eos_model, model_paths):
    llm = LLM(eos_model[0], **ENGINE, speculative_config={"model": model_paths["mha_untied"],
                                                         "num_speculative_tokens": 3})
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kept, aborted = (engine.add_request(prompt, params) for prompt in mixed_prompts(500, lengths=(12, 30), seed=3))
    while len(engine.core.proposer.shadows) < 2:        # both sequences have drafted
        engine.step()
    held = engine.core.proposer.block_manager.num_used_blocks
    engine.abort(aborted)
    assert len(engine.core.proposer.shadows) == 1 and engine.core.proposer.block_manager.num_used_blocks < held
    outputs = []
    while not engine.is_finished():
        outputs += engine.step()
    assert [o["request_id"] for o in outputs] == [kept]
    assert_no_draft_shadows(llm)
    assert_no_blocks_held(llm)
    llm.shutdown()


def test_beam_search_runs_without_speculation(base, spec):
    from nanovllm import BeamSearchParams
    params = BeamSearchParams(beam_width=2, max_tokens=8)
    before = spec_counts(spec)
    got = spec.beam_search([LOOP_PROMPT, EOS_PROMPT], params)
    assert spec_counts(spec) == before
    assert [[b["token_ids"] for b in o["sequences"]] for o in got] == \
        [[b["token_ids"] for b in o["sequences"]] for o in base.beam_search([LOOP_PROMPT, EOS_PROMPT], params)]
    assert_no_blocks_held(spec)


def test_tensor_parallel_speculation_keeps_greedy_outputs(base, eos_model):
    """Two ranks on gloo verify the proposals as one: greedy outputs, and seeded ones (their first
    token sampled on the ranks' vocabulary shards, the rest verified on rank 0), equal the plain engine's."""
    prompts = mixed_prompts(500, lengths=(12, 30), seed=3) + [LOOP_PROMPT]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.8, seed=s, n=2, max_tokens=24, ignore_eos=True) for s in range(2)]
    with LLM(eos_model[0], **ENGINE, speculative_config=NGRAM, tensor_parallel_size=2) as tp:
        assert_same_outputs(base.generate(prompts, params, use_tqdm=False), tp.generate(prompts, params, use_tqdm=False))
        assert spec_counts(tp)[2] > 0
        accepted = spec_counts(tp)[2]
        assert_same_outputs(base.generate([LOOP_PROMPT] * 2, seeded, use_tqdm=False),
                            tp.generate([LOOP_PROMPT] * 2, seeded, use_tqdm=False))
        assert spec_counts(tp)[2] > accepted
        assert_no_blocks_held(tp)
