"""Write a file under a temporary name and rename it into place when complete.

A reader (or a rerun after a crash) then sees either the old file or the whole new
one, never a half-written file that looks valid.
"""
import contextlib
import os


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w", encoding: str | None = "utf-8"):
    """``with atomic_write(path) as f: f.write(...)``; on an exception ``path`` is untouched."""
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temporary, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
