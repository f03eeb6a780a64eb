"""The kernel templates' parameters, declared once.

``FWD_TRAITS`` and ``BWD_TRAITS`` list the template parameters of ``FwdKernelTraits`` and ``BwdKernelTraits``
(csrc/kernel_traits.cuh) in order, with their C++ type and default, the Python name their value goes by (a field of
``tiles.FwdTile`` / ``tiles.BwdTile`` or an argument of the variant) and their part of the variant name. Each kernel
built on them (``FWD_KERNEL``, ``DQ_KERNEL``, ``DECODE_KERNEL``, ``DKDV_KERNEL``) says which values it fixes and the
order of its name's parts. ``KernelTemplate.expression`` and ``.variant_name`` derive the NVRTC name expression and the
variant name from one set of values (volta_train/kernels/tiles.py builds every variant through them);
tests/kernels/test_kernel_templates.py checks the declarations against kernel_traits.cuh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

Value = int | bool


class Tile(Protocol):
    """What a variant reads of a tile (tiles.FwdTile, tiles.BwdTile, both dataclasses): its fields and its shape."""

    @property
    def quad_pair_rows(self) -> int: ...
    @property
    def block_m(self) -> int: ...
    @property
    def block_n(self) -> int: ...


@dataclass(frozen=True)
class TemplateParam:
    """One C++ template parameter: its name, type and default, where its value comes from, its part of the name."""

    cpp_name: str  # as declared in kernel_traits.cuh
    key: str  # the value's Python name: a tile field (FwdTile / BwdTile) or a variant argument
    kind: type  # int or bool
    default: Value | None = None  # the C++ default; None: the parameter has none
    # The variant name's part: a format of the values ("_d{head_dim}"), or a pair (when the value is set: true, or
    # other than the default; otherwise); "" for a parameter named by another's part.
    tag: str | tuple[str, str] = ""

    def render(self, value: Value) -> str:
        """The value as a C++ template argument; a value of the wrong type is refused."""
        if self.kind is bool:
            if not isinstance(value, bool):
                raise TypeError(f"template parameter {self.cpp_name} ({self.key}) takes a bool, got {value!r}")
            return "true" if value else "false"
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"template parameter {self.cpp_name} ({self.key}) takes an int, got {value!r}")
        return str(value)

    def name_part(self, values: Mapping[str, Value]) -> str:
        if isinstance(self.tag, str):
            return self.tag.format(**values)
        value = values[self.key]
        is_set = value != self.default if self.default is not None else bool(value)
        return self.tag[0 if is_set else 1].format(**values)


@dataclass(frozen=True)
class TraitsTemplate:
    """A traits struct of kernel_traits.cuh and its template parameters, in declaration order."""

    name: str
    params: tuple[TemplateParam, ...]

    def param(self, cpp_name: str) -> TemplateParam:
        for param in self.params:
            if param.cpp_name == cpp_name:
                return param
        raise KeyError(f"{self.name} has no template parameter {cpp_name}; it has {[p.cpp_name for p in self.params]}")

    def arguments(self, values: Mapping[str, Value]) -> str:
        """``Name<v1, v2, ...>``: every parameter's value, in order (defaults written out too)."""
        missing = [p.key for p in self.params if p.key not in values]
        if missing:
            raise ValueError(f"{self.name}: no value for {missing}")
        return f"{self.name}<{', '.join(p.render(values[p.key]) for p in self.params)}>"


FWD_TRAITS = TraitsTemplate("FwdKernelTraits", (
    TemplateParam("HEAD_DIM", "head_dim", int, tag="_d{head_dim}"),
    TemplateParam("QUAD_PAIR_ROWS", "quad_pair_rows", int, tag="_qp{quad_pair_rows}x{quad_pair_cols}"),
    TemplateParam("M_TILES", "m_tiles", int, tag="_m{block_m}"),  # named by the rows per CTA it makes
    TemplateParam("WARPS", "warps", int, tag="_w{warps}"),
    TemplateParam("BLOCK_N", "block_n", int, tag="_n{block_n}"),
    TemplateParam("ACCUM_F16", "accum_f16", bool, tag=("_f16acc", "_f32acc")),
    TemplateParam("DROPOUT", "dropout", bool, tag=("_dropout", "")),
    TemplateParam("MIN_BLOCKS_PER_SM", "min_blocks_per_sm", int, 1, tag="_occ{min_blocks_per_sm}.{min_blocks_emulated}"),
    TemplateParam("MIN_BLOCKS_EMULATED", "min_blocks_emulated", int, 1),  # in MIN_BLOCKS_PER_SM's part
    TemplateParam("Q_IN_SMEM", "q_in_smem", bool, False, tag=("_qsmem", "")),
    TemplateParam("SPLIT_MASKED_LOOP", "split_masked", bool, False, tag=("_split", "")),
    TemplateParam("SOFTCAP", "softcap", bool, False, tag=("_softcap", "")),
    TemplateParam("SPLIT_KV", "split_kv", bool, False),  # fixed per kernel (DECODE_KERNEL)
    TemplateParam("LAZY_RESCALE", "lazy_rescale", bool, False, tag=("_lazy", "")),
))

