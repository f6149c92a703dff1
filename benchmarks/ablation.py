"""
What each speed technique buys: every row is one bench.py run in a fresh process (same interpreter and
environment, so the same allocator and threads), read back through its --result_json.

$ python benchmarks/ablation.py                        # both studies
$ python benchmarks/ablation.py --studies=cumulative --skip_rows=compile
$ python benchmarks/ablation.py config/bench_cpu.py --batch_size=4   # bench.py's config and overrides pass through

Two studies: "attention" runs each attention path against the user's config; "cumulative" adds one technique
per row, so its last row has them all. Prints one Markdown table (speed-up against the first row of each study,
the held-out loss after the timed steps), and writes results_dir/ablation.json and ablation.png (tokens/s bars).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import bench  # noqa: E402
from benchmarks import load_note, markdown_table, run_child, sdpa, study_config  # noqa: E402
from nanogpt.device import resolve_device, resolve_dtype  # noqa: E402
from nanogpt.errors import UserError, exit_on_user_error  # noqa: E402
from nanogpt.measure import allocator_line, detect_allocator, machine_info, machine_line, write_json  # noqa: E402
from nanogpt.optional import pyplot  # noqa: E402

CHART = "benchmarks/ablation.py (for ablation.png)"  # what needs matplotlib, for its error


@dataclass
class AblationConfig:
    studies: str = "attention,cumulative"  # comma-separated
    skip_rows: str = ""  # rows to leave out, e.g. "compile" or "cumulative.compile" (see STUDIES)


@dataclass(frozen=True)
class Row:
    study: str
    name: str  # the id for skip_rows and the JSON
    label: str  # what the table shows
    overrides: dict  # config keys set on top of the user's config (cumulative: this row's change)
    cuda_only: str | None = None  # why the row means nothing on another device


HALF = "half"  # stands for the device's best half type: bfloat16, or float16 on a GPU without bf16 (V100, T4)
STUDIES: dict[str, list[Row]] = {
    # each row against the user's config, from nanoGPT's attention (explicit math, no vocabulary padding)
    "attention": [
        Row("attention", "math", "math attention (nanoGPT)", {"attention": "math", "vocab_padding_multiple": 1}),
        Row("attention", "sdpa-math", "SDPA math kernel", sdpa("math")),
        Row("attention", "efficient", "SDPA memory-efficient kernel", sdpa("efficient")),
        Row("attention", "flash", "SDPA flash kernel", sdpa("flash")),
        Row("attention", "flash+pad", "flash + padded vocab (64)", sdpa("flash", vocab_padding_multiple=64)),
    ],
    # each row adds its change to the rows above it, so the last one has every technique
    "cumulative": [
        Row("cumulative", "float32", "float32 (math, no TF32/compile/padding, unfused AdamW)",
            {"dtype": "float32", "tf32": False, "compile": False, "attention": "math", "vocab_padding_multiple": 1,
             "fused_adamw": False, "keep_freed_memory": False, "fused_loss": False}),
        Row("cumulative", "tf32", "+ TF32 matmuls", {"tf32": True}, cuda_only="TF32 is CUDA-only"),
        Row("cumulative", "bf16", "+ bf16 autocast", {"dtype": HALF}),
        Row("cumulative", "compile", "+ torch.compile", {"compile": True}),
        Row("cumulative", "flash", "+ SDPA flash", {"attention": "sdpa", "sdpa_backend": "flash"}),
        Row("cumulative", "padded", "+ padded vocab (64)", {"vocab_padding_multiple": 64}),
        Row("cumulative", "fused", "+ fused AdamW", {"fused_adamw": True}),
        Row("cumulative", "malloc", "+ glibc malloc keeps freed memory", {"keep_freed_memory": True}),
        Row("cumulative", "fused_loss", "+ fused chunked linear + cross-entropy", {"fused_loss": True}),
    ],
}
CUMULATIVE = {"cumulative"}


def half_dtype(device: str) -> str:
    return resolve_dtype("auto", device) if device.startswith("cuda") else "bfloat16"


def selected_rows(cfg: AblationConfig, device: str) -> list[Row]:
    """The rows of cfg.studies without cfg.skip_rows, with their full overrides: a skipped cumulative row's change is
    left out of the rows below it too; a GPU without bf16 gets float16 in the "bf16" row and below."""
    studies = [s.strip() for s in cfg.studies.split(",") if s.strip()]
    skips = {s.strip() for s in cfg.skip_rows.split(",") if s.strip()}
    known = {n for rows in STUDIES.values() for r in rows for n in (r.name, f"{r.study}.{r.name}")}
    problems = [f"unknown study {s!r} (studies: {', '.join(STUDIES)})" for s in studies if s not in STUDIES]
    problems += [f"unknown row {s!r} in skip_rows (rows: {', '.join(sorted(known))})" for s in sorted(skips - known)]
    if not studies:
        problems.append("studies is empty: give one or more of " + ", ".join(STUDIES))
    if problems:
        raise UserError("; ".join(problems))
    half = half_dtype(device)
    selected = []
    for study in studies:
        accumulated: dict = {}
        for row in STUDIES[study]:
            if row.name in skips or f"{study}.{row.name}" in skips:
                continue
            overrides = {k: half if v == HALF else v for k, v in row.overrides.items()}
            if row.overrides.get("dtype") == HALF and half != "bfloat16":
                row = dataclasses.replace(row, label=f"+ {half} autocast (this GPU has no bf16)")
            if study in CUMULATIVE:
                accumulated = {**accumulated, **overrides}
                overrides = accumulated
            selected.append(dataclasses.replace(row, overrides=overrides))
    return selected


def run_ablation(rows: list[Row], argv: list[str], device: str) -> list[dict]:
    print(f"machine: {machine_line(device)}")
    print(allocator_line(device))
    print(f"ablation: {len(rows)} rows, each in a fresh process (same environment, so the same allocator)", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, row in enumerate(rows):
            entry = {"study": row.study, "name": row.name, "label": row.label, "overrides": row.overrides}
            if row.cuda_only and not device.startswith("cuda"):
                entry.update(status="n/a", reason=row.cuda_only)
            else:
                entry.update(run_child([*argv, "--profile=False"], row.overrides, os.path.join(tmp, f"row{i}.json")))
            results.append(entry)
            done = entry.get("reason", "")
            if entry["status"] == "ok":
                done = f"{entry['ms_median']:.1f} ms/iter ({entry['wall_s']:.0f} s in all)"
                done += f"; {load_note(entry['others_cpu'])}" if load_note(entry["others_cpu"]) else ""
            print(f"  [{row.study} {i + 1}/{len(rows)}] {row.label}: {done}", flush=True)
    add_speedups(results)
    return results


def add_speedups(results: list[dict]) -> None:
    """Speed-up against the first row of each study (None unless both ran)."""
    first: dict[str, dict] = {}
    for r in results:
        base = first.setdefault(r["study"], r)
        ok = r["status"] == "ok" and base["status"] == "ok"
        r["speedup"] = base["ms_median"] / r["ms_median"] if ok else None


def ablation_table(results: list[dict]) -> str:
    header = ["study", "row", "dtype", "ms/iter", "min-max", "tokens/s", "speed-up", "peak MiB", "loss", "note"]
    rows = []
    for r in results:
        if r["status"] != "ok":
            rows.append([r["study"], r["label"], *["-"] * 7, r["reason"]])
            continue
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        peak = f"{r['peak_memory_mib']:.0f}" if r["peak_memory_mib"] is not None else "-"
        rows.append([r["study"], r["label"], r["dtype"], f"{r['ms_median']:.1f}",
                     f"{r['ms_min']:.0f}-{r['ms_max']:.0f}", f"{r['tokens_per_s']:,.0f}", speedup, peak,
                     f"{r['loss']:.4f}", load_note(r["others_cpu"])])
    return markdown_table(header, rows, "lllrrrrrrl")


def plot_ablation(results: list[dict], path: str) -> str:
    """Tokens/s bars, a panel per study; rows that did not run show their reason."""
    plt = pyplot(CHART)
    studies = list(dict.fromkeys(r["study"] for r in results))
    fig, axes = plt.subplots(len(studies), 1, figsize=(8, 1 + 0.45 * len(results)), squeeze=False)
    for ax, study in zip(axes[:, 0], studies):
        rows = [r for r in results if r["study"] == study]
        values = [r["tokens_per_s"] if r["status"] == "ok" else 0 for r in rows]
        ax.barh([r["label"] for r in rows], values)
        for y, r in enumerate(rows):
            if r["status"] != "ok":
                ax.text(0, y, "  " + r["reason"][:60], va="center", fontsize=7)
        ax.invert_yaxis()
        ax.set_title(study)
        ax.set_xlabel("tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    own, argv = study_config(AblationConfig(), sys.argv[1:] if argv is None else argv, bench.BenchConfig())
    cfg, argv = bench.load_config(argv)  # checked once here, not in every child
    device = resolve_device(cfg.device)
    pyplot(CHART)  # a missing matplotlib fails now, not after the rows have run
    results = run_ablation(selected_rows(own, device), argv, device)
    print(ablation_table(results))
    print("loss: on a held-out batch after the timed steps; every row trains the same weights on the same random "
          "tokens, so float32 rows agree to rounding and bf16 rows to about the 3rd decimal")
    measures = {r["memory_measure"] for r in results if r["status"] == "ok"}
    if measures:
        print(f"peak memory: {'; '.join(sorted(measures))}")
    path = os.path.join(cfg.results_dir, "ablation.json")
    write_json(path, {"machine": {**machine_info(device), "allocator": detect_allocator()}, "argv": argv,
                      "rows": results})
    png = plot_ablation(results, os.path.join(cfg.results_dir, "ablation.png"))
    print(f"ablation: written to {path} and {png}")


if __name__ == "__main__":
    exit_on_user_error(main)
