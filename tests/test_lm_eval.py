"""lm-evaluation-harness's `local-completions` against a live `nanovllm.serve` (one server for the
module), offline, on tiny tasks defined in tests/lm_eval_task/: the loglikelihoods it computes from
echo + logprobs equal transformers' on the same weights. Also completions' echo, max_tokens 0 and
prompt_logprobs through the openai client."""
import os

# nothing may download: lm-eval reads the local jsonl through `datasets`
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

import openai  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tests.test_serve import REPO, running_server  # noqa: E402

TASKS = os.path.join(REPO, "tests", "lm_eval_task")
PROMPT = "The cat sat on the mat, and then it"


@pytest.fixture(scope="module")
def path(model_paths) -> str:
    return model_paths["gqa_tied"]


@pytest.fixture(scope="module")
def server(path):
    with running_server(path, "--served-model-name", "tiny", "--kvcache-block-size", "16", "--max-num-batched-tokens", "24", "--max-num-seqs", "4", "--max-model-len", "128") as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(path):
    """transformers on the same weights (float32): log-softmax of every position of some ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    log_softmax.model, log_softmax.tokenizer = model, tokenizer
    return log_softmax


def test_echo_with_logprobs_and_no_generation(client, reference):
    ids = reference.tokenizer.encode(PROMPT)
    choice = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=2, max_tokens=0,
                                       temperature=0).choices[0]
    assert choice.text == reference.tokenizer.decode(ids)
    assert choice.finish_reason == "length"
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0
    ref = reference(ids)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        assert len(lp.top_logprobs[i]) <= 2
        assert max(lp.top_logprobs[i].values()) == pytest.approx(ref[i - 1].max().item(), abs=1e-4)


def test_echo_precedes_the_completion(client, reference):
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0)
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0,
                                       echo=True)
    assert echoed.choices[0].text == PROMPT + greedy.choices[0].text
    num_prompt = len(reference.tokenizer.encode(PROMPT))
    assert echoed.choices[0].logprobs.token_logprobs[num_prompt:] == pytest.approx(
        greedy.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert echoed.usage.completion_tokens == greedy.usage.completion_tokens


def test_prompt_logprobs_field(client, reference):
    ids = reference.tokenizer.encode(PROMPT)
    response = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0,
                                         extra_body={"prompt_logprobs": 1})
    entries = response.choices[0].model_extra["prompt_logprobs"]
    ref = reference(ids)
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        entry = entries[i]
        assert list(entry)[0] == str(ids[i])
        best = int(ref[i - 1].argmax())
        assert entry[str(best)]["rank"] == 1
        for token_id, value in entry.items():
            assert value["logprob"] == pytest.approx(ref[i - 1, int(token_id)].item(), abs=1e-4)
            assert value["decoded_token"] == reference.tokenizer.decode([int(token_id)])


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"echo": True, "stream": True}, "echo"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_bad_echo_requests_name_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt=PROMPT, extra_body=body)
    assert error.value.body["param"] == param, error.value.body
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1).choices[0].finish_reason


def run_lm_eval(server: str, path: str, task: str) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager
    model_args = (f"model=tiny,base_url={server}/v1/completions,tokenizer_backend=huggingface,"
                  f"tokenizer={path},num_concurrent=1,max_retries=1")
    return lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=[task],
                                   task_manager=TaskManager(include_path=TASKS), log_samples=True)


def test_lm_eval_loglikelihoods_equal_transformers(server, path, reference, monkeypatch):
    monkeypatch.chdir(REPO)         # the task's data_files are relative to the repository root
    results = run_lm_eval(server, path, "nanovllm_tiny_choice")
    samples = results["samples"]["nanovllm_tiny_choice"]
    assert len(samples) == 3
    tokenizer = reference.tokenizer
    for sample in samples:
        assert len(sample["resps"]) == len(sample["doc"]["choices"])
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            context_ids = tokenizer.encode(context)
            ids = tokenizer.encode(context + continuation)
            assert ids[:len(context_ids)] == context_ids
            ref = reference(ids)
            expected = sum(ref[i - 1, ids[i]].item() for i in range(len(context_ids), len(ids)))
            loglikelihood, _ = resp[0]
            assert loglikelihood == pytest.approx(expected, abs=1e-3)
    assert "acc,none" in results["results"]["nanovllm_tiny_choice"]


def test_lm_eval_generate_until_equals_transformers_greedy(server, path, reference, monkeypatch):
    monkeypatch.chdir(REPO)
    results = run_lm_eval(server, path, "nanovllm_tiny_generate")
    samples = results["samples"]["nanovllm_tiny_generate"]
    assert len(samples) == 2
    assert any(sample["resps"][0][0] for sample in samples)     # something was generated
    tokenizer, model = reference.tokenizer, reference.model
    for sample in samples:
        ids = tokenizer.encode(sample["arguments"][0][0])
        with torch.no_grad():
            generated = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(generated[0, len(ids):], skip_special_tokens=True).split("\n\n")[0]
        assert sample["resps"][0][0] == text