BWD_TRAITS = TraitsTemplate("BwdKernelTraits", (
    TemplateParam("HEAD_DIM", "head_dim", int, tag="_d{head_dim}"),
    # named with the keys per CTA it makes
    TemplateParam("QUAD_PAIR_ROWS", "quad_pair_rows", int, tag="_qp{quad_pair_rows}x{quad_pair_cols}_n{block_n}"),
    TemplateParam("WARPS", "warps", int, tag="_w{warps}"),
    TemplateParam("BLOCK_M", "block_m", int, tag="_m{block_m}"),
    TemplateParam("ACCUM_F16", "accum_f16", bool, tag=("_f16acc", "_f32acc")),
    TemplateParam("DROPOUT", "dropout", bool, tag=("_dropout", "")),
    TemplateParam("DQ_ATOMIC", "dq_atomic", bool, tag=("_dqatomic", "")),  # the variant's, not the tile's
    TemplateParam("KV_IN_SMEM", "kv_in_smem", bool, False, tag=("_kvsmem", "")),
    TemplateParam("MIN_BLOCKS_PER_SM", "min_blocks_per_sm", int, 1),
    TemplateParam("MIN_BLOCKS_EMULATED", "min_blocks_emulated", int, 1),
    TemplateParam("LEAN", "lean", bool, False, tag=("_lean", "")),
    TemplateParam("SOFTCAP", "softcap", bool, False, tag=("_softcap", "")),
    TemplateParam("OUT_SPLIT", "out_split", int, 1, tag=("_split{out_split}", "")),
    TemplateParam("DQ_FROM_K", "dq_from_k", bool, False, tag=("_dqk", "")),
    TemplateParam("DKDV_ROW_B", "dkdv_row_b", bool, False, tag=("_rowb", "")),
))


@dataclass(frozen=True)
class KernelTemplate:
    """A kernel template instantiated on a traits struct: ``kernel<Traits<...>>``, and how its variants are named."""

    kernel: str  # the __global__ function template
    source: str  # the csrc/ translation unit that holds it
    traits: TraitsTemplate
    prefix: str  # the variant name's start, also its meta["pass"]
    name_order: tuple[str, ...]  # the C++ parameters whose parts make the name, in the name's order
    fixed: Mapping[str, Value] = field(default_factory=dict)  # values this kernel always takes

    def values(self, tile: Tile, **arguments: Value) -> dict[str, Value]:
        """The template's values for a tile (its fields and shape) and the variant's arguments (which take precedence
        over a tile field of the same name: BwdTile.dq_atomic allows atomics, the variant's argument uses them)."""
        clash = sorted(set(arguments) & set(self.fixed))
        if clash:
            raise ValueError(f"{self.kernel}: {clash} are fixed for this kernel ({dict(self.fixed)})")
        fields = {f.name: getattr(tile, f.name) for f in dataclasses.fields(tile)}
        shape = {"block_m": tile.block_m, "block_n": tile.block_n, "quad_pair_cols": 4 // tile.quad_pair_rows}
        return {**fields, **shape, **arguments, **self.fixed}

    def expression(self, values: Mapping[str, Value]) -> str:
        """The NVRTC name expression, e.g. ``flash_fwd_kernel<FwdKernelTraits<64, 2, 1, 4, 32, ...>>``."""
        return f"{self.kernel}<{self.traits.arguments(values)}>"

    def variant_name(self, values: Mapping[str, Value]) -> str:
        return self.prefix + "".join(self.traits.param(name).name_part(values) for name in self.name_order)


_FWD_NAME = ("HEAD_DIM", "ACCUM_F16", "DROPOUT", "SOFTCAP", "QUAD_PAIR_ROWS", "M_TILES", "BLOCK_N", "WARPS",
             "MIN_BLOCKS_PER_SM", "Q_IN_SMEM", "SPLIT_MASKED_LOOP", "LAZY_RESCALE")
FWD_KERNEL = KernelTemplate("flash_fwd_kernel", "flash_fwd.cu", FWD_TRAITS, "fwd", _FWD_NAME, {"split_kv": False})
DQ_KERNEL = KernelTemplate(  # the dQ tables keep the default occupancy and a single loop: not in the name
    "flash_bwd_dq_kernel", "flash_bwd.cu", FWD_TRAITS, "bwd_dq",
    tuple(n for n in _FWD_NAME if n not in ("MIN_BLOCKS_PER_SM", "SPLIT_MASKED_LOOP", "LAZY_RESCALE")),
    {"split_kv": False, "lazy_rescale": False})
DECODE_KERNEL = KernelTemplate(  # the split-KV decoding kernel: flash_fwd_kernel without dropout, with SPLIT_KV
    "flash_fwd_kernel", "flash_fwd.cu", FWD_TRAITS, "decode", tuple(n for n in _FWD_NAME if n != "DROPOUT"),
    {"dropout": False, "split_kv": True, "lazy_rescale": False})
DKDV_KERNEL = KernelTemplate(
    "flash_bwd_dkdv_kernel", "flash_bwd.cu", BWD_TRAITS, "bwd_dkdv",
    ("HEAD_DIM", "ACCUM_F16", "DROPOUT", "SOFTCAP", "DQ_ATOMIC", "QUAD_PAIR_ROWS", "BLOCK_M", "WARPS", "KV_IN_SMEM",
     "LEAN", "OUT_SPLIT", "DQ_FROM_K", "DKDV_ROW_B"))

KERNEL_TEMPLATES = (FWD_KERNEL, DQ_KERNEL, DECODE_KERNEL, DKDV_KERNEL)
