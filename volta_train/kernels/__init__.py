"""The Volta flash-attention kernels: what they support, run-time compilation and launch.

The dispatcher and the public face use this package's face only: :func:`describe`, :func:`unsupported_reason`,
:func:`forward`, :func:`backward`, :func:`forward_with_kvcache` and :func:`forward_paged_varlen`, each taking the
caller's tensors at any head_dim the kernels hold, and :func:`forward_head_dim` (the head_dim they run a call at).
"""

from .decode import forward_paged_varlen, forward_with_kvcache
from .head_dim import forward_head_dim
from .launch import backward, forward
from .support import CallDescription, describe, unsupported_reason

__all__ = ["CallDescription", "describe", "unsupported_reason", "forward", "backward", "forward_with_kvcache",
           "forward_paged_varlen", "forward_head_dim"]
