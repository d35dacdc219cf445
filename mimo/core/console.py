"""Console output that survives its reader going away (``| head``, a closed terminal)."""

from __future__ import annotations

import io
import os


class ClosableStdout:
    """stdout that outlives its reader: once a write fails (`| head -1` exited, the terminal
    closed) everything goes to /dev/null, so a command finishes its work (a training run its
    checkpoint) instead of ending in a BrokenPipeError."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError:
            to_devnull(self._stream)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError:
            to_devnull(self._stream)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def to_devnull(stream) -> None:
    """Point ``stream``'s file descriptor at /dev/null (what is still buffered, and interpreter
    shutdown's flush, fail no more); a stream without one (tests' capture) is left alone."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
