"""What every console script of the project shares: exit codes and one-line errors for user mistakes.

Exit codes: 0 success, 1 a correctness check failed (``offload-demo`` outside tolerance), 2 bad input
(unknown preset, invalid option, unreadable/unwritable path ...). A user mistake is printed as one line
``<prog>: error: <message>``; set ``OFFLOAD_PASSES_TRACEBACK=1`` to get the Python traceback instead.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2


class UsageError(ValueError):
    """A user mistake in a command line, a config file or an option (never a bug of ours)."""


def _user_errors() -> tuple[type[BaseException], ...]:
    errs: list[type[BaseException]] = [ValueError, OSError]
    try:
        import yaml

        errs.append(yaml.YAMLError)
    except ImportError:  # pragma: no cover - pyyaml is a dependency
        pass
    return tuple(errs)


def run_cli(prog: str, body: Callable[[], int]) -> int:
    """Run ``body``; user mistakes (``ValueError``, ``OSError``, yaml errors) become one line on stderr
    and exit code 2. Anything else is a bug and keeps its traceback."""
    try:
        return body()
    except _user_errors() as e:
        if os.environ.get("OFFLOAD_PASSES_TRACEBACK"):
            raise
        msg = " ".join(str(e).split()) or type(e).__name__
        if isinstance(e, OSError) and e.filename and str(e.filename) not in msg:
            msg = f"{msg}: {e.filename}"
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return EXIT_USAGE


def writable_dir(path: str | os.PathLike, what: str) -> Path:
    """Create ``path`` (and parents) and check a file can be written there; ``UsageError`` otherwise."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / ".offload_passes_write_probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"{what} {str(p)!r} is not a writable directory ({e.strerror or e})") from None
    return p


def writable_file(path: str | os.PathLike, what: str) -> Path:
    """Check that ``path`` is not a directory and that its folder exists and is writable (the file itself
    is written later: checking first means a long run never ends in an unwritable path)."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{what} {str(p)!r} is a directory; give a file path")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{what} {str(p)!r}: folder {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"{what} {str(p)!r} is not writable")
    return p


def finite(value: float, what: str, *, positive: bool = False) -> float:
    """A finite float (``positive``: also > 0); ``UsageError`` naming ``what`` otherwise."""
    if not math.isfinite(value) or (positive and value <= 0):
        raise UsageError(f"{what} must be a finite{' positive' if positive else ''} number, got {value}")
    return value


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line on stderr (``<prog>: error: <message>``) and
    exit code 2, like every other user mistake (argparse's own error prints the usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {' '.join(message.split())}\n")
