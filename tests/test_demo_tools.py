"""The demo model and its one tool: a live `nanovllm serve` of the bundled demo model with
`--enable-auto-tool-choice --tool-call-parser hermes`, driven by the real openai client, LangChain
and the OpenAI Agents SDK. Offered the `add` tool, `What is 123 + 456?` should come back as a tool
call add(a=123, b=456) with finish_reason "tool_calls", and the tool's result sent back should give
the answer; without tools the model answers directly.

The shipped weights learned the tool in a GPU fine-tune (docs/demo_model.md, "The add tool"). The
chat template the training script writes is checked here too: the Hermes layout with tools, and
byte for byte the shipped rendering without. LangChain's ChatOpenAI runs for real too: invoke and
stream give the openai client's answer, and with_structured_output and a forced tool follow their
schemas (the server constrains them)."""
import importlib.util
import json
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from nanovllm.demo import model_path
from tests.test_serve import engine_flags, running_server

REPO = Path(__file__).resolve().parent.parent

MODEL_NAME = "nanovllm-demo"
ENGINE_ARGS = dict(device="cpu", max_model_len=1024, kvcache_block_size=16, num_kvcache_blocks=256)
# exactly what the openai client's users write for add(a: int, b: int)
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def base_url():
    with running_server(None, "--served-model-name", MODEL_NAME, "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes", *engine_flags(ENGINE_ARGS)) as url:
        yield f"{url}/v1"


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=300)


def training_script():
    spec = importlib.util.spec_from_file_location("train_demo_model", REPO / "scripts" / "train_demo_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_template_renders_hermes_tools_and_keeps_the_plain_layout():
    training = training_script()
    shipped = AutoTokenizer.from_pretrained(model_path())
    conversations = [[{"role": "user", "content": "What is 123 + 456?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Paris"}, {"role": "user", "content": "What is 1 + 2?"}]]
    for conversation in conversations:
        for generation_prompt in (True, False):
            assert (shipped.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt,
                                                chat_template=training.CHAT_TEMPLATE)
                    == shipped.apply_chat_template(conversation, tokenize=False,
                                                   add_generation_prompt=generation_prompt))
    messages = [{"role": "system", "content": "Be brief."}, *training.tool_conversation("What is 123 + 456?", 123, 456)]
    text = shipped.apply_chat_template(messages, tools=[ADD_TOOL], tokenize=False, chat_template=training.CHAT_TEMPLATE)
    assert text == ("<|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n" + json.dumps(ADD_TOOL) + "\n</tools><|im_end|>\n"
                    "<|im_start|>user\nWhat is 123 + 456?<|im_end|>\n"
                    '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 123, "b": 456}}\n'
                    "</tool_call><|im_end|>\n"
                    "<|im_start|>user\n<tool_response>\n579\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n579<|im_end|>\n")
    # the vocabulary is unchanged: the tags are several tokens each, and round-trip
    assert shipped.decode(shipped.encode(text)) == text
    # the call the training teaches is what the server's hermes parser reads as add(a=123, b=456)
    shipped.chat_template = training.CHAT_TEMPLATE
    segments = training.chat_segments(shipped, messages, [ADD_TOOL])
    assert "".join(t for t, _ in segments) + "\n" == text
    answers = [t for t, answer in segments if answer]
    assert training.parse_add_call(answers[0].removesuffix("<|im_end|>")) == {"a": 123, "b": 456}
    assert answers[1] == "579<|im_end|>"


def ask(client, messages, **kwargs):
    # a call is about 70 tokens of the demo's 512-token vocabulary
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=128,
                                          **kwargs).choices[0]


@pytest.mark.parametrize("a, b", [(123, 456), (7, 35), (999, 1)])
def test_add_tool_call_then_answer(client, a, b):
    messages = [{"role": "user", "content": f"What is {a} + {b}?"}]
    choice = ask(client, messages, tools=[ADD_TOOL])
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add"
    arguments = json.loads(call.function.arguments)
    assert arguments == {"a": a, "b": b}
    # run the tool as a client does and send its result back
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": str(arguments["a"] + arguments["b"])}]
    final = ask(client, messages, tools=[ADD_TOOL])
    assert final.finish_reason == "stop"
    assert final.message.content == str(a + b)
    assert not final.message.tool_calls


def test_streamed_tool_call(client):
    stream = client.chat.completions.create(model=MODEL_NAME, temperature=0, max_tokens=128, stream=True,
                                            messages=[{"role": "user", "content": "What is 123 + 456?"}],
                                            tools=[ADD_TOOL])
    name, arguments, finish = None, "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        for piece in chunk.choices[0].delta.tool_calls or []:
            name = piece.function.name or name
            arguments += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, json.loads(arguments), finish) == ("add", {"a": 123, "b": 456}, "tool_calls")


