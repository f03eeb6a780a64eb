"""The Volta flash-attention kernels: support checks, run-time compilation and launch.

The dispatcher only uses this package's façade: :class:`CallDescription`,
:func:`unsupported_reason`, :func:`forward` and :func:`backward`.
"""

from . import support
from .support import CallDescription, unsupported_reason
from .launch import backward, forward

__all__ = ["CallDescription", "unsupported_reason", "forward", "backward"]
