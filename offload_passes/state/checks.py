"""Argument checks of the state's public calls: what an announcement takes as rows (:func:`row_indices`),
flags, and the text that names the batch sizes a row count is checked against."""
from __future__ import annotations

import numbers
from typing import Any, Optional, Sequence

import torch

#: what an announcement takes as row indices (``row_indices``)
ROW_FORMS = "a list, tuple or range of ints, or a 1-D integer tensor or numpy array (any device)"


def row_indices(value: Any, where: str, arg: str, lo: int, hi: Optional[int], limit: str,
                sets: bool = True) -> list[int]:
    """``value`` as a list of ints, each in ``[lo, hi)`` (``hi`` None: no upper limit known yet).

    Accepted: a list, tuple or range of Python / numpy ints (and, with ``sets``, a set: order-free row
    lists), a 1-D integer tensor on any real device (strided layout), a 1-D integer numpy array. Refused
    with a ``TypeError`` naming ``where``, ``arg``, the accepted forms and the limit: a bool mask (a mask is
    not a row list), floats (a float is not an index, 2.0 and NaN included), strings, mappings, iterators
    and generators (they cannot be checked without being consumed), scalars, None, a meta or sparse
    tensor (no values to read). ``ValueError``: a tensor or array that is not 1-D, an entry outside
    ``[lo, hi)`` (the message carries ``limit``, what the bound is)."""
    forms = ROW_FORMS.replace("list, tuple or range of ints", "list, tuple, range or set of ints") if sets \
        else ROW_FORMS
    bound = f"[{lo}, {hi})" if hi is not None else f">= {lo}"

    def refuse(what: str) -> TypeError:
        return TypeError(f"{where}: {arg} must be {forms}, each in {bound} ({limit}); got {what}")

    if isinstance(value, torch.Tensor):
        items = _tensor_items(value, where, arg, refuse)
    elif type(value).__module__ == "numpy":
        items = _array_items(value, where, arg, refuse)
    elif isinstance(value, (list, tuple, range)) or (sets and isinstance(value, (set, frozenset))):
        items = _sequence_items(value, refuse)
    else:
        raise refuse(_describe(value))
    bad = [x for x in items if x < lo or (hi is not None and x >= hi)]
    if bad:
        raise ValueError(f"{where}: {arg} entries must be in {bound} ({limit}), got {bad}")
    return items


#: the tensor dtypes a row list may have (quantized and bit dtypes are not indices)
_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)

_MASK_HINT = "a mask is not a row list: pass its row indices, e.g. mask.nonzero().flatten()"


def _tensor_items(t: torch.Tensor, where: str, arg: str, refuse: Any) -> list[int]:
    """A tensor's entries, after checks that it has values (not meta, not sparse) of an integer dtype."""
    if t.layout != torch.strided:
        raise refuse(f"a {t.layout} Tensor (a row list is a dense tensor: pass t.to_dense())")
    if t.device.type == "meta":
        raise refuse("a meta Tensor (it holds no values)")
    if t.dtype == torch.bool:
        raise refuse(f"a bool mask Tensor of shape {list(t.shape)} ({_MASK_HINT})")
    if t.dtype not in _INT_DTYPES:
        raise refuse(f"a Tensor of dtype {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{where}: {arg} must be 1-D (one entry per row), got shape {list(t.shape)}")
    return [int(x) for x in t.tolist()]


def _array_items(a: Any, where: str, arg: str, refuse: Any) -> list[int]:
    """A numpy array's entries (a numpy scalar is refused as not 1-D: one row is ``[x]``)."""
    dt = getattr(a, "dtype", None)
    if dt is None or getattr(a, "ndim", None) is None:
        raise refuse(f"{type(a).__name__} {a!r}")
    if str(dt) == "bool":
        raise refuse(f"a bool mask ndarray of shape {list(a.shape)} ({_MASK_HINT})")
    if not str(dt).startswith(("int", "uint")):
        raise refuse(f"a {type(a).__name__} of dtype {dt}")
    if a.ndim != 1:
        raise ValueError(f"{where}: {arg} must be 1-D (one entry per row), got shape {list(a.shape)}")
    return [int(x) for x in a.tolist()]


def _sequence_items(value: Any, refuse: Any) -> list[int]:
    """A list / tuple / range / set's entries, each a Python or numpy int (a bool is refused: no mask)."""
    items = []
    for x in value:
        if isinstance(x, bool) or type(x).__name__ in ("bool_", "bool"):
            raise refuse(f"{type(value).__name__} holding the bool {x!r} (a mask is not a row list: pass its "
                         f"row indices)")
        if not isinstance(x, numbers.Integral):
            raise refuse(f"{type(value).__name__} holding {type(x).__name__} {x!r}")
        items.append(int(x))
    return items


def _describe(value: Any) -> str:
    """What a refused row list is, for the message (a single int: the list it should have been)."""
    what = type(value).__name__
    if isinstance(value, (int, float, str, bytes)) or value is None:
        what += f" {value!r}"
        if isinstance(value, int) and not isinstance(value, bool):
            what += f" (one row: pass [{value}])"
    return what


def check_flag(value: Any, where: str, arg: str, none_ok: bool = False) -> None:
    """``value`` must be True or False (or None with ``none_ok``): a TypeError naming the call otherwise."""
    if isinstance(value, bool) or (none_ok and value is None):
        return
    allowed = "None, True or False" if none_ok else "True or False"
    raise TypeError(f"{where}: {arg} must be {allowed}, got {type(value).__name__} {value!r}")


def batch_text(held: int, cap: int, ran: Sequence[int], declared: Optional[int]) -> str:
    """What bounds an announcement's rows, for its error messages: the batch sizes that exist."""
    sizes = ", ".join(map(str, ran)) if ran else str(held)
    text = f"the batch: {held} rows held, graphs of batch {sizes} ran on these caches"
    if declared is not None:
        text += f", the model's batch {declared}"
        if cap < declared:
            text += " (private state: it cannot grow)"
    return text
