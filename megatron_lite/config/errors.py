"""The errors a user's input raises: printed as one ``error:`` line, never a traceback."""


class UserError(Exception):
    """A problem with the user's input (flags, files, checkpoints), not a bug.

    Its message names the problem and the fix, so the commands print it once as
    ``error: ...`` and exit 2 without a traceback; any other exception is a bug and
    keeps its traceback (``process_groups.failures.run_command``).
    """


class ConfigError(UserError, ValueError):
    """A configuration value is invalid; the message names the flag and the fix."""
