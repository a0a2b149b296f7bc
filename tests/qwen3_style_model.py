"""A tiny random model whose tokenizer speaks like Qwen3 to agent frameworks: `<think>`,
`<tool_call>` and `<tool_response>` are tokens of their own (added, not special, so they show in the
text), and the chat template has Qwen3's structure: tools listed in the system prompt, calls as
`<tool_call>` JSON blocks, tool results as `<tool_response>` blocks in a user turn, and an empty
think block closed in the prompt when `enable_thinking` is false."""
import torch

from nanovllm.checkpoints.random_checkpoint import tiny_config, write_demo_tokenizer, write_random_checkpoint

AGENT_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

QWEN3_STYLE_TEMPLATE = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
        'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
        '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if message.reasoning_content %}
            {{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- message.content }}
        {%- for call in message.tool_calls or [] %}
            {%- if not loop.first or message.content %}{{- '\\n' }}{%- endif %}
            {%- set arguments = call.function.arguments %}
            {{- '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}
            {{- arguments if arguments is string else arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""


def write_qwen3_style_model(path: str, seed: int = 3) -> str:
    tokenizer = write_demo_tokenizer(path)
    tokenizer.add_tokens(AGENT_TOKENS)
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    tokenizer.save_pretrained(path)
    # tools in the system prompt take about 1000 tokens of this small vocabulary
    config = tiny_config(len(tokenizer), max_position_embeddings=4096)
    write_random_checkpoint(path, config, seed=seed, dtype=torch.float32)
    return path
