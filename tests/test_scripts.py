"""The measuring tools: each one runs (--help) on a CPU machine without the plotting library, and
each one under scripts/ is documented where users look for it."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYTHON_TOOLS = sorted([*REPO.glob("scripts/*.py"), REPO / "bench.py", REPO / "bench_latency.py",
                       REPO / "bench_serving.py"])
# Every tool's --help in one fresh interpreter (torch is imported once), without matplotlib, which
# is an optional extra (`docs`) that no tool may need before its main() runs.
HELP_ALL = """
import contextlib, io, json, runpy, sys
sys.modules["matplotlib"] = None
results = {}
for path in sys.argv[1:]:
    out, code = io.StringIO(), None
    sys.argv = [path, "--help"]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exit:
        code = exit.code
    except BaseException as error:
        code = repr(error)
    results[path.rsplit("/", 1)[-1]] = {"code": code, "out": out.getvalue()}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def help_runs() -> dict[str, dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    python = subprocess.run([sys.executable, "-c", HELP_ALL, *map(str, PYTHON_TOOLS)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert python.returncode == 0, python.stderr[-2000:]
    results = json.loads(python.stdout.strip().splitlines()[-1])
    shell = subprocess.run(["bash", "scripts/gpu_check.sh", "--help"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=60)
    results["gpu_check.sh"] = {"code": shell.returncode or None, "out": shell.stdout}
    return results


@pytest.mark.parametrize("name", [path.name for path in PYTHON_TOOLS])
def test_python_tool_prints_its_usage(help_runs, name):
    result = help_runs[name]
    assert result["code"] in (0, None), result
    assert result["out"].startswith("usage:"), result["out"][:500]


def test_gpu_round_lists_its_stages(help_runs):
    result = help_runs["gpu_check.sh"]
    assert result["code"] is None, result
    for stage in ("tests", "bench", "latency", "serving", "moe", "profile", "parallel", "quant", "quant-gemm"):
        assert f"gpu_check.sh {stage}" in result["out"]


def test_every_script_is_documented():
    docs = (REPO / "README.md").read_text() + (REPO / "docs" / "benchmarks.md").read_text()
    undocumented = [p.name for p in (REPO / "scripts").iterdir() if p.is_file() and p.name not in docs]
    assert not undocumented, f"scripts named neither in README.md nor in docs/benchmarks.md: {undocumented}"


def test_benchmark_tables_come_from_the_data_file():
    spec = importlib.util.spec_from_file_location("plot_benchmarks", REPO / "scripts" / "plot_benchmarks.py")
    plot_benchmarks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_benchmarks)
    tables = plot_benchmarks.markdown_tables(plot_benchmarks.load())
    assert tables.count("\n| Qwen3-8B, bf16 |") == 2      # one throughput row and one latency row
    doc = (REPO / "docs" / "benchmarks.md").read_text()
    for table in tables.split("\n\n"):
        assert table in doc, "docs/benchmarks.md's tables differ from `python scripts/plot_benchmarks.py --markdown`"
