"""Errors a user can fix: the CLI prints their message on one line and exits non-zero."""


class UserError(Exception):
    """Bad input or missing artefact; the message names the problem and the fix."""
