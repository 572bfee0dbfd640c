"""Checkpoint backends: how a server's memory (CPU and GPU) is saved and brought back."""

from .base import CheckpointBackend, CheckpointError, CheckpointInfo, CheckpointRefused

__all__ = ["CheckpointBackend", "CheckpointError", "CheckpointInfo", "CheckpointRefused"]
