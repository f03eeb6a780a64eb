"""The dK/dV kernel's grid order (launch._run_backward) on the CPU through a stand-in kernel: key blocks in x, or
(batch, key/value head) in x for causal calls on the emulated m8n8k4 and wherever batch x kv heads passes grid y's
limit; the kernel reads the order from m_blocks_fastest (csrc/flash_bwd_kernel.cuh)."""

import pytest
import torch

from volta_train.kernels import launch, tiles
from volta_train.kernels.support import MAX_GRID_Y
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


def test_key_blocks_past_grid_y_are_refused_before_launching(monkeypatch):
    """With batch x kv heads in x the key blocks go to y: more than 65,535 of them is an error naming the count."""
    fake = _FakeKernel(block_n=1)
    monkeypatch.setattr(launch, "_kernel", lambda variant, device: fake)
    monkeypatch.setattr(launch, "backward_preprocess", lambda bp, q, varlen: None)
    n = MAX_GRID_Y + 1
    q = torch.zeros(1, n, 1, 16, dtype=torch.float16)
    options = AttentionOptions(softmax_scale=0.25, causal=True)
    with pytest.raises(ValueError, match=rf"{n} key blocks of 1: the dK/dV kernel's grid takes at most {MAX_GRID_Y}"):
        launch._run_backward(q, q, q, q, q, torch.zeros(1, 1, n), None, None, n, n, options, None,
                             tiles.BwdTile(quad_pair_rows=1, warps=8, block_m=64), None, 90)
    assert fake.launches == []
