"""bench_latency.py: its report on the bundled demo model, and the floor's byte counts against
transformers' own parameter count of the same checkpoint."""
import contextlib
import io
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import bench_latency
from nanovllm.demo import model_path
from nanovllm.models.registry import build_model, read_model_config
from nanovllm.checkpoints.random_checkpoint import tiny_config

INPUT_LEN, OUTPUT_LEN = 8, 3


@pytest.fixture(scope="module")
def report():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench_latency.main(["--model", model_path(), "--batch-sizes", "1,2", "--input-len", str(INPUT_LEN),
                            "--output-len", str(OUTPUT_LEN)])
    return out.getvalue().strip().splitlines()


def test_one_line_per_batch_size_then_json(report):
    lines = [line for line in report if line.startswith("batch ")]
    assert len(lines) == 2 and "TTFT" in lines[0] and "% of floor" in lines[1]
    data = json.loads(report[-1])
    assert [r["batch_size"] for r in data["results"]] == [1, 2]
    assert (data["input_len"], data["output_len"], data["bandwidth_tbps"]) == (INPUT_LEN, OUTPUT_LEN, 3.0)


def test_floor_counts_the_weights_and_kv_the_step_reads(report):
    data = json.loads(report[-1])
    # the demo model ties its embedding to the LM head, so every weight is read once per step; on
    # the CPU the engine holds it in float32
    hf = AutoModelForCausalLM.from_pretrained(model_path(), dtype=torch.float32)
    assert hf.config.tie_word_embeddings
    assert data["weight_bytes"] == sum(p.numel() * 4 for p in hf.parameters())
    c = hf.config
    assert data["kv_bytes_per_token"] == 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    for r in data["results"]:
        mean_context = INPUT_LEN + OUTPUT_LEN / 2
        step_bytes = data["weight_bytes"] + r["batch_size"] * mean_context * data["kv_bytes_per_token"]
        assert r["floor_ms"] == pytest.approx(step_bytes / 3.0e12 * 1e3)
        assert r["pct_of_floor"] == pytest.approx(100 * r["floor_ms"] / r["tpot_ms"])


def test_timings_of_the_one_timed_run_are_positive_and_agree(report):
    """Every figure comes from one run, so these hold however loaded the machine is."""
    for r in json.loads(report[-1])["results"]:
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["ttft_ms"] > 0
        assert 0 < r["tpot_p50_ms"] <= r["tpot_p99_ms"] and r["tpot_ms"] > 0
        assert r["tok_per_s"] == pytest.approx(r["batch_size"] * OUTPUT_LEN / (r["wall_ms"] / 1e3))
        # a request's TTFT + (n - 1) TPOT is its arrival-to-finish time, inside the timed call;
        # the slack is float rounding of the perf_counter differences
        assert r["ttft_ms"] + (OUTPUT_LEN - 1) * r["tpot_ms"] <= r["wall_ms"] + 1e-6
    one, two = json.loads(report[-1])["results"]
    # one request: its own figures are the mean and every percentile
    assert one["ttft_ms"] == one["ttft_p50_ms"] == one["ttft_p99_ms"]
    assert one["tpot_ms"] == one["tpot_p50_ms"] == one["tpot_p99_ms"]
    # two requests: the median is the midpoint, the mean
    assert two["ttft_p50_ms"] == pytest.approx(two["ttft_ms"]) and two["tpot_p50_ms"] == pytest.approx(two["tpot_ms"])


def test_spread_is_mean_median_and_99th_percentile_in_ms():
    seconds = [0.004, 0.001, 0.1, 0.003, 0.002]
    mean, p50, p99 = bench_latency.spread_ms(seconds)
    assert min(seconds) * 1e3 < mean < max(seconds) * 1e3
    assert mean == pytest.approx(22.0) and p50 == pytest.approx(3.0)
    # rank 0.99 * 4 = 3.96 of the sorted values: 4 ms plus 0.96 of the way to 100 ms
    assert p99 == pytest.approx(4.0 + 0.96 * 96.0)


def test_untied_input_embedding_is_not_a_decode_read():
    config = read_model_config(tiny_config(300, tie_word_embeddings=False))
    model = build_model(config)
    every_parameter = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.model.embed_tokens.weight
    assert bench_latency.decode_weight_bytes(model) == every_parameter - embedding.numel() * embedding.element_size()


def test_new_engine_arguments_are_passed_only_when_given():
    args = bench_latency.parse_args(["--model", model_path()])
    kwargs = bench_latency.engine_args(args)
    assert "quantization" not in kwargs and "speculative_config" not in kwargs
    assert kwargs["max_model_len"] == 128 + 512 and args.batch_sizes == [1, 4, 16, 64]
    args = bench_latency.parse_args(["--model", model_path(), "--quantization", "fp8",
                                     "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    kwargs = bench_latency.engine_args(args)
    assert kwargs["quantization"] == "fp8"
    assert kwargs["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}


@pytest.mark.parametrize("argv, name", [(["--batch-sizes", "1,0"], "--batch-sizes"),
                                        (["--batch-sizes", "one"], "--batch-sizes"),
                                        (["--output-len", "1"], "--output-len"),
                                        (["--bandwidth-tbps", "0"], "--bandwidth-tbps")])
def test_bad_arguments_name_the_flag(argv, name, capsys):
    with pytest.raises(SystemExit):
        bench_latency.parse_args(["--model", model_path(), *argv])
    assert name in capsys.readouterr().err


def test_moe_floor_counts_the_experts_a_batch_reaches():
    """Top-2 of 8 experts: one token reads 2/8 of every layer's experts, two tokens 1 - (6/8)^2."""
    from nanovllm.layers.moe import SparseMoeBlock
    config = read_model_config(tiny_config(300, architecture="Qwen3MoeForCausalLM", num_experts=8,
                                           num_experts_per_tok=2, moe_intermediate_size=24))
    model = build_model(config)
    experts = sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, SparseMoeBlock)
                  for p in m.experts.parameters())
    every = bench_latency.decode_weight_bytes(model)
    assert experts > 0 and every > experts
    assert bench_latency.decode_weight_bytes(model, 1) == round(every - experts + experts * 2 / 8)
    assert bench_latency.decode_weight_bytes(model, 2) == round(every - experts + experts * (1 - (6 / 8) ** 2))
