"""The float64 oracle every test compares against lives in volta_train.testing (the GPU check scripts use it too)."""

from volta_train.testing import FLOAT64_ATOL, FLOAT64_RTOL, naive_attention, torch_fp16_attention, visible_mask

__all__ = ["FLOAT64_ATOL", "FLOAT64_RTOL", "naive_attention", "torch_fp16_attention", "visible_mask"]
