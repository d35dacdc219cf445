"""The MimoError family: problems the user can fix, reported without a traceback."""

from __future__ import annotations


class MimoError(Exception):
    """A user-fixable problem. The CLI prints the message and exits with status 2."""


class ConfigError(MimoError):
    """One or more problems in a configuration, each naming its key path."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class LayoutError(MimoError):
    """A parallel layout that cannot be realised (sizes that do not divide, ranks out of range)."""


class DataError(MimoError):
    """Unreadable or inconsistent input data (shards, index, tokenizer)."""


class CheckpointError(MimoError):
    """A checkpoint that is missing, incomplete or written at another layout."""


class DistributedError(MimoError):
    """A rank failed or a collective timed out; carries the failing rank's message."""


class TrainingError(MimoError):
    """A run that cannot be trusted any more (a loss or gradient norm that is not finite)."""
