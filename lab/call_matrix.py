"""Call matrices of the test and lab tools: the launcher calls that reach every shipped variant of a tile table.

``table_calls`` gives the forward and backward calls (volta_train/kernels/launch.py), ``decode_calls`` the
flash_attn_with_kvcache calls (volta_train/kernels/decode.py); each :class:`TableCall` names the kernel variants it
launches. lab/sanitize_kernels.py and lab/smem_conflicts.py run them; lab/tests check that they reach exactly the
shipped variants.
"""

from __future__ import annotations

from dataclasses import dataclass

from volta_train.kernels.nvrtc import normalize_arch
from volta_train.kernels.tiles import (SOFTCAP_CHOICES, SUPPORTED_HEAD_DIMS, BwdTile, FwdTile, bwd_kernel_head_dim,
                                       bwd_tile, bwd_variant, combine_variant, decode_tile, decode_variant,
                                       dq_by_atomics, dq_tile, dq_variant, fwd_tile, fwd_variant,
                                       preprocess_variant)
from volta_train.kernels.variants import KernelVariant

TILE_TABLES = ("default", "sm70")


@dataclass(frozen=True)
class TableCall:
    """One forward or backward call of the launchers (volta_train/kernels/launch.py) and the kernel variants it
    launches, in launch order.

    Table ``"sm70"``: the V100 tables, reached on any GPU through the launchers' tile overrides; table ``"default"``:
    the tables of the GPU's own arch, chosen by the launchers themselves (no overrides).
    """

    table: str
    pass_name: str  # "fwd", "bwd" or "decode" (decode_calls)
    head_dim: int
    causal: bool
    accum: str  # the forward's accum or the backward's bwd_accum: "fp32" or "fp16"
    dropout: bool
    deterministic: bool  # backward only
    tile: FwdTile | BwdTile
    dq_tile: FwdTile | None  # backward only: the dQ kernel's tile
    launches: tuple[KernelVariant, ...]
    softcap: bool = False  # the variants built with logit soft-capping (run them with softcap > 0)
    kernel_head_dim: int | None = None  # backward: the kernels' head_dim where it is larger (inputs zero-padded)

    @property
    def name(self) -> str:
        """Unique within one table_calls() list; letters, digits and '_' only (an NVTX range name)."""
        mode = ("_det" if self.deterministic else "_nondet") if self.pass_name == "bwd" else ""
        return (f"{self.table}_{self.pass_name}_d{self.head_dim}_{'causal' if self.causal else 'full'}_{self.accum}"
                f"{'_dropout' if self.dropout else ''}{'_softcap' if self.softcap else ''}{mode}")

    @property
    def overrides(self) -> dict:
        """Keyword arguments for launch.forward / launch.backward: the tiles of table "sm70", none for "default"."""
        if self.table == "default":
            return {}
        if self.pass_name in ("fwd", "decode"):  # launch.forward, decode.forward_with_kvcache
            return {"tile": self.tile}
        padded = {"kernel_head_dim": self.kernel_head_dim} if self.kernel_head_dim else {}
        return {"tile": self.tile, "dq_tile": self.dq_tile, **padded}


def table_calls(table: str, arch: int, head_dims=SUPPORTED_HEAD_DIMS, causal=(False, True), dropout=(False, True),
                accums=("fp32", "fp16"), passes=("fwd", "bwd"), unique: bool = False,
                softcap=SOFTCAP_CHOICES) -> list[TableCall]:
    """The calls that launch the shipped variants of table on a GPU of arch: per head_dim, mask and dropout, the
    forward in each accumulation mode, then the backward in each mode, dQ by atomics and deterministic.

    With every argument at its default the calls launch every variant of ``shipped_fwd_variants``,
    ``shipped_bwd_variants`` and ``shipped_preprocess_variants`` (each backward starts with its preprocess) of the
    table's arch (70 for "sm70", else arch). ``unique`` drops the calls that
    launch no variant an earlier call did not (the causal calls of a table whose causal tile is the full one, the
    "non-deterministic" backward of a tile without atomics), and the backward calls of a head_dim that runs the
    kernels of a larger one (``kernel_head_dim``: sm_70 d112) when that one is among ``head_dims``.
    """
    if table not in TILE_TABLES:
        raise ValueError(f"table {table!r}; accepted: {', '.join(TILE_TABLES)}")
    table_arch = 70 if table == "sm70" else normalize_arch(arch)
    calls, seen = [], set()
    for cap in softcap:
        for head_dim in head_dims:
            for is_causal in causal:
                for has_dropout in dropout:
                    if "fwd" in passes:
                        tile = fwd_tile(head_dim, is_causal, table_arch)
                        for accum in accums:
                            variant = fwd_variant(head_dim, tile, accum == "fp16", has_dropout, cap)
                            calls.append(TableCall(table, "fwd", head_dim, is_causal, accum, has_dropout, False, tile,
                                                   None, (variant,), cap))
                    if "bwd" in passes:
                        kernel_d = bwd_kernel_head_dim(head_dim, table_arch)
                        q_tile = dq_tile(kernel_d, table_arch)
                        for accum in accums:
                            tile = bwd_tile(kernel_d, table_arch, accum == "fp16")
                            for deterministic in (False, True):
                                atomics = dq_by_atomics(tile, deterministic)
                                launches = (preprocess_variant(kernel_d),
                                            bwd_variant(kernel_d, tile, accum == "fp16", has_dropout, atomics, cap))
                                if not atomics:
                                    launches += (dq_variant(kernel_d, q_tile, False, has_dropout, cap),)
                                calls.append(TableCall(table, "bwd", head_dim, is_causal, accum, has_dropout,
                                                       deterministic, tile, q_tile, launches, cap,
                                                       kernel_d if kernel_d != head_dim else None))
    if unique:
        kept = []
        for call in calls:
            if call.kernel_head_dim in head_dims:
                continue  # its kernels are launched by the calls of their own head_dim
            keys = {_variant_key(v) for v in call.launches}
            if keys - seen:
                kept.append(call)
                seen |= keys
        calls = kept
    return calls


def decode_calls(table: str, arch: int, head_dims=SUPPORTED_HEAD_DIMS, softcap=SOFTCAP_CHOICES) -> list[TableCall]:
    """The flash_attn_with_kvcache calls (volta_train/kernels/decode.py forward_with_kvcache) that launch every
    shipped decoding variant of table on a GPU of arch: one per head_dim and soft-capping setting (fp32 accumulation,
    no dropout; ``causal`` False, for the caller to set), each with the split combine that follows the kernel when
    the call splits the keys."""
    if table not in TILE_TABLES:
        raise ValueError(f"table {table!r}; accepted: {', '.join(TILE_TABLES)}")
    table_arch = 70 if table == "sm70" else normalize_arch(arch)
    calls = []
    for cap in softcap:
        for head_dim in head_dims:
            tile = decode_tile(head_dim, table_arch)
            calls.append(TableCall(table, "decode", head_dim, False, "fp32", False, False, tile, None,
                                   (decode_variant(head_dim, tile, cap), combine_variant(head_dim)), cap))
    return calls


def _variant_key(variant: KernelVariant) -> tuple:
    return variant.name, variant.name_expressions
