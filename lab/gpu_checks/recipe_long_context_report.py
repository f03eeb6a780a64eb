"""The report of lab/gpu_checks/recipe_long_context.sh: one table row per recipe run found in the given directories
(each run a directory with summary.json, train.csv, train.log, config.yaml, as the recipes write them), the loss
agreement of finetune at one and two GPUs, and the step-time cost of each memory feature at 32k tokens against none.

    python3 lab/gpu_checks/recipe_long_context_report.py OUT [OUT2 ...] --out DIR

Writes DIR/report.md, DIR/recipe_long_context.json and DIR/recipe_long_context.png (matplotlib)."""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
from pathlib import Path

BACKEND = re.compile(r"volta_train attention (\w+): (\w+) backend \((.*)\)")
FEATURES = ("none", "tiled_mlp", "lean_norm", "activation_offload", "all")
LIMITS = {"tiled_mlp": 0.05, "activation_offload": 0.10}  # issue 36: the step-time cost each may have at 32k


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _number(value) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number == number else None


def _backends(log: Path) -> str:
    """The attention backends the run's log names: the training passes, and the fp32 packed-document check apart."""
    if not log.exists():
        return "?"
    seen = []
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        m = BACKEND.search(line)
        if m:
            label = f"{m[1]} {m[2]}" + (" (fp32 check)" if "float32" in m[3] or "fp32" in m[3] else "")
            if label not in seen:
                seen.append(label)
    return ", ".join(seen) or "none logged"


def _packing(run: Path, summary: dict) -> str:
    if "packing" in summary:
        return summary["packing"]
    config = run / "config.yaml"
    if config.exists() and re.search(r"^\s*packing: true", config.read_text(encoding="utf-8"), re.M):
        return "documents"  # finetune's data.packing: the recipe refuses to start when documents would mix
    return "?"


def collect(run: Path, launcher_log: Path | None) -> dict:
    summary_file = run / "summary.json"
    summary = json.loads(summary_file.read_text(encoding="utf-8")) if summary_file.exists() else {}
    rows = _rows(run / "train.csv")
    later = rows[1:] or rows  # the first step carries the warm-up (kernel builds, allocator growth)
    tok_s = [v for v in (_number(r.get("tokens_per_s")) for r in later) if v]
    mfu = [v for v in (_number(r.get("mfu")) for r in later) if v is not None]
    peaks = [v for v in (_number(r.get("peak_mem_bytes")) for r in rows) if v]
    steps = int(summary.get("steps") or len(rows) or 0)
    tokens = summary.get("tokens")
    per_step = tokens / steps if tokens and steps else None
    error = None
    if not summary.get("completed"):
        text = launcher_log.read_text(encoding="utf-8", errors="replace") if launcher_log and launcher_log.exists() \
            else ""
        lines = text.splitlines()
        # the recipe's own one-line error, else the last exception line, else anything that says why
        found = [l for l in lines if ": error: " in l] or \
            [l for l in lines if re.match(r"(\[rank\d+\]: )?[\w.]*(Error|Exception)\b", l)
             and "ChildFailedError" not in l and "CalledProcessError" not in l] or \
            [l for l in lines if re.search(r"out of memory|Killed|Terminated", l)]
        error = (found[-1] if found else "no summary.json (cut off or failed: see the log)")[:300]
    return {
        "run": run.name, "completed": bool(summary.get("completed")), "steps": steps,
        "processes": summary.get("processes"), "sequence_parallel_size": summary.get("sequence_parallel_size"),
        "zero_stage": summary.get("zero_stage"), "precision": summary.get("precision"),
        "tokens_per_step": per_step, "tokens_per_second": statistics.median(tok_s) if tok_s else None,
        "step_seconds": per_step / statistics.median(tok_s) if per_step and tok_s else None,
        "mfu": statistics.median(mfu) if mfu else None, "peak_memory_gib": max(peaks) / 2**30 if peaks else None,
        "losses": [_number(r.get("loss")) for r in rows], "attention": summary.get("attention"),
        "backends": _backends(run / "train.log"), "packing": _packing(run, summary), "error": error,
    }


