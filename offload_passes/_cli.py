"""What every console script of the project shares: exit codes and one-line errors for user mistakes.

Exit codes: 0 success, 1 a correctness check failed (``offload-demo`` outside tolerance), 2 bad input
(unknown preset, invalid option, unreadable/unwritable path ...). A user mistake is printed as one line
``<prog>: error: <message>``; set ``OFFLOAD_PASSES_TRACEBACK=1`` to get the Python traceback instead.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path
from typing import Callable, NoReturn, Optional, Sequence

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


def parse_ints(text: str, flag: str, lo: Optional[int] = None, hi: Optional[int] = None, *,
               many: bool = True) -> list[int]:
    """The one integer parser of the console scripts: ``text`` as comma-separated integers (``many=False``:
    exactly one), each in ``[lo, hi]`` (None: unbounded). ``UsageError`` naming ``flag``, the form and the
    limit for anything else (a float, ``nan``, an empty item, a value out of range)."""
    bound = _bound(lo, hi)
    form = "comma-separated integers" if many else "an integer"
    parts = [p.strip() for p in str(text).split(",")] if many else [str(text).strip()]
    try:
        vals = [int(p, 10) for p in parts]
    except ValueError:
        raise UsageError(f"{flag} must be {form}{bound}, got {text!r}") from None
    bad = [v for v in vals if (lo is not None and v < lo) or (hi is not None and v > hi)]
    if bad:
        raise UsageError(f"{flag} must be {form}{bound}, got {bad[0] if not many else text!r}")
    return vals


def _bound(lo: Optional[int], hi: Optional[int]) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    if lo is not None:
        return f" >= {lo}"
    return f" <= {hi}" if hi is not None else ""


def int_arg(flag: str, lo: Optional[int] = None, hi: Optional[int] = None) -> Callable[[str], int]:
    """An argparse ``type`` for one integer (:func:`parse_ints`)."""
    def parse(text: str) -> int:
        try:
            return parse_ints(text, flag, lo, hi, many=False)[0]
        except UsageError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = "int"
    return parse


def ints_arg(flag: str, lo: Optional[int] = None, hi: Optional[int] = None) -> Callable[[str], list[int]]:
    """An argparse ``type`` for comma-separated integers (:func:`parse_ints`)."""
    def parse(text: str) -> list[int]:
        try:
            return parse_ints(text, flag, lo, hi)
        except UsageError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = "ints"
    return parse


def readable_file(path: str | os.PathLike, what: str) -> Path:
    """``path`` as an existing, readable regular file; ``UsageError`` naming ``what`` otherwise (a directory,
    a FIFO or a device would hang or fail deep inside a reader)."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{what} {str(p)!r}: no such file")
    if p.is_dir():
        raise UsageError(f"{what} {str(p)!r} is a directory; give a file")
    if not p.is_file():
        raise UsageError(f"{what} {str(p)!r} is not a regular file (a FIFO, a socket or a device); give a file")
    if not os.access(p, os.R_OK):
        raise UsageError(f"{what} {str(p)!r} is not readable")
    return p


def read_config(path: str | os.PathLike, what: str, sections: Sequence[str]) -> dict:
    """A yaml config file as a mapping that holds at least one of ``sections`` at top level; ``UsageError``
    naming ``what`` for a path that is not a readable file, invalid yaml, an empty file (never a silent
    default) or a document without any of ``sections``."""
    import yaml

    p = readable_file(path, what)
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise UsageError(f"{what} {str(p)!r}: not valid yaml ({' '.join(str(e).split())})") from None
    except UnicodeDecodeError:
        raise UsageError(f"{what} {str(p)!r}: not a text (yaml) file") from None
    want = " / ".join(sections)
    if data is None or data == {}:
        raise UsageError(f"{what} {str(p)!r} is empty: a config holds {want} at top level")
    if not isinstance(data, dict):
        raise UsageError(f"{what} {str(p)!r}: the top level must be a mapping with {want}, got a "
                         f"{type(data).__name__}")
    if not any(k in data for k in sections):
        raise UsageError(f"{what} {str(p)!r} has none of the keys {want} (got {sorted(map(str, data))})")
    return data


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line on stderr (``<prog>: error: <message>``) and
    exit code 2, like every other user mistake (argparse's own error prints the usage block first)."""

    def error(self, message: str) -> NoReturn:
        msg = " ".join(message.split())
        # "argument --x: --x must be ..." (a type of this module named the flag already): once is enough
        msg = re.sub(r"^argument (\S+): \1 ", r"\1 ", msg)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {msg}\n")
