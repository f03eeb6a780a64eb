"""The sm_70 kernels compile with NVRTC 11.8 (what PyTorch cu118 and CUDA 11 drivers on older V100 clusters carry)
as well as NVRTC 12: a representative set, one variant of every kernel kind (forward, backward preprocess, dK/dV and dQ,
decode, split-KV combine) in each of its accumulation, dropout and softcap flavours, the widest head_dim of each.

``VOLTA_TRAIN_NVRTC`` names the wheel (``nvidia-cuda-nvrtc-cu11``, from the test extra) whose libnvrtc compiles;
each version is skipped where its wheel is not installed. The compile runs in a child process with that setting, into
the run's kernel cache (keys include the NVRTC version, so the two never share an entry).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from volta_train.kernels import nvrtc
from volta_train.kernels.tiles import shipped_variants
from checkout import ROOT, checkout_env

WHEELS = {(11, 8): "nvidia-cuda-nvrtc-cu11", (12, 9): "nvidia-cuda-nvrtc-cu12"}


def representative_variants(arch: int = 70) -> list:
    """The widest head_dim of each (pass, fp16 accumulation, dropout, softcap) group of the shipped variants."""
    groups: dict = {}
    for variant in shipped_variants(arch):
        m = variant.meta
        key = (m.get("pass", variant.sources[0]), m.get("accum_f16"), m.get("dropout"), m.get("softcap"))
        if key not in groups or m.get("head_dim", 0) > groups[key].meta.get("head_dim", 0):
            groups[key] = variant
    return list(groups.values())


def test_the_representative_set_covers_every_kind_and_flavour():
    chosen = representative_variants()
    passes = {v.meta.get("pass") for v in chosen}
    assert passes == {"fwd", "bwd_dkdv", "bwd_dq", "preprocess", "decode", "combine"}
    fwd = {(v.meta["accum_f16"], v.meta["dropout"], v.meta["softcap"]) for v in chosen if v.meta.get("pass") == "fwd"}
    assert len(fwd) == 8  # both accumulations x dropout x softcap
    assert any(v.meta.get("softcap") for v in chosen if v.meta.get("pass") == "decode")
    assert 20 <= len(chosen) <= 30


CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
from test_nvrtc_versions import representative_variants
from volta_train.kernels import nvrtc
from volta_train.kernels.precompile import compile_variants

chosen = representative_variants(70)
compile_variants(chosen, 70, processes=2)
print(json.dumps({{"library": nvrtc.find_nvrtc(70).path,
                  "versions": sorted({{".".join(map(str, v.compile(70).nvrtc_version)) for v in chosen}}),
                  "count": len(chosen)}}))
"""


@pytest.mark.slow
@pytest.mark.compiles_kernels  # after precompile_all, the run's NVRTC version loads its entries
@pytest.mark.parametrize("version", sorted(WHEELS), ids=lambda v: f"nvrtc{v[0]}.{v[1]}")
def test_representative_sm70_variants_compile_with_nvrtc(version, tmp_path):
    wheel = WHEELS[version]
    library = nvrtc.wheel_library(wheel)
    if library is None:
        pytest.skip(f"{wheel} is not installed (pip install -e '.[test]' installs it)")
    env = checkout_env(ROOT / "tests" / "support", **{nvrtc.NVRTC_ENV: wheel})  # the child imports this module
    done = subprocess.run([sys.executable, "-c", CHILD.format(tests=str(Path(__file__).resolve().parent))], capture_output=True,
                          text=True, timeout=900, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-6000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["library"] == library
    assert result["versions"] == [f"{version[0]}.{version[1]}"]
    assert result["count"] == len(representative_variants())


def test_volta_train_nvrtc_takes_a_path_or_an_installed_wheels_name(monkeypatch, tmp_path):
    monkeypatch.setenv(nvrtc.NVRTC_ENV, "nvidia-cuda-nvrtc-cu99")
    with pytest.raises(nvrtc.NvrtcNotFoundError, match="is neither a file nor an installed NVRTC wheel"):
        nvrtc.nvrtc_candidate_paths()
    for wheel in WHEELS.values():
        library = nvrtc.wheel_library(wheel)
        if library is not None:
            assert Path(library).name.startswith("libnvrtc.so.")
            monkeypatch.setenv(nvrtc.NVRTC_ENV, wheel)
            assert nvrtc.nvrtc_candidate_paths()[0] == library
