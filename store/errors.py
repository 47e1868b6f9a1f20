"""Exceptions raised by ``store``. Every message names the offending value and the fix.

Hierarchy::

    StoreError
    ├── RedisVersionError        server older than 6.2 (no XAUTOCLAIM)
    ├── StoreUnavailableError    Redis unreachable (connection refused, timeout)
    ├── SchemaError (schema.py)  an entry cannot be decoded into a VerifiedSample (also a ValueError)
    └── RegistryError
        ├── UnknownVersionError  no adapter with that version
        ├── InvalidTransitionError  e.g. promoting a rejected adapter
        │   └── ArtifactInvalidError   promoting an adapter whose files fail the check
        ├── ArtifactMissingError    neither the local directory nor the Redis bytes exist
        └── IntegrityError          sha256 of an artifact file differs from the recorded one
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every error raised by ``store``."""


class RedisVersionError(StoreError):
    """The Redis server is older than the minimum ``store`` needs (6.2, for XAUTOCLAIM)."""


class StoreUnavailableError(StoreError):
    """Redis could not be reached; the cause is chained. Callers may retry."""


class RegistryError(StoreError):
    """Base class of adapter registry errors."""


class UnknownVersionError(RegistryError):
    """No adapter is registered under the requested version."""


class InvalidTransitionError(RegistryError):
    """The requested state change is not allowed from the adapter's current state."""


class ArtifactInvalidError(InvalidTransitionError):
    """Promotion (or a rollback's target) refused: the artifact is missing, corrupt, not loadable or not finite."""


class ArtifactMissingError(RegistryError):
    """The adapter's files are neither in the artifact directory nor stored in Redis."""


class IntegrityError(RegistryError):
    """An artifact file's sha256 differs from the one recorded at registration."""


class FencedError(RegistryError):
    """A registry write carried a fencing token older than one the registry has seen: the writer
    lost its lease (store.lease) to a newer holder and must stop writing."""
