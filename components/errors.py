"""Errors a user can cause: the CLI prints the one-line message and exits non-zero (traceback only with --debug)."""


class RecipeError(Exception):
    """A user-facing error; its message names the culprit (config key, file:line, path or value)."""
