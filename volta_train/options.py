"""The options of one attention call, shared by both backends: the reference (``volta_train.reference``) and
the Volta kernels (``volta_train.kernels.launch``, which turns them into the kernels' ``KernelParams``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionOptions:
    """Everything but the tensors that defines one attention call."""

    softmax_scale: float
    causal: bool = False
    window_left: int = -1  # -1: unbounded
    window_right: int = -1  # -1: unbounded (causal forces 0)
    dropout_p: float = 0.0
    seed: int = 0
    offset: int = 0
    softcap: float = 0.0  # 0: off; > 0: scores become softcap * tanh(scores / softcap)

    @property
    def right_limit(self) -> int:
        return 0 if self.causal else self.window_right
