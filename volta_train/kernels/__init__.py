"""The Volta flash-attention kernels: what they support, run-time compilation and launch.

The dispatcher uses this package's face only: :func:`describe`, :func:`unsupported_reason`, :func:`forward`,
:func:`backward`, :func:`forward_with_kvcache` and :func:`forward_paged_varlen`, each taking the caller's tensors at
any head_dim the kernels hold.
"""

from .decode import forward_paged_varlen, forward_with_kvcache
from .launch import backward, forward
from .support import CallDescription, describe, unsupported_reason

__all__ = ["CallDescription", "describe", "unsupported_reason", "forward", "backward", "forward_with_kvcache",
           "forward_paged_varlen"]
