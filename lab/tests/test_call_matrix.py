"""lab/call_matrix.py: the calls of the lab tools reach the shipped variants with the package's own overrides."""

import pytest

from volta_train.kernels import tiles

import call_matrix


@pytest.mark.parametrize("accum", ["fp32", "fp16"])
def test_backward_overrides_are_the_sm70_table_calls(accum):
    # tiles.backward_overrides (the tests' and sweeps' tile override) and the table calls' overrides agree, per head_dim
    for head_dim in tiles.SUPPORTED_HEAD_DIMS:
        chosen = tiles.backward_overrides(head_dim, 70, accum == "fp16")
        assert chosen.get("kernel_head_dim") == tiles.BWD_KERNEL_HEAD_DIMS_SM70.get(head_dim)  # d80 on 96, d112 on 128
        for call in call_matrix.table_calls("sm70", 90, head_dims=(head_dim,), causal=(False,), dropout=(False,),
                                            accums=(accum,), passes=("bwd",), softcap=(False,)):
            assert call.overrides == chosen, (head_dim, call.name)


@pytest.mark.parametrize("arch", [70, 90])
def test_decode_calls_launch_every_decoding_variant_and_its_combine(arch):
    calls = call_matrix.decode_calls("sm70", arch) + call_matrix.decode_calls("default", arch)
    combines = {v.name for v in tiles.shipped_combine_variants()}  # each call's kernel, then its split combine
    assert all(c.launches[1] == tiles.combine_variant(c.head_dim) for c in calls)
    assert {v.name for c in calls for v in c.launches} == \
        {v.name for table_arch in {70, arch} for v in tiles.shipped_decode_variants(table_arch)} | combines
    assert all(c.overrides == ({"tile": c.tile} if c.table == "sm70" else {}) for c in calls)
