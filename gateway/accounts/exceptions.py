"""Failures of the admin operations (orgs, keys), kept apart from request-path ApiErrors.

Admin code (the CLI, a future console) shows these to an operator; the request path never sees them.
"""

from __future__ import annotations


class AccountsError(Exception):
    """Base class: a refused admin operation, with a message fit for an operator."""


class NotFound(AccountsError, LookupError):
    """The named organization or key does not exist."""


class AlreadyExists(AccountsError, ValueError):
    """An organization with that name already exists."""
