"""The report of lab/gpu_checks/gpu_sp_check.sh: tables, PASS/FAIL lines and RESULT, from what its runs left in OUT.

    python lab/gpu_checks/sp_check_report.py out/gpu_sp_check        # prints the report (markdown); exit 1 on FAIL

Reads OUT/settings.json, OUT/skipped.txt, OUT/loss_sp*/{summary.json,train.csv} (recipes/gpt_long.py) and
OUT/probe_sp*.json (lab/gpu_checks/sp_memory_probe.py); writes OUT/loss.png when matplotlib is there.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

from volta_train.training.plots import plot_loss_curves


def main(out: Path) -> int:
    s = json.loads((out / "settings.json").read_text())
    checks = []  # (ok, line)
    print(f"# Sequence parallelism (DeepSpeed-Ulysses + volta_train) on {s['nproc']} GPUs\n")
    skipped = (out / "skipped.txt").read_text().strip()
    if skipped:
        print("Skipped:\n\n" + "\n".join(f"- {line}" for line in skipped.splitlines()) + "\n")

    # ---------------------------------------------------------------- loss
    runs = {}
    for sp in map(int, s["sp_list"].split()):
        d = out / f"loss_sp{sp}"
        if (d / "summary.json").exists() and (d / "train.csv").exists():
            runs[sp] = (json.loads((d / "summary.json").read_text()), list(csv.DictReader((d / "train.csv").open())))
    if runs:
        print(f"## Loss: gpt_long.py, GPT-2 ({s['model']}), {s['seq_len']} tokens, {s['global_batch']} sequences "
              "per step, "
              f"ZeRO-3, fp16 from a loss scale of 2^{s.get('loss_scale_power', 16)}\n")
        print("| sp x dp | steps | first logged loss | final loss | val loss | tok/s (all GPUs) | peak mem (GiB) | "
              "skipped fp16 steps | attention |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for sp, (m, rows) in runs.items():
            print(f"| {sp} x {m.get('data_parallel_size', '?')} | {m['steps']}/{m['planned_steps']} | "
                  f"{float(rows[0]['loss']):.4f} | {m['train_loss']:.4f} | {m['val_loss']:.4f} | "
                  f"{m['tokens_per_second']:,.0f} | {m['peak_memory_bytes'] / 2**30:.2f} | {m['skipped_steps']} | "
                  f"{m['attention']} |")
        steps = sorted({int(r["step"]) for _, rows in runs.values() for r in rows})
        print("\n| step | " + " | ".join(f"sp={sp}" for sp in runs) + " |")
        print("| --- | " + " | ".join("---" for _ in runs) + " |")
        for step in sorted(set(steps[:: max(1, len(steps) // 12)] + steps[-1:])):
            cells = []
            for sp in runs:
                row = next((r for r in runs[sp][1] if int(r["step"]) == step), None)
                cells.append(f"{float(row['loss']):.4f}" if row else "")
            print(f"| {step} | " + " | ".join(cells) + " |")
        print()
        for sp, (m, rows) in runs.items():
            losses = [float(r["loss"]) for r in rows]
            ok = all(map(math.isfinite, losses)) and len(losses) >= 4 and sum(losses[-3:]) / 3 < losses[0] - 0.5 \
                and m["steps"] >= min(100, m["planned_steps"])
            checks.append((ok, f"loss sp={sp}: {m['steps']} steps, {losses[0]:.3f} -> {losses[-1]:.3f} (finite, "
                               f"decreasing by > 0.5, >= 100 steps)"))
        if 1 in runs:
            ref = {r["step"]: float(r["loss"]) for r in runs[1][1]}
            for sp in [k for k in runs if k != 1]:
                diffs = [abs(float(r["loss"]) - ref[r["step"]]) for r in runs[sp][1] if r["step"] in ref]
                if not diffs:
                    checks.append((False, f"loss sp={sp} vs sp=1: no common logged step"))
                    continue
                mean, worst = sum(diffs) / len(diffs), max(diffs)
                first = diffs[0] / ref[runs[sp][1][0]["step"]]
                ok = mean <= s["tol_mean"] and worst <= s["tol_max"]
                checks.append((ok, f"loss sp={sp} vs sp=1 over {len(diffs)} logged steps: mean |diff| {mean:.4f} "
                                   f"(<= {s['tol_mean']}), max {worst:.4f} (<= {s['tol_max']}), first row relative "
                                   f"{first:.2e}"))
                vr, vs = runs[1][0]["val_loss"], runs[sp][0]["val_loss"]
                print(f"val loss sp={sp} {vs:.4f} vs sp=1 {vr:.4f} (difference {vs - vr:+.4f})")
        else:
            checks.append((False, "loss sp=1: no run to compare with"))
        if plot_loss_curves({f"sp={sp}": rows for sp, (m, rows) in runs.items()},
                            f"gpt_long.py, {s['nproc']} GPUs, ZeRO-3 fp16, same global batch", out / "loss.png"):
            print(f"\nplot: {out / 'loss.png'}")
        print()

    # ---------------------------------------------------------------- memory
    probes = {}
    for sp in sorted({1, s["probe_sp"]}):
        f = out / f"probe_sp{sp}.json"
        if f.exists():
            probes[sp] = json.loads(f.read_text())
    if probes:
        any_probe = next(iter(probes.values()))
        shape = any_probe.get("shape", {})
        print(f"## Longest trainable sequence: {any_probe['arch']} {any_probe['model']} ({shape.get('n_layer')} "
              f"layers, {shape.get('n_head')} heads, width {shape.get('n_embd')}, "
              f"{any_probe['parameters'] / 1e6:.0f} M parameters), ZeRO-3, fp16, activation checkpointing, "
              f"{s['mem_gb']} GiB per GPU, {s['nproc']} x {any_probe['device']}\n")
        print("| sp x dp | fitted peak reserved: GiB + KiB/token | predicted max | verified (one step) | "
              "peak allocated at it (GiB) | s/step at it | window vs full at | window / full peak (GiB) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for sp, p in probes.items():
            fit, ver, twin = p.get("fit", {}), p.get("verified", {}), p.get("twin")
            fitted = f"{fit['intercept_gib']:.2f} + {fit['kib_per_token']:.1f}" if fit else "n/a"
            verified = f"{ver['length']:,} {'fits' if ver.get('ok') else 'OUT OF MEMORY'}" if ver else "n/a"
            twin_cells = (f"{twin['length']:,} | {twin['window_gib']:.2f} / {twin['full_gib']:.2f}" if twin
                          else "n/a | n/a")
            print(f"| {sp} x {p['dp']} | {fitted} | {fit.get('predicted_length', 0):,} | {verified} | "
                  f"{ver.get('peak_allocated_gib', float('nan')):.2f} | {ver.get('seconds', float('nan'))} | "
                  f"{twin_cells} |")
        print("\nEvery step (largest process's max_memory_allocated / max_memory_reserved; cache emptied before "
              "each):\n")
        print("| sp | attention | tokens | per GPU | peak allocated (GiB) | peak reserved (GiB) | s |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for sp, p in probes.items():
            # the verification is among the steps since the probe lists every step (its "prediction" tells)
            extra = [] if "prediction" in p or not p.get("verified", {}).get("ok") else [p["verified"]]
            for r in p["steps"] + extra:
                print(f"| {sp} | {r['attention']} | {r['length']:,} | {r['shard']:,} | {r['peak_allocated_gib']:.2f} | "
                      f"{r['peak_reserved_gib']:.2f} | {r['seconds']} |")
        print()
        for sp, p in probes.items():
            twin = p.get("twin")
            if twin:
                rel = abs(twin["window_gib"] - twin["full_gib"]) / twin["full_gib"]
                checks.append((rel <= s["tol_twin"], f"memory sp={sp}: window vs full attention at {twin['length']:,} "
                                                     f"tokens: {twin['window_gib']:.2f} vs {twin['full_gib']:.2f} GiB "
                                                     f"({rel:.1%}, <= {s['tol_twin']:.0%})"))
            checks.append((bool(p.get("max_length")), f"memory sp={sp}: {p.get('max_length') or 0:,} tokens verified "
                                                      f"within {s['mem_gb']} GiB"))
        n = s["probe_sp"]
        if n in probes and 1 in probes and probes[1].get("max_length") and probes[n].get("max_length"):
            ratio = probes[n]["max_length"] / probes[1]["max_length"]
            checks.append((ratio >= s["ratio_min"], f"memory: longest sequence sp={n} / sp=1 = "
                                                    f"{probes[n]['max_length']:,} / {probes[1]['max_length']:,} = "
                                                    f"{ratio:.2f} (>= {s['ratio_min']})"))
        elif n != 1:
            checks.append((False, f"memory: no sp={n} / sp=1 ratio (a probe is missing or did not verify)"))

    print("## Checks\n")
    for ok, line in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {line}")
    result = bool(checks) and all(ok for ok, _ in checks)
    print(f"\nRESULT: {'PASS' if result else 'FAIL'}" + ("" if not skipped else " (with skipped parts: see above)"))
    return 0 if result else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
