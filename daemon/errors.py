"""The daemon's errors (the control API maps them to HTTP statuses in daemon.api)."""

from __future__ import annotations


class DaemonError(Exception):
    """Base class of the daemon's errors."""


class TrainerDisabledError(DaemonError):
    """An operation needs the trainer, which is not running (models.enabled = false)."""


class TrainerStandbyError(DaemonError):
    """A round was asked of a daemon whose trainer stands by (another holds the trainer lease)."""
