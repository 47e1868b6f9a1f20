"""The daemon's errors (the control API maps them to HTTP statuses in daemon.api)."""

from __future__ import annotations


class DaemonError(Exception):
    """Base class of the daemon's errors."""


class TrainerDisabledError(DaemonError):
    """An operation needs the trainer, which is not running (models.enabled = false)."""
