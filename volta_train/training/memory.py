"""The memory features of both recipes, as one YAML section ``memory`` (flags ``--memory.x``).

Gradient checkpointing, the tiled MLP (:mod:`.tiled_mlp`), the lean RMSNorm (:mod:`.rms_norm`), the host offload
of checkpointed hidden states (:mod:`.activation_offload`) and the chunked loss (:mod:`.chunked_loss`): their options
(:class:`MemoryConfig`), the combinations refused before a run starts (:func:`check`), and what the recipes call
once the model is built (:func:`apply`) and once it is wrapped (:func:`loss_mode`). The features themselves live in
their own modules.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from . import activation_offload, chunked_loss, rms_norm, tiled_mlp
from .config import ConfigError, field, section

log = logging.getLogger(__name__)



@dataclass
class MemoryConfig:
    gradient_checkpointing: bool = field(False, "recompute block activations in the backward (long sequences)")
    activation_offload: bool = field(False, "keep the hidden states kept by gradient checkpointing in host memory "
                                            "between forward and backward (volta_train/training/activation_offload.py;"
                                            " needs gradient_checkpointing)")
    activation_offload_keep: int = field(0, "with activation_offload: the top N blocks keep their checkpointed inputs "
                                            "on the GPU (less host memory for spare GPU memory)")
    tiled_mlp: str = field("auto", "MLP over tiles of the sequence, recomputed per tile in the backward "
                                   "(volta_train/training/tiled_mlp.py); auto: on from the length where a micro-batch's "
                                   "MLP activations on one process reach 2 GiB (quote on/off in YAML)",
                           choices=["auto", "on", "off"])
    tiled_mlp_tokens: int | None = field(None, "tokens per tile of the tiled MLP (auto: ~256 MiB of activations)")
    lean_norm: str = field("auto", "RMSNorm that saves only its input and per-row scale and runs its backward over "
                                   "chunks of rows (volta_train/training/rms_norm.py); auto: on where the tiled MLP is "
                                   "(quote on/off in YAML)", choices=["auto", "on", "off"])
    chunked_loss: bool = field(True, "causal LM: loss over chunks of tokens, never the whole [tokens, vocab] logits "
                                     "(volta_train/training/chunked_loss.py); false: the model's own loss")
    loss_chunk_tokens: int | None = field(None, "tokens per chunk of the chunked loss (auto: 1 GiB of fp32 logits)")


def config_section():
    """The `memory` section as a field of a recipe's configuration (both recipes embed it)."""
    return section(MemoryConfig, "memory features: checkpointing, tiled MLP, lean RMSNorm, activation offload, "
                                 "chunked loss")


def check(m: MemoryConfig) -> None:
    """Refuse what cannot work, naming the options (``memory.x``) and what would be accepted."""
    if m.activation_offload and not m.gradient_checkpointing:
        raise ConfigError("memory.activation_offload moves what gradient checkpointing keeps, and "
                          "memory.gradient_checkpointing is off: set memory.gradient_checkpointing: true, or "
                          "memory.activation_offload: false")
    if m.activation_offload_keep < 0:
        raise ConfigError(f"memory.activation_offload_keep must be >= 0 (blocks kept on the GPU), got "
                          f"{m.activation_offload_keep}")
    for name in ("tiled_mlp_tokens", "loss_chunk_tokens"):
        value = getattr(m, name)
        if value is not None and value <= 0:
            raise ConfigError(f"memory.{name} must be positive (or unset: auto), got {value}")


def tokens_per_process(batch_size: int, seq_len: int, sequence_parallel_size: int = 1) -> int:
    """Tokens one process holds per micro-batch: its shard of each of ``batch_size`` sequences."""
    return batch_size * -(-seq_len // sequence_parallel_size)


def apply(model, m: MemoryConfig, tokens: int) -> None:
    """Turn the features on in a built (not yet wrapped) model, ``tokens`` being what one process holds per
    micro-batch (:func:`tokens_per_process`); each logs one line. A feature that does not fit the model is a
    ConfigError naming its option."""
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        tiled = tiled_mlp.configure(model, m.tiled_mlp, tokens, m.tiled_mlp_tokens)
    except tiled_mlp.TiledMLPError as e:
        raise ConfigError(f"memory.tiled_mlp: {e}") from None
    rms_norm.configure(model, m.lean_norm, bool(tiled))
    if m.activation_offload:
        try:
            activation_offload.enable(model, keep_last=m.activation_offload_keep)
        except activation_offload.ActivationOffloadError as e:
            raise ConfigError(f"memory.activation_offload_keep: {e}") from None


def loss_mode(m: MemoryConfig, model, causal: bool = True) -> bool:
    """Whether the causal LM's loss runs chunked (memory.chunked_loss, where the model allows it), logged once;
    False for other tasks."""
    if not causal:
        return False
    chunked, note = chunked_loss.resolve(m.chunked_loss, model, m.loss_chunk_tokens)
    log.info("%s", note)
    return chunked
