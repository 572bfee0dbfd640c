"""The errors every floor shares: a checkpoint (or a GPU step of one) failed, or was refused.

They live below everything so that the GPU layer (:mod:`jupyterhub_gpusnap.gpu`) can raise
them without importing the checkpoint backends; :mod:`jupyterhub_gpusnap.checkpoint.base`
makes them part of the backends' contract.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint or restore failed. The message says what happened and what to do."""


class CheckpointRefused(CheckpointError):
    """The backend will not try (CRIU missing, disk short, GPU busy, …). Nothing was changed.

    ``retry`` is True when the reason is passing (a busy GPU): try again on a later tick.
    """

    def __init__(self, message: str, retry: bool = False):
        super().__init__(message)
        self.retry = retry
