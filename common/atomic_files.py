"""A file written beside its place and renamed in, so that a reader never sees half of it.

Two processes (two edges on one machine, two collection workers) may write the same path at once: each writes its
own side file, named by process and thread, and `os.replace` puts one whole copy in place.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def written_aside(path: Path) -> Iterator[Path]:
    """Yields a side path to write into (same folder and suffix); renamed over `path` when the block ends, removed
    if it raises."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.partial{path.suffix}")
    try:
        yield partial
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
