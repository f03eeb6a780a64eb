"""lab/peer_ratio.py on CPU: volta_train rows paired with the CUTLASS peer's cases of the same shape, and the files."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("peer_ratio", REPO / "lab" / "peer_ratio.py")
peer_ratio = importlib.util.module_from_spec(spec)
sys.modules["peer_ratio"] = peer_ratio
spec.loader.exec_module(peer_ratio)


def _volta(pass_name, d, n, causal, tflops, backend="volta-fp32acc"):
    return dict(pass_name=pass_name, backend=backend, head_dim=d, seqlen=n, causal=causal, tflops=tflops)


def _peer(pass_name, d, n, causal, tflops, tag="train"):
    return {"tag": tag, "pass": pass_name, "head_dim": d, "seqlen_q": n, "causal": int(causal), "tflops": tflops,
            "tflops_pytorch_split": tflops * 0.9}


def test_pairs_match_pass_head_dim_length_and_mask_only():
    volta = [_volta("bwd", 128, 1024, False, 12.0), _volta("bwd", 128, 1024, True, 10.0),
             _volta("bwd", 64, 1024, False, 14.0), _volta("bwd", 128, 1024, False, 9.0, "sdpa-efficient"),
             _volta("fwd", 128, 4096, False, None)]
    peer = [_peer("bwd", 128, 1024, False, 8.0), _peer("bwd", 128, 1024, True, 7.5),
            _peer("bwd", 64, 1024, False, 8.0, tag="check"), _peer("fwd", 128, 4096, False, 9.0)]
    rows = peer_ratio.pairs(volta, peer)
    assert [(r["causal"], r["ratio"]) for r in rows] == [(False, 12.0 / 8.0), (True, 10.0 / 7.5)]


def test_main_writes_the_table_and_plot(tmp_path):
    (tmp_path / "v.json").write_text(json.dumps({"environment": {"gpu": "GPU X"},
                                                 "rows": [_volta("bwd", 128, 4096, True, 11.0)]}))
    (tmp_path / "c.json").write_text(json.dumps({"environment": {"cutlass_version": "4.2.0"},
                                                 "cases": [_peer("bwd", 128, 4096, True, 8.0)]}))
    assert peer_ratio.main(["--volta", str(tmp_path / "v.json"), "--cutlass", str(tmp_path / "c.json"),
                            "--out", str(tmp_path / "out")]) == 0
    table = (tmp_path / "out" / "peer_ratio.md").read_text()
    assert "| bwd | volta-fp32acc | 128 | 4096 | yes | 11.00 | 8.00 (7.20) | 1.38x |" in table
    assert "GPU X" in table and "CUTLASS 4.2.0" in table
    assert peer_ratio.main(["--volta", str(tmp_path / "missing.json"), "--cutlass", str(tmp_path / "c.json"),
                            "--out", str(tmp_path / "o2")]) == 2
