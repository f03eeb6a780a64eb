"""The kernel templates' one declaration (volta_train/kernels/templates.py) against csrc/kernel_traits.cuh, the tiles
and the variants built from it. CPU only, nothing compiled."""

from __future__ import annotations

import dataclasses
import random
import re

import pytest
import torch

from volta_train.kernels import templates, tiles
from volta_train.resources import csrc_dir

_PARAM = re.compile(r"^(int|bool)\s+([A-Z_0-9]+)\s*(?:=\s*(\S+))?$")


def parse_traits(name: str) -> list[tuple[str, str, str | None]]:
    """(type, name, default or None) of every template parameter of struct `name` in kernel_traits.cuh, in order."""
    text = (csrc_dir() / "kernel_traits.cuh").read_text()
    match = re.search(r"template\s*<([^>]*)>\s*struct\s+" + name + r"\s*\{", text)
    assert match, f"no template struct {name} in kernel_traits.cuh"
    params = []
    for piece in match.group(1).split(","):
        parsed = _PARAM.match(" ".join(piece.split()))
        assert parsed, f"{name}: cannot read template parameter {piece.strip()!r}"
        params.append(parsed.groups())
    return params


@pytest.mark.parametrize("traits", [templates.FWD_TRAITS, templates.BWD_TRAITS], ids=lambda t: t.name)
def test_declaration_matches_kernel_traits(traits):
    cpp = parse_traits(traits.name)
    declared = [(p.kind.__name__, p.cpp_name, None if p.default is None else p.render(p.default)) for p in traits.params]
    assert declared == cpp


def test_parser_reads_what_is_there():
    # the parser sees the real header: the first parameter of both, and a default written out there
    assert parse_traits("FwdKernelTraits")[0] == ("int", "HEAD_DIM", None)
    assert ("bool", "SPLIT_KV", "false") in parse_traits("FwdKernelTraits")
    assert parse_traits("BwdKernelTraits")[-1] == ("bool", "DKDV_ROW_B", "false")
    assert ("int", "OUT_SPLIT", "1") in parse_traits("BwdKernelTraits")


@pytest.mark.parametrize("tile_class, kernels", [
    (tiles.FwdTile, (templates.FWD_KERNEL, templates.DQ_KERNEL, templates.DECODE_KERNEL)),
    (tiles.BwdTile, (templates.DKDV_KERNEL,)),
])
def test_tile_fields_are_template_parameters(tile_class, kernels):
    """Every tile field the template reads has the C++ default as its own; the variant arguments give the rest."""
    fields = {f.name: f.default for f in dataclasses.fields(tile_class)}
    for kernel in kernels:
        for param in kernel.traits.params:
            if param.key in fields and param.key != "dq_atomic":  # BwdTile.dq_atomic allows, the variant's uses
                tile_default = fields[param.key]
                if param.default is None:
                    assert tile_default is dataclasses.MISSING, param.cpp_name
                else:
                    assert tile_default == param.default, param.cpp_name
        for name in kernel.name_order:
            kernel.traits.param(name)  # every part of the name is a declared parameter


def _random_fwd_tile(rng: random.Random) -> tiles.FwdTile:
    return tiles.FwdTile(quad_pair_rows=rng.choice((1, 2, 4)), m_tiles=rng.choice((1, 2)), warps=rng.choice((1, 4, 8)),
                         block_n=rng.choice((16, 32, 64)), min_blocks_per_sm=rng.randint(1, 4),
                         min_blocks_emulated=rng.randint(1, 4), q_in_smem=rng.random() < 0.5,
                         split_masked=rng.random() < 0.5, lazy_rescale=rng.random() < 0.5)


def test_expression_lists_every_parameter_in_order(rng):
    py_rng = random.Random(int(torch.randint(0, 1 << 31, (1,), generator=rng)))
    tile = _random_fwd_tile(py_rng)
    head_dim = py_rng.choice(tiles.SUPPORTED_HEAD_DIMS)
    accum_f16, dropout, softcap = (py_rng.random() < 0.5 for _ in range(3))
    variant = tiles.fwd_variant(head_dim, tile, accum_f16, dropout, softcap)
    b = lambda v: "true" if v else "false"  # noqa: E731
    assert variant.name_expressions == (
        f"flash_fwd_kernel<FwdKernelTraits<{head_dim}, {tile.quad_pair_rows}, {tile.m_tiles}, {tile.warps}, "
        f"{tile.block_n}, {b(accum_f16)}, {b(dropout)}, {tile.min_blocks_per_sm}, {tile.min_blocks_emulated}, "
        f"{b(tile.q_in_smem)}, {b(tile.split_masked)}, {b(softcap)}, false, {b(tile.lazy_rescale and not accum_f16)}>>",)
    # lazy rescaling is the forward's alone: the decoding and dQ kernels keep the exact rescale
    decode = tiles.decode_variant(head_dim, tile, softcap)
    assert decode.name_expressions[0].endswith(f", {b(softcap)}, true, false>>")
    assert ", false, false, " in decode.name_expressions[0]
    exact = variant.name_expressions[0].removesuffix(", true>>").removesuffix(", false>>") + ", false>>"
    assert tiles.dq_variant(head_dim, tile, accum_f16, dropout, softcap).name_expressions[0] == \
        exact.replace("flash_fwd_kernel<", "flash_bwd_dq_kernel<")
    assert variant.name.endswith("_lazy") == (tile.lazy_rescale and not accum_f16)


