"""lab/gpu_checks/recipe_long_context_report.py on run directories as the recipes write them (random figures): the
table's medians, the finetune loss agreement, each memory feature's step time against none; and
lab/gpu_checks/recipe_long_context.sh CPU_SMOKE=1 (slow): the gpt_long runs through accelerate launch, reported."""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "lab" / "gpu_checks" / "recipe_long_context_report.py"


def _run_dir(out: Path, name: str, rnd: random.Random, tokens: int, step_s: float, losses: list[float],
             packing: str | None = "documents") -> dict:
    run = out / name
    run.mkdir(parents=True)
    rates = [tokens / (step_s * rnd.uniform(0.95, 1.05)) for _ in losses]
    rates[0] /= 3  # the first step's warm-up
    peaks = [rnd.uniform(20, 31) * 2**30 for _ in losses]
    mfus = [rnd.uniform(0.2, 0.5) for _ in losses]
    with (run / "train.csv").open("w") as f:
        f.write("step,loss,tokens_per_s,mfu,peak_mem_bytes\n")
        for i, (loss, rate, mfu, peak) in enumerate(zip(losses, rates, mfus, peaks), 1):
            f.write(f"{i},{loss},{rate},{mfu},{peak}\n")
    summary = {"completed": True, "steps": len(losses), "tokens": tokens * len(losses), "processes": 2,
               "sequence_parallel_size": 2, "zero_stage": 3, "precision": "fp16", "attention": "volta_train"}
    if packing is not None:
        summary["packing"] = packing
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "train.log").write_text(
        "INFO volta_train attention forward: reference backend (dtype torch.float32: the Volta kernel runs fp16)\n"
        "INFO volta_train attention forward: kernel backend (fp16 on NVIDIA H200 (sm_90) is supported)\n"
        "INFO volta_train attention backward: kernel backend (fp16 on NVIDIA H200 (sm_90) is supported)\n")
    (run / "config.yaml").write_text("data:\n  packing: true\n")
    return {"rate": statistics.median(rates[1:]), "mfu": statistics.median(mfus[1:]), "peak": max(peaks) / 2**30}


def test_report_tables_medians_loss_agreement_and_feature_costs(tmp_path):
    rnd = random.Random(int.from_bytes(os.urandom(4), "little"))
    out = tmp_path / "out"
    tokens = rnd.choice([262144, 393216])
    expected = _run_dir(out, "gpt_long_1b", rnd, tokens, rnd.uniform(5, 50), [rnd.uniform(9, 12) for _ in range(4)])
    losses = [rnd.uniform(3, 6) for _ in range(2)]
    _run_dir(out, "finetune_short_sp1", rnd, 8192, 1.0, losses, packing=None)
    _run_dir(out, "finetune_short_sp2", rnd, 8192, 1.0, [x * (1 + 1e-5) for x in losses], packing=None)
    base = rnd.uniform(2, 4)
    costs = {"none": 0.0, "tiled_mlp": rnd.uniform(0, 0.04), "lean_norm": rnd.uniform(0, 0.2),
             "activation_offload": rnd.uniform(0.11, 0.3), "all": rnd.uniform(0, 0.3)}
    for feature, cost in costs.items():
        _run_dir(out, f"features_32k_{feature}", random.Random(0), 32768, base * (1 + cost), [5.0] * 5)
    (out / "gpt_long_8b_sp2.log").write_text("Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory.\n")
    subprocess.run([sys.executable, str(REPORT), str(out), "--out", str(tmp_path / "report")], check=True,
                   capture_output=True, text=True)
    report = (tmp_path / "report" / "report.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| gpt_long_1b |"))
    assert f"| {tokens:,} | {expected['rate']:,.0f} |" in row and f"{100 * expected['mfu']:.1f}%" in row
    assert f"| {expected['peak']:.1f} |" in row and "kept apart" in row
    assert "forward kernel, backward kernel" in row and "forward reference (fp32 check)" in row
    assert "gpt_long_8b_sp2: `torch.OutOfMemoryError: CUDA out of memory.`" in report
    assert "(accepted: < 1e-3): PASS" in report
    written = json.loads((tmp_path / "report" / "recipe_long_context.json").read_text())
    for feature, cost in costs.items():
        assert abs(written["feature_costs"][feature] - cost) < 1e-9
    assert "| activation_offload |" in report and "10% (OVER)" in report and "5% (within)" in report


@pytest.mark.launches_processes  # its two-process runs use accelerate's rendezvous port
@pytest.mark.slow
def test_cpu_smoke_runs_the_gpt_long_recipes(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "CPU_SMOKE": "1", "STEPS": "2", "FEATURE_STEPS": "2",
           "RUNS": "gpt_long_1b,features_32k",
           "FEATURES": "none,all"}  # two of the five feature runs: the smoke tests the flow, each run ~10 s
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(["bash", str(ROOT / "lab/gpu_checks/recipe_long_context.sh")], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = (tmp_path / "out" / "report.md").read_text()
    runs = [line for line in report.splitlines() if line.startswith(("| gpt_long_1b |", "| features_32k_"))]
    assert len(runs) == 3 and all("| yes (2 steps) |" in row and "kept apart" in row for row in runs), report
    features = report.split("## Step time of each memory feature")[1]
    assert "| none |" in features and "| all |" in features and "| tiled_mlp |" not in features, features
    assert (tmp_path / "out" / "recipe_long_context.png").exists()