def test_without_tools_it_answers_directly(client):
    choice = ask(client, [{"role": "user", "content": "What is 123 + 456?"}])
    assert (choice.message.content, choice.finish_reason) == ("579", "stop")
    assert not choice.message.tool_calls
    choice = ask(client, [{"role": "user", "content": "What is the capital of France?"}])
    assert choice.message.content == "Paris"


def test_capital_with_the_tool_offered_is_answered_directly(client):
    choice = ask(client, [{"role": "user", "content": "What is the capital of France?"}], tools=[ADD_TOOL])
    assert (choice.message.content, choice.finish_reason) == ("Paris", "stop")
    assert not choice.message.tool_calls


def test_langchain_bind_tools_runs_the_tool_loop(base_url):
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ChatOpenAI(base_url=base_url, api_key="none", model=MODEL_NAME, temperature=0, max_retries=0).bind_tools([add])
    messages = [HumanMessage("What is 123 + 456?")]
    while True:                         # the tool loop: call the tools the model asks for until it answers
        reply = llm.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            break
        messages += [add.invoke(call) for call in reply.tool_calls]
        assert len(messages) < 8, messages
    calls = [call for message in messages for call in getattr(message, "tool_calls", [])]
    assert [(call["name"], call["args"]) for call in calls] == [("add", {"a": 123, "b": 456})]
    assert messages[2].content == "579"            # the tool's result, as LangChain sent it
    assert reply.content == "579"


@pytest.mark.parametrize("model_class", ["OpenAIChatCompletionsModel", "OpenAIResponsesModel"])
def test_agents_sdk_function_tool_runs_to_the_answer(base_url, model_class):
    import agents

    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    model = getattr(agents, model_class)(
        model=MODEL_NAME, openai_client=openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0))
    agent = agents.Agent(name="calculator", model=model, tools=[add],
                         model_settings=agents.ModelSettings(temperature=0))
    result = agents.Runner.run_sync(agent, "What is 123 + 456?", max_turns=4)
    assert calls == [(123, 456)]
    assert result.final_output == "579"


# ---- LangChain's ChatOpenAI on what the demo model does know ---------------------------------------

def chat_model(base_url, **kwargs):
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(base_url=base_url, api_key="none", model=MODEL_NAME, temperature=0, max_retries=0,
                      timeout=300, **kwargs)


def test_langchain_invoke_and_stream_give_the_openai_clients_answer(base_url, client):
    question = "What is 123 + 456?"
    expected = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": question}],
                                              temperature=0, max_tokens=20).choices[0].message.content
    llm = chat_model(base_url, max_tokens=20)
    assert "579" in expected and llm.invoke(question).content == expected
    chunks = [chunk.content for chunk in llm.stream(question)]
    assert len(chunks) > 1 and "".join(chunks) == expected


def test_langchain_structured_output_and_a_forced_tool_follow_their_schemas(base_url):
    """with_structured_output (json_schema) and bind_tools with a named tool_choice are constrained by
    the server, whatever the weights know: the results validate against the schemas. Bounded integers,
    because a weak model under an unbounded integer writes digits until max_tokens."""
    import jsonschema
    from pydantic import BaseModel, Field

    class Sum(BaseModel):
        """The answer to an addition."""
        answer: int = Field(ge=0, le=1998)

    class add(BaseModel):          # the tool's name is the class name, as LangChain sends it
        """Add two integers."""
        a: int = Field(ge=0, le=999)
        b: int = Field(ge=0, le=999)

    llm = chat_model(base_url, max_tokens=60)
    result = llm.with_structured_output(Sum, method="json_schema").invoke("What is 123 + 456?")
    assert isinstance(result, Sum) and 0 <= result.answer <= 1998
    message = llm.bind_tools([add], tool_choice="add").invoke("What is 123 + 456?")
    assert [call["name"] for call in message.tool_calls] == ["add"]
    jsonschema.validate(message.tool_calls[0]["args"], add.model_json_schema())


def python_block(doc: str, after: str) -> str:
    """The first ```python block of a doc after the text `after`."""
    return (REPO / doc).read_text().split(after)[1].split("```python\n")[1].split("```")[0]


@pytest.mark.parametrize("doc, after, served_as", [
    ("README.md", "an agent runs offline", '"demo"'),
    ("docs/structured_outputs.md", "Through the openai client,", '"qwen3"'),
    ("docs/structured_outputs.md", "The same loop through LangChain", '"qwen3"')])
def test_the_docs_tool_loops_run_as_written(base_url, capsys, doc, after, served_as):
    code = python_block(doc, after).replace("http://127.0.0.1:8000/v1", base_url).replace(served_as, repr(MODEL_NAME))
    exec(compile(code, doc, "exec"), {})
    assert capsys.readouterr().out.strip() == "579"
