"""The kernels' grid order on the CPU, through a stand-in kernel: the dK/dV kernel's (launch._run_backward) key
blocks in x, or (batch, key/value head) in x for causal calls on the emulated m8n8k4, and the forward's
(launch.fill_common) query blocks or heads; either turns round where its y count passes grid y's limit. The kernels
read the order from m_blocks_fastest."""

import pytest
import torch

from volta_train.kernels import launch, tiles
from volta_train.kernels.launch import MAX_GRID_Y
from volta_train.kernels.variants import LaunchGeometry
from volta_train.options import AttentionOptions


class _FakeKernel:
    def __init__(self, block_m=64, block_n=64):
        self.geometry = LaunchGeometry(0, 256, block_m, block_n)
        self.launches = []

    def launch(self, grid, args, stream=None):
        self.launches.append((grid, args))


def _dkdv_launch(monkeypatch, *, batch, kv_heads, seqlen, causal, arch, varlen=False, block_n=64):
    fake = _FakeKernel(block_n=block_n)
    launched = []

    def kernel(variant, device):
        launched.append(variant)
        return fake

    monkeypatch.setattr(launch, "_kernel", kernel)
    monkeypatch.setattr(launch, "backward_preprocess", lambda bp, q, varlen: None)
    heads, d = 2 * kv_heads, 64
    options = AttentionOptions(softmax_scale=0.125, causal=causal)
    if varlen:
        total = batch * seqlen
        q = torch.zeros(total, heads, d, dtype=torch.float16)
        k = torch.zeros(total, kv_heads, d, dtype=torch.float16)
        cu = torch.arange(0, total + 1, seqlen, dtype=torch.int32)
        lse = torch.zeros(heads, total)
        shape = (cu, cu, seqlen, seqlen)
    else:
        q = torch.zeros(batch, seqlen, heads, d, dtype=torch.float16)
        k = torch.zeros(batch, seqlen, kv_heads, d, dtype=torch.float16)
        lse = torch.zeros(batch, heads, seqlen)
        shape = (None, None, seqlen, seqlen)
    tile = tiles.BwdTile(quad_pair_rows=1, warps=8, block_m=64)
    launch._run_backward(q, q, k, k.clone(), q, lse, *shape, options, None, tile, None, arch)
    (grid, (bp,)), *_ = fake.launches  # the dK/dV kernel's launch (atomics: no dQ kernel after it)
    return grid, bp


@pytest.mark.parametrize("causal, arch, keys_fastest", [(False, 70, True), (True, 70, True), (False, 90, True),
                                                        (True, 80, False), (True, 90, False)])
def test_grid_order_follows_causality_and_arch(causal, arch, keys_fastest, monkeypatch):
    """Causal on the emulated m8n8k4 (sm_80 and newer): (batch, kv head) fastest, every head's longest key blocks
    first; elsewhere key blocks fastest (a head's CTAs share Q and dO in L2)."""
    grid, bp = _dkdv_launch(monkeypatch, batch=3, kv_heads=5, seqlen=300, causal=causal, arch=arch)
    blocks, bh = -(-300 // 64), 3 * 5
    assert bp.num_n_blocks == blocks
    assert bp.fwd.m_blocks_fastest == int(keys_fastest)
    assert grid == ((blocks, bh) if keys_fastest else (bh, blocks))


def test_batch_times_kv_heads_past_grid_y_goes_to_x(monkeypatch):
    """8,192 packed one-block sequences x 8 key/value heads = 65,536 (one past grid y): heads in x, key blocks in y."""
    grid, bp = _dkdv_launch(monkeypatch, batch=8192, kv_heads=8, seqlen=2, causal=False, arch=70, varlen=True)
    assert 8192 * 8 == MAX_GRID_Y + 1
    assert grid == (MAX_GRID_Y + 1, 1) and bp.fwd.m_blocks_fastest == 0
    grid, bp = _dkdv_launch(monkeypatch, batch=8191, kv_heads=8, seqlen=2, causal=False, arch=70, varlen=True)
    assert grid == (1, 8191 * 8) and bp.fwd.m_blocks_fastest == 1


def test_key_blocks_past_grid_y_turn_the_causal_order_round(monkeypatch):
    """Causal on sm_90 prefers (batch, kv head) fastest; with more than 65,535 key blocks (blocks of 1 key here) the
    key blocks go to x instead."""
    fake = _FakeKernel(block_n=1)
    monkeypatch.setattr(launch, "_kernel", lambda variant, device: fake)
    monkeypatch.setattr(launch, "backward_preprocess", lambda bp, q, varlen: None)
    n = MAX_GRID_Y + 1
    q = torch.zeros(1, n, 1, 16, dtype=torch.float16)
    options = AttentionOptions(softmax_scale=0.25, causal=True)
    launch._run_backward(q, q, q, q, q, torch.zeros(1, 1, n), None, None, n, n, options, None,
                         tiles.BwdTile(quad_pair_rows=1, warps=8, block_m=64), None, 90)
    (grid, (bp,)), = fake.launches
    assert grid == (n, 1) and bp.fwd.m_blocks_fastest == 1


def test_both_counts_past_grid_y_are_refused_before_launching(monkeypatch):
    """65,536 packed sequences (one of 65,536 keys, the others empty) x 1 kv head, blocks of 1 key: neither order
    fits, and the error names both counts."""
    fake = _FakeKernel(block_n=1)
    monkeypatch.setattr(launch, "_kernel", lambda variant, device: fake)
    monkeypatch.setattr(launch, "backward_preprocess", lambda bp, q, varlen: None)
    n = MAX_GRID_Y + 1
    q = torch.zeros(n, 1, 16, dtype=torch.float16)
    cu = torch.full((n + 1,), n, dtype=torch.int32)
    cu[0] = 0
    options = AttentionOptions(softmax_scale=0.25, causal=False)
    with pytest.raises(ValueError, match=rf"^{n} key blocks and {n} batch x heads: a launch takes one of them above "
                                         rf"{MAX_GRID_Y} \(CUDA's limit on grid y\), not both"):
        launch._run_backward(q, q, q, q, q, torch.zeros(1, n), cu, cu, n, n, options, None,
                             tiles.BwdTile(quad_pair_rows=1, warps=8, block_m=64), None, 70)
    assert fake.launches == []


@pytest.mark.parametrize("causal, m_blocks, heads, fastest", [
    (False, 5, 6, True), (True, 5, 6, False),  # the preferred orders
    (False, 5, MAX_GRID_Y + 1, False), (True, MAX_GRID_Y + 1, 6, True),  # turned round at grid y's limit
])
def test_forward_grid_turns_round_at_grid_y(causal, m_blocks, heads, fastest):
    """The forward's (and decoding's) grid from fill_common: query blocks or batch x heads in x."""
    from volta_train.kernels.params import KernelParams

    rows = m_blocks  # block_m 1: one query per block
    q = torch.zeros(1, rows, heads, 8, dtype=torch.float16)
    prm = KernelParams()
    options = AttentionOptions(softmax_scale=0.25, causal=causal)
    grid = launch.fill_common(prm, q, q, q, q, torch.zeros(1, heads, rows), None, None, rows, rows, options, 1)
    assert prm.m_blocks_fastest == int(fastest)
    assert grid == ((m_blocks, heads) if fastest else (heads, m_blocks))