def test_variant_names_keep_their_form():
    """Names are read by the lab's committed measurements (lab/results/): their form is fixed."""
    tile = tiles.FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=16, min_blocks_per_sm=3, q_in_smem=True,
                         split_masked=True)
    assert tiles.fwd_variant(128, tile, False, True, True).name == \
        "fwd_d128_f32acc_dropout_softcap_qp2x2_m64_n16_w4_occ3.1_qsmem_split"
    assert tiles.dq_variant(128, tile, False, False).name == "bwd_dq_d128_f32acc_qp2x2_m64_n16_w4_qsmem"
    assert tiles.decode_variant(128, tile, True).name == "decode_d128_f32acc_softcap_qp2x2_m64_n16_w4_occ3.1_qsmem_split"
    bwd = tiles.BwdTile(quad_pair_rows=2, warps=4, block_m=16, kv_in_smem=True, dq_atomic=False, lean=True, out_split=2)
    assert tiles.bwd_variant(256, bwd, True, False, False).name == "bwd_dkdv_d256_f16acc_qp2x2_n64_m16_w4_kvsmem_lean_split2"
    assert tiles.bwd_variant(64, tiles.BwdTile(quad_pair_rows=1, warps=8, block_m=64), False, False, True).name == \
        "bwd_dkdv_d64_f32acc_dqatomic_qp1x4_n64_m64_w8"
    assert tiles.bwd_variant(128, tiles.bwd_tile(128, 70), False, False, True).name == \
        "bwd_dkdv_d128_f32acc_dqatomic_qp1x4_n96_m32_w12_kvsmem_lean_dqk_rowb"


@pytest.mark.parametrize("arch", [70, 90])
def test_names_and_expressions_one_to_one(arch):
    """A variant name stands for one instantiation (it is a cache and measurement key) and the reverse."""
    by_name: dict[str, str] = {}
    for variant in tiles.shipped_variants(arch):
        by_name.setdefault(variant.name, variant.name_expressions[0])
        assert by_name[variant.name] == variant.name_expressions[0], variant.name
    assert len(set(by_name.values())) == len(by_name)


def test_dkdv_row_b_needs_1x4_quad_pairs_and_no_split():
    """dkdv_row_b reads dK / dV's B from the Q / dO rows in the 1x4 layout: 2x2 tiles and split tiles are refused."""
    with pytest.raises(ValueError, match="dkdv_row_b=True needs quad_pair_rows=1 and out_split=1, got quad_pair_rows=2"):
        tiles.BwdTile(quad_pair_rows=2, warps=4, block_m=32, dkdv_row_b=True)
    with pytest.raises(ValueError, match="out_split=2"):
        tiles.BwdTile(quad_pair_rows=1, warps=4, block_m=32, dq_atomic=False, out_split=2, dkdv_row_b=True)
    assert tiles.BwdTile(quad_pair_rows=1, warps=8, block_m=32, dkdv_row_b=True).dkdv_row_b


def test_dq_from_k_needs_atomics_and_k_in_shared_memory():
    """dq_from_k reads dQ's B operand from the K tile: a tile without dQ atomics or without K in shared memory is
    refused with the reason, naming the fields."""
    with pytest.raises(ValueError, match="dq_from_k=True needs dq_atomic=True and kv_in_smem=True"):
        tiles.BwdTile(quad_pair_rows=1, warps=8, block_m=32, kv_in_smem=False, dq_from_k=True)
    with pytest.raises(ValueError, match="dq_from_k=True needs dq_atomic=True"):
        tiles.BwdTile(quad_pair_rows=1, warps=8, block_m=32, kv_in_smem=True, dq_atomic=False, dq_from_k=True)
    assert tiles.BwdTile(quad_pair_rows=1, warps=8, block_m=32, kv_in_smem=True, dq_from_k=True).dq_from_k


def test_wrong_value_types_are_refused():
    tile = tiles.FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=32)
    with pytest.raises(TypeError, match="ACCUM_F16"):
        tiles.fwd_variant(64, tile, 1, False)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="HEAD_DIM"):
        tiles.fwd_variant(True, tile, False, False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fixed"):
        templates.DECODE_KERNEL.values(tile, head_dim=64, accum_f16=False, softcap=False, dropout=True)


def test_auto_backward_accumulation_is_fp32_and_explicit_modes_pass_through():
    from volta_train.kernels import launch

    assert launch.resolve_bwd_accum("auto") == "fp32"
    assert launch.resolve_bwd_accum("fp32") == "fp32"
    assert launch.resolve_bwd_accum("fp16") == "fp16"