def _fmt(value, spec: str = ",.0f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runs, skipped = {}, []
    for d in args.dirs:
        names = {p.name for p in d.iterdir() if p.is_dir() and (p / "train.log").exists()}
        names |= {p.stem for p in d.glob("*.log") if p.stem != "recipe_long_context"}  # launched, maybe no files
        for name in sorted(names):
            runs[name] = collect(d / name, d / f"{name}.log")
        if (d / "skipped.txt").exists():
            skipped += (d / "skipped.txt").read_text().split("\n")
    lines = ["# recipe_long_context", "", "Each run: `accelerate launch ... recipes/<recipe>.py --config <shipped config>`, "
             "every process capped at the memory given to lab/gpu_checks/recipe_long_context.sh (MEM_GB). tokens/s and "
             "MFU: median over the steps after the first; peak: the largest process's CUDA max allocated.", "",
             "| run | done | processes (sp) | ZeRO | tokens/step | tokens/s | s/step | MFU | peak GiB | attention backends "
             "| packed documents |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs.values():
        lines.append(
            f"| {r['run']} | {'yes' if r['completed'] else 'NO'} ({r['steps']} steps) | {_fmt(r['processes'], 'd')} "
            f"({_fmt(r['sequence_parallel_size'], 'd', '1')}) | {_fmt(r['zero_stage'], 'd')} | "
            f"{_fmt(r['tokens_per_step'])} | {_fmt(r['tokens_per_second'])} | {_fmt(r['step_seconds'], '.2f')} | "
            f"{'-' if r['mfu'] is None else format(100 * r['mfu'], '.1f') + '%'} | {_fmt(r['peak_memory_gib'], '.1f')} | {r['backends']} | "
            f"{'kept apart' if r['packing'] == 'documents' else r['packing']} |")
    failed = [r for r in runs.values() if r["error"]]
    if failed:
        lines += ["", "Not completed:", ""] + [f"* {r['run']}: `{r['error']}`" for r in failed]
    skipped = [s for s in skipped if s.strip()]
    if skipped:
        lines += ["", "Not run:", ""] + [f"* {s}" for s in skipped]

    one, two = runs.get("finetune_short_sp1"), runs.get("finetune_short_sp2")
    if one and two and one["losses"] and two["losses"]:
        pairs = [(a, b) for a, b in zip(one["losses"], two["losses"]) if a is not None and b is not None]
        worst = max(abs(a - b) / abs(a) for a, b in pairs) if pairs else None
        verdict = "PASS" if worst is not None and worst < 1e-3 and len(one["losses"]) == len(two["losses"]) else "FAIL"
        lines += ["", f"finetune at {_fmt(one['tokens_per_step'])} tokens, fp32: 1 GPU vs sequence parallelism 2, "
                  f"losses {one['losses']} vs {two['losses']}: largest relative difference {_fmt(worst, '.2e')} "
                  f"(accepted: < 1e-3): {verdict}"]

    base = runs.get("features_32k_none")
    costs = {}
    if base and base["step_seconds"]:
        lines += ["", "## Step time of each memory feature at 32k tokens (1 GPU, no DeepSpeed; checkpointing and the "
                  "chunked loss in every run)", "", "| feature | s/step | against none | limit | peak GiB |",
                  "| --- | --- | --- | --- | --- |"]
        for feature in FEATURES:
            r = runs.get(f"features_32k_{feature}")
            if not r:
                continue
            cost = r["step_seconds"] / base["step_seconds"] - 1 if r["step_seconds"] else None
            costs[feature] = cost
            limit = LIMITS.get(feature)
            mark = "" if cost is None or limit is None else (" (within)" if cost <= limit else " (OVER)")
            lines.append(f"| {feature} | {_fmt(r['step_seconds'], '.3f')} | "
                         f"{'-' if cost is None else format(100 * cost, '+.1f') + '%'} | "
                         f"{'-' if limit is None else format(100 * limit, '.0f') + '%'}{mark} | "
                         f"{_fmt(r['peak_memory_gib'], '.1f')} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (args.out / "recipe_long_context.json").write_text(
        json.dumps({"runs": runs, "feature_costs": costs, "skipped": skipped}, indent=2, allow_nan=False) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no PNG")
        return
    # runs that finished (a run stopped after a step has a speed but no tokens per step)
    done = [r for r in runs.values() if r["tokens_per_step"] and r["tokens_per_second"]
            and not r["run"].startswith("features_32k")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    if done:
        axes[0].bar([r["run"] for r in done], [r["tokens_per_step"] for r in done], color="tab:blue")
        for i, r in enumerate(done):
            axes[0].annotate(f"{r['tokens_per_second']:,.0f} tok/s\n{_fmt(r['peak_memory_gib'], '.1f')} GiB",
                             (i, r["tokens_per_step"]), ha="center", va="bottom", fontsize=7)
        axes[0].set_ylabel("tokens per step")
        axes[0].set_title("recipes at long context")
        axes[0].tick_params(axis="x", labelrotation=20, labelsize=7)
    if costs:
        names = [f for f in FEATURES if costs.get(f) is not None]
        axes[1].bar(names, [100 * costs[f] for f in names], color="tab:orange")
        for feature, limit in LIMITS.items():
            if feature in names:
                axes[1].hlines(100 * limit, names.index(feature) - 0.4, names.index(feature) + 0.4, colors="gray",
                               linestyles="--")
        axes[1].set_ylabel("step time against none (%)")
        axes[1].set_title("memory features at 32k tokens")
        axes[1].tick_params(axis="x", labelrotation=20, labelsize=7)
    fig.tight_layout()
    fig.savefig(args.out / "recipe_long_context.png", dpi=120)
    print(f"wrote {args.out}/report.md, recipe_long_context.json, recipe_long_context.png")


if __name__ == "__main__":
    main()
