"""Embeddings (runner="pooling"): LLM.embed and /v1/embeddings equal transformers' AutoModel last
hidden state at the last token, L2-normalised, on a tiny random Qwen3 checkpoint in float32 stored
as Qwen3-Embedding's is (a bare decoder: no LM head, no "model." prefix); with chunked prefill and
prefix-cache hits; through the real openai client and LangChain against one live server."""
import glob
import os

import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoTokenizer

from nanovllm import LLM, SamplingParams
from nanovllm.checkpoints.random_checkpoint import write_tiny_model
from tests.conftest import mixed_prompts
from tests.test_serve import engine_flags, running_server

MODEL_NAME = "tiny-embed"
# small token budget: the long prompts are prefilled in chunks; 16-token blocks: prefix hits
ENGINE_ARGS = dict(device="cpu", max_model_len=256, kvcache_block_size=16, num_kvcache_blocks=64,
                   max_num_seqs=8, max_num_batched_tokens=48)
TEXTS = ["What is the capital of France?", "Paris", "The quick brown fox jumps over the lazy dog, twice. " * 3]


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    """An untied tiny Qwen3, rewritten as a bare decoder checkpoint (no lm_head, no "model." prefix)."""
    path = str(tmp_path_factory.mktemp("embed"))
    write_tiny_model(path, seed=3, tie_word_embeddings=False, max_shard_bytes=1 << 40)
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        tensors = load_file(file)
        assert "lm_head.weight" in tensors
        save_file({name.removeprefix("model."): t for name, t in tensors.items() if not name.startswith("lm_head.")},
                  file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def reference(path):
    """transformers' embedding of token ids: AutoModel's last hidden state at the last token, normalised."""
    model = AutoModel.from_pretrained(path, torch_dtype=torch.float32).eval()

    def embed(token_ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            hidden = model(torch.tensor([token_ids])).last_hidden_state[0, -1]
        return F.normalize(hidden, dim=-1).numpy()
    return embed


@pytest.fixture(scope="module")
def llm(path):
    with LLM(path, runner="pooling", **ENGINE_ARGS) as llm:
        yield llm


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_embed_equals_transformers(llm, reference):
    vocab_size = llm.config.model_config.vocab_size
    prompts = mixed_prompts(vocab_size, lengths=(1, 3, 17, 100, 7, 33, 64, 16))   # 100: chunked over 3 steps
    for run in range(2):      # the second run finds every full block of each prompt in the prefix cache
        outputs = llm.embed(prompts)
        assert len(outputs) == len(prompts)
        for prompt, out in zip(prompts, outputs):
            assert len(out["embedding"]) == llm.config.model_config.hidden_size
            assert abs(np.linalg.norm(out["embedding"]) - 1) < 1e-5
            assert cosine(out["embedding"], reference(prompt)) > 0.9999, (run, len(prompt))
            assert out["prompt_token_ids"] == prompt
        if run == 1:      # 64 and 16 tokens: cached whole, the last token still recomputed
            assert [out["num_cached_tokens"] for out in outputs] == [0, 0, 16, 96, 0, 32, 48, 0]


def test_embed_strings_and_dimensions(llm, reference):
    tokenizer = AutoTokenizer.from_pretrained(llm.config.model)
    full = llm.embed(TEXTS)
    short = llm.embed(TEXTS, dimensions=8)
    for text, out, cut in zip(TEXTS, full, short):
        expected = reference(tokenizer.encode(text))
        assert cosine(out["embedding"], expected) > 0.9999
        assert len(cut["embedding"]) == 8
        assert abs(np.linalg.norm(cut["embedding"]) - 1) < 1e-5
        assert cosine(cut["embedding"], expected[:8]) > 0.9999    # Matryoshka: truncate, renormalise


def test_bad_cases(llm, path):
    hidden_size = llm.config.model_config.hidden_size
    for dimensions in (0, hidden_size + 1, -3, 2.5):
        with pytest.raises(ValueError, match="dimensions"):
            llm.embed(["hi"], dimensions=dimensions)
    with pytest.raises(ValueError, match="runner='generate'"):
        llm.generate(["hi"], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="runner"):
        llm.engine.add_request("hi", SamplingParams())
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.embed([[]])
    assert llm.engine.is_finished()
    assert cosine(llm.embed([[5, 6, 7]])[0]["embedding"], llm.embed([[5, 6, 7]])[0]["embedding"]) > 0.99999
    with pytest.raises(ValueError, match="runner"):
        LLM(path, runner="embed", **ENGINE_ARGS)


def test_embed_on_generating_engine(model_paths):
    with LLM(model_paths["gqa_tied"], device="cpu", max_model_len=64, kvcache_block_size=16, num_kvcache_blocks=8,
             max_num_seqs=4) as llm:
        with pytest.raises(ValueError, match="runner='pooling'"):
            llm.embed(["hi"])
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True),
                            use_tqdm=False)[0]["token_ids"].__len__() == 2


# ---- the server ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base_url(path):
    with running_server(path, "--served-model-name", MODEL_NAME, "--runner", "pooling",
                        *engine_flags(ENGINE_ARGS)) as url:
        yield f"{url}/v1"


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)


def test_openai_client_embeddings(client, path, reference):
    tokenizer = AutoTokenizer.from_pretrained(path)
    response = client.embeddings.create(model=MODEL_NAME, input=TEXTS)      # the client asks for base64
    assert response.object == "list" and response.model == MODEL_NAME
    assert [d.index for d in response.data] == [0, 1, 2]
    ids = [tokenizer.encode(text) for text in TEXTS]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, ids))
    for data, token_ids in zip(response.data, ids):
        assert data.object == "embedding"
        assert cosine(data.embedding, reference(token_ids)) > 0.9999
    floats = client.embeddings.create(model=MODEL_NAME, input=[3, 4, 5], encoding_format="float", dimensions=16)
    assert len(floats.data) == 1 and len(floats.data[0].embedding) == 16
    assert cosine(floats.data[0].embedding, reference([3, 4, 5])[:16]) > 0.9999
    single = client.embeddings.create(model=MODEL_NAME, input="Paris")
    assert cosine(single.data[0].embedding, reference(tokenizer.encode("Paris"))) > 0.9999


def test_server_bad_requests(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model=MODEL_NAME, input="hi", dimensions=100000)
    assert error.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model=MODEL_NAME, input=[])
    assert error.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert "runner" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert "runner" in error.value.body["message"]
    assert len(client.embeddings.create(model=MODEL_NAME, input="still serving").data) == 1


def test_langchain_embeddings(base_url, path, reference):
    langchain_openai = pytest.importorskip("langchain_openai")
    tokenizer = AutoTokenizer.from_pretrained(path)
    embeddings = langchain_openai.OpenAIEmbeddings(base_url=base_url, api_key="none", model=MODEL_NAME,
                                                   check_embedding_ctx_length=False)
    documents = embeddings.embed_documents(TEXTS)
    assert len(documents) == len(TEXTS)
    for text, vector in zip(TEXTS, documents):
        assert cosine(vector, reference(tokenizer.encode(text))) > 0.9999
    assert cosine(embeddings.embed_query("Paris"), reference(tokenizer.encode("Paris"))) > 0.9999
