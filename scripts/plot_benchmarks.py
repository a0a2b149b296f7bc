"""The recorded numbers of docs/benchmarks.json drawn against their floors, and as the tables of
docs/benchmarks.md: the one file both come from.

    python scripts/plot_benchmarks.py                 # writes docs/throughput_vs_floor.png
    python scripts/plot_benchmarks.py --markdown      # prints the tables that docs/benchmarks.md holds

A new measurement goes into docs/benchmarks.json (one entry per shape, cache and device; "runs" are
every run of the recorded commit), then both outputs are regenerated. Plotting needs matplotlib
(`pip install -e .[docs]`).
"""
import argparse
import json
import statistics
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def load(path: Path = DOCS / "benchmarks.json") -> dict:
    with open(path) as f:
        return json.load(f)


def label(entry: dict) -> str:
    return f"{entry['shape']}, {entry['cache']}"


def tok_s(entry: dict) -> float:
    return statistics.mean(entry["runs"])


def markdown_tables(data: dict) -> str:
    """The throughput and latency tables of docs/benchmarks.md."""
    lines = ["| shape, KV cache | device | tok/s (runs) | floor (counts) | % of floor | date | commit | command |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in data["throughput"]:
        runs = " / ".join(f"{r:,}" for r in e["runs"])
        lines.append(f"| {label(e)} | {e['device']} | **{tok_s(e):,.0f}** ({runs}) | {e['floor_tok_s']:,} "
                     f"({e['floor_counts']}) | {100 * tok_s(e) / e['floor_tok_s']:.0f}% | {e['date']} | {e['commit']} "
                     f"| `{e['command']}` |")
    lines += ["", "| shape, KV cache | device | batch | ms per output token | floor | % of floor | date | commit | command |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in data["latency"]:
        lines.append(f"| {label(e)} | {e['device']} | {e['batch_size']} | **{e['tpot_ms']:.2f}** | {e['floor_ms']:.2f} ms "
                     f"| {100 * e['floor_ms'] / e['tpot_ms']:.0f}% | {e['date']} | {e['commit']} | `{e['command']}` |")
    return "\n".join(lines)


def plot(data: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    throughput, latency = data["throughput"], data["latency"]
    panels = (  # entries, share of the floor reached, annotation, title
        (throughput, [tok_s(e) / e["floor_tok_s"] for e in throughput],
         [f"{tok_s(e):,.0f} of {e['floor_tok_s']:,} tok/s" for e in throughput],
         "Throughput, bench.py (256 requests, 100-1024 tokens in and out)"),
        (latency, [e["floor_ms"] / e["tpot_ms"] for e in latency],
         [f"{e['tpot_ms']:.2f} ms per token, floor {e['floor_ms']:.2f} ms" for e in latency],
         "Latency at batch 1, bench_latency.py (128 tokens in, 512 out)"))
    fig, axes = plt.subplots(2, 1, figsize=(9, 1.2 + 0.55 * (len(throughput) + len(latency))),
                             height_ratios=[len(throughput), len(latency)])
    for ax, (entries, shares, notes, title) in zip(axes, panels):
        rows = list(range(len(entries)))[::-1]          # first entry on top
        ax.barh(rows, [100] * len(rows), height=0.7, color="#e3e3e3")
        ax.barh(rows, [100 * s for s in shares], height=0.7, color="#2f6db5")
        for row, share, note in zip(rows, shares, notes):
            ax.text(1.5, row, f"{100 * share:.0f}%", va="center", color="white", fontsize=9, fontweight="bold")
            ax.text(101.5, row, note, va="center", fontsize=9)
        ax.set_yticks(rows, [f"{label(e)} ({e['device'].split()[0]})" for e in entries], fontsize=9)
        ax.set_xlim(0, 100)
        ax.set_title(title, fontsize=10, loc="left")
        ax.spines[["top", "right"]].set_visible(False)
        ax.tick_params(axis="y", length=0)
    axes[-1].set_xlabel("% of the floor (100%: every byte read at 3.0 TB/s on the H100, 4.3 on the H200, plus "
                        "prefill FLOPs at 989 TFLOP/s for 8B and up)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")
    print(f"wrote {out}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DOCS / "benchmarks.json")
    parser.add_argument("--out", type=Path, default=DOCS / "throughput_vs_floor.png")
    parser.add_argument("--markdown", action="store_true", help="print the tables instead of plotting")
    args = parser.parse_args()
    data = load(args.data)
    if args.markdown:
        print(markdown_tables(data))
    else:
        plot(data, args.out)


if __name__ == "__main__":
    main()
