"""lab/grid_tail_model.py: list scheduling against hand-worked cases."""

import grid_tail_model as model


def test_makespan_of_hand_worked_orders():
    assert model.makespan([4, 4, 4, 4], 2) == 8  # even work: the ideal
    assert model.makespan([1, 1, 1, 1, 4], 2) == 6  # the long job last: a tail of 2 past the ideal of 4
    assert model.makespan([4, 1, 1, 1, 1], 2) == 4  # longest first: the ideal


def test_causal_costs_and_orders():
    # 3 key blocks of 2 over 6 queries (block_m 1): rows 6, 4, 2; two heads
    assert model.grid_costs(6, 2, 1, 2, keys_fastest=True) == [6, 4, 2, 6, 4, 2]
    assert model.grid_costs(6, 2, 1, 2, keys_fastest=False) == [6, 6, 4, 4, 2, 2]
    assert model.grid_costs(5, 2, 4, 1, keys_fastest=True) == [8, 4, 4]  # rows rounded up to block_m


def test_heads_fastest_never_has_the_longer_tail_here():
    for seqlen, bh in ((1024, 256), (4096, 64), (2048, 7)):
        keys = model.makespan(model.grid_costs(seqlen, 96, 32, bh, True), 132)
        heads = model.makespan(model.grid_costs(seqlen, 96, 32, bh, False), 132)
        assert heads <= keys
