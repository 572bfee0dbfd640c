"""Signal sources: each says what it knows about a server's activity as a partial Sample."""

from .base import SignalSource

__all__ = ["SignalSource"]
