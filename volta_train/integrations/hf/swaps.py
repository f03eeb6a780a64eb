"""Attention modules that compute attention themselves, and the classes patch() gives them so that they run volta_train.

Two kinds, found by :func:`~.families.own_attention_modules`:

* Modules with a flash-attention class of transformers' own (GPT-Neo, and Falcon up to 5.24: ``FalconFlashAttention2``,
  ``GPTNeoFlashAttention2``, which a model picks at construction for ``attn_implementation="flash_attention_2"``;
  same weights as the module's class). The module gets a subclass of that flash class whose
  ``_flash_attention_forward`` is :func:`.attention.flash_attention_forward`; the rest of its forward (projections,
  rotary, caches) is transformers' code, run unchanged. transformers' own ``_flash_attention_forward`` is not used: it
  finds flash-attn through availability checks that require a CUDA device (and the modeling files import it only
  where those pass), which would leave out the CPU reference backend, and it reads module-level state shared by every
  model of the process.
* PEGASUS-X's encoder attention (``PegasusXGlobalLocalAttention``: global tokens attend to everything, each block of
  tokens to the global tokens and itself), which transformers computes with einsums in every implementation: its two
  attention products become two varlen calls with a key padding mask.

A swap assigns ``module.__class__``: parameters, buffers, hooks and optimizer references stay as they are.
:func:`restore` (``unpatch()``) puts each module's class back. A swapped module pickles (``torch.save(model)``,
``copy.deepcopy``) by the function that made its class, which a load in another process calls again.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any

import torch
from torch import nn

from . import base
from .attention import _varlen_attention, flash_attention_forward
from .families import FLASH_FUNCTION, SWAPPED, family_of, flash_class_of, own_attention_modules


def _rebuilt_forward(flash_cls: type, bound: Any) -> types.FunctionType:
    """flash_cls.forward with ``_flash_attention_forward`` resolving to ``bound``: a copy of the function over a copy of
    its module's globals (transformers' module is not changed)."""
    forward = vars(flash_cls)["forward"]
    if hasattr(forward, "__wrapped__") or not isinstance(forward, types.FunctionType):
        raise NotImplementedError(
            f"{flash_cls.__qualname__}.forward is wrapped by a decorator in transformers "
            f"{base.installed_transformers()}; volta_train runs transformers' flash-attention classes whose forward is "
            "a plain function. Use attn_implementation='sdpa' or 'eager'"
        )
    namespace = dict(forward.__globals__)
    namespace[FLASH_FUNCTION] = bound
    rebuilt = types.FunctionType(forward.__code__, namespace, forward.__name__, forward.__defaults__,
                                 forward.__closure__)
    rebuilt.__kwdefaults__ = forward.__kwdefaults__
    rebuilt.__qualname__, rebuilt.__doc__ = forward.__qualname__, forward.__doc__
    return rebuilt


_MADE_BY = "_volta_made_by"  # (the function that made a swapped class, its arguments): how pickle rebuilds it


def _reduce_swapped(self, protocol):
    """Pickle (and copy) a swapped module through the function that made its class: the class exists only at run
    time, so pickle could not find it by name."""
    return _rebuild_swapped, getattr(type(self), _MADE_BY), self.__getstate__()


def _rebuild_swapped(make, args):
    cls = make(*args)
    return cls.__new__(cls)


@functools.lru_cache(maxsize=None)
def _flash_class(flash_cls: type, original: type, model_type: str, window: int | None) -> type:
    bound = functools.partial(flash_attention_forward, volta_model_type=model_type, volta_window=window)
    return type(f"{flash_cls.__name__}OnVoltaTrain", (flash_cls,), {
        "forward": _rebuilt_forward(flash_cls, bound),
        SWAPPED: original,
        _MADE_BY: (_flash_class, (flash_cls, original, model_type, window)),
        "__reduce_ex__": _reduce_swapped,
        "__module__": __name__,
        "__doc__": f"transformers' {flash_cls.__name__} with volta_train as its flash-attention function.",
    })


# ---- PEGASUS-X's global-local encoder attention ---------------------------------------------------------------

_GLOBAL_ARGS = ["self", "global_q", "global_k", "global_v", "local_k", "local_v", "mask", "dim"]
_LOCAL_ARGS = ["self", "global_k", "global_v", "local_q", "local_k", "local_v", "mask", "dim"]


def _options(module: nn.Module) -> dict[str, Any]:
    # q comes already multiplied by module.scaling; eager applies dropout to the probabilities in training only
    return {"dropout_p": float(module.dropout) if module.training else 0.0, "softmax_scale": 1.0, "causal": False,
            "deterministic": False}


def _keys_kept(mask: torch.Tensor) -> torch.Tensor:
    # PegasusXEncoder's additive mask: 0 at tokens, the dtype's minimum at padding (and at its block padding)
    return mask == 0


def _global_attention(self, global_q, global_k, global_v, local_k, local_v, mask, dim):
    """Global tokens attend to every global and token key: one varlen call. [b, h, g, f] -> ([b, h, g, f], None)."""
    keys = torch.cat([global_k, local_k], dim=2).transpose(1, 2)
    values = torch.cat([global_v, local_v], dim=2).transpose(1, 2)
    kept = torch.cat([torch.ones_like(mask[:, : dim.global_len], dtype=torch.bool), _keys_kept(mask)], dim=1)
    out = _varlen_attention(global_q.transpose(1, 2), keys, values, kept, True, _options(self))
    return out.transpose(1, 2), None


def _local_attention(self, global_k, global_v, local_q, local_k, local_v, mask, dim):
    """Each block of tokens attends to the global tokens and to its own block: one varlen call over batch x blocks.
    -> ([b, h, blocks, block_size, f], None)."""
    batch, blocks, size = dim.batch_size, dim.num_blocks, dim.block_size
    heads, features = dim.num_heads, dim.dim_per_head

    def blocked(x: torch.Tensor) -> torch.Tensor:  # [b, h, s, f] -> [b, blocks, size, h, f]
        return x.view(batch, heads, blocks, size, features).permute(0, 2, 3, 1, 4)

    def per_block(x: torch.Tensor) -> torch.Tensor:  # [b, h, g, f] -> [b, blocks, g, h, f]
        return x.transpose(1, 2).unsqueeze(1).expand(batch, blocks, *x.shape[2:3], heads, features)

    queries = blocked(local_q).reshape(batch * blocks, size, heads, features)
    keys = torch.cat([per_block(global_k), blocked(local_k)], dim=2).reshape(batch * blocks, -1, heads, features)
    values = torch.cat([per_block(global_v), blocked(local_v)], dim=2).reshape(batch * blocks, -1, heads, features)
    kept = torch.cat([
        torch.ones(batch, blocks, dim.global_len, dtype=torch.bool, device=mask.device),
        _keys_kept(mask).view(batch, blocks, size),
    ], dim=2).reshape(batch * blocks, -1)
    out = _varlen_attention(queries, keys, values, kept, True, _options(self))
    return out.view(batch, blocks, size, heads, features).permute(0, 3, 1, 2, 4), None


def _check_signature(cls: type, name: str, expected: list[str]) -> None:
    method = getattr(cls, name, None)
    found = list(inspect.signature(method).parameters) if method is not None else None
    if found != expected:
        raise NotImplementedError(
            f"pegasus_x: {cls.__name__}.{name} takes {found} in transformers {base.installed_transformers()}, not "
            f"{expected}: volta_train replaces that method and would compute something else. Use "
            "attn_implementation='sdpa' or 'eager'"
        )


@functools.lru_cache(maxsize=None)
def _global_local_class(original: type) -> type:
    _check_signature(original, "compute_global_attention_representations", _GLOBAL_ARGS)
    _check_signature(original, "compute_local_attention_representations", _LOCAL_ARGS)
    return type(f"{original.__name__}OnVoltaTrain", (original,), {
        "compute_global_attention_representations": _global_attention,
        "compute_local_attention_representations": _local_attention,
        SWAPPED: original,
        _MADE_BY: (_global_local_class, (original,)),
        "__reduce_ex__": _reduce_swapped,
        "__module__": __name__,
        "__doc__": f"transformers' {original.__name__} with its two attention products on volta_train.",
    })


# ---- swap and restore -----------------------------------------------------------------------------------------


def swapped_class(module: nn.Module, model_type: Any) -> type:
    """The class :func:`swap` gives ``module`` (one of :func:`~.families.own_attention_modules`)."""
    cls = type(module)
    flash_cls = flash_class_of(cls)
    if flash_cls is not None:
        owner = getattr(getattr(module, "config", None), "model_type", None) or model_type
        return _flash_class(flash_cls, cls, owner, family_of(owner).own_window(module))
    return _global_local_class(cls)


_TOP_LEFT = "_flash_attn_uses_top_left_mask"  # set by transformers' flash classes in __init__: flash-attn < 2.1's
# top-left causal alignment; volta_train's causal masks are bottom-right aligned, as flash-attn's since 2.1
_ABSENT = object()


def swap(model: nn.Module, model_type: Any) -> list[tuple[nn.Module, type, Any]]:
    """Give every module of ``model`` that computes attention itself its volta_train class; returns what
    :func:`restore` needs. Modules swapped already are left as they are."""
    targets = [m for m in own_attention_modules(model) if getattr(type(m), SWAPPED, None) is None]
    classes = [swapped_class(module, model_type) for module in targets]  # every check before the first change
    changed = []
    for module, cls in zip(targets, classes):
        changed.append((module, type(module), vars(module).get(_TOP_LEFT, _ABSENT)))
        module.__class__ = cls
        if flash_class_of(getattr(cls, SWAPPED)) is not None:
            module._flash_attn_uses_top_left_mask = False
    return changed


def restore(changed: list[tuple[nn.Module, type, Any]]) -> None:
    """Undo :func:`swap`."""
    for module, cls, top_left in changed:
        module.__class__ = cls
        if top_left is _ABSENT:
            vars(module).pop(_TOP_LEFT, None)
        else:
            setattr(module, _TOP_LEFT, top_left)
