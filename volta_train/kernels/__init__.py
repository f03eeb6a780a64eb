"""The Volta flash-attention kernels: support checks, run-time compilation and launch.

The dispatcher only uses this package's façade: :class:`CallDescription`,
:func:`unsupported_reason`, :func:`forward`, :func:`backward` and :func:`forward_with_kvcache`.
"""

from . import support
from .support import CallDescription, unsupported_reason
from .launch import backward, forward
from .decode import forward_with_kvcache

__all__ = ["CallDescription", "unsupported_reason", "forward", "backward", "forward_with_kvcache"]
