"""OpenAI-compatible HTTP server over AsyncLLM: `nanovllm serve [MODEL]` or `python -m nanovllm.serve`."""
