"""Loading the serving loop's KV transfer op, ``glm_serve::copy_blocks_`` (``csrc/kv_transfer.cpp``): the
library built at install, else a JIT build; and the same write through PyTorch."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Optional

import torch

from ... import _extensions

log = logging.getLogger("offload_passes.models.serve")

_CSRC = Path(__file__).resolve().parent / "csrc" / "kv_transfer.cpp"
_loaded: Optional[str] = None


def transfer_library() -> Optional[Path]:
    """The KV-transfer library ``pip install`` built for the running torch (``setup.py``), or None."""
    path = Path(__file__).resolve().parent / _extensions.ext_filename(_extensions.kv_transfer_name(torch.__version__))
    return path if path.is_file() else None


def transfer_build_dir() -> Path:
    """Where the JIT fallback builds the op: a folder per torch build under ``$TORCH_EXTENSIONS_DIR`` (the
    builds of two torch versions, or of two venvs, never share one)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    return root / f"glm_serve_kv_transfer_{_extensions.torch_tag(torch.__version__)}"


def load_transfer_op() -> Callable:
    """Load ``glm_serve::copy_blocks_`` once: the library built at install (``setup.py``), else a JIT build
    (a C++ compiler, about a minute; ``OFFLOAD_PASSES_JIT_KERNELS=1`` forces it) into
    :func:`transfer_build_dir`, after waiting for another process's build there and removing a lock left
    by a build that was stopped (``_extensions.wait_for_build_lock``). ``transfer_origin()`` says which."""
    global _loaded
    if _loaded is None:
        if hasattr(torch.ops.glm_serve, "copy_blocks_"):
            _loaded = "loaded"
        else:
            path = None if _extensions.jit_forced(os.environ) else transfer_library()
            if path is not None:
                torch.ops.load_library(str(path))
                _loaded = "prebuilt"
            else:
                from torch.utils import cpp_extension

                out = transfer_build_dir()
                out.mkdir(parents=True, exist_ok=True)
                log.warning("glm_serve::copy_blocks_: JIT build into %s (%s)", out,
                            f"forced by {_extensions.FORCE_JIT_ENV}" if _extensions.jit_forced(os.environ)
                            else "no prebuilt library for this torch; `pip install -e .` builds it")
                _extensions.wait_for_build_lock(out)
                cpp_extension.load(name=out.name, sources=[str(_CSRC)], build_directory=str(out),
                                   extra_cflags=list(_extensions.KV_TRANSFER_CFLAGS), is_python_module=False,
                                   verbose=False)
                _loaded = "jit"
    return torch.ops.glm_serve.copy_blocks_


def transfer_origin() -> Optional[str]:
    """How ``glm_serve::copy_blocks_`` was loaded in this process: ``"prebuilt"`` (built at install),
    ``"jit"``, ``"loaded"`` (registered before), or None (not yet)."""
    return _loaded


def copy_blocks_torch(dst: torch.Tensor, src: torch.Tensor, dst_blocks: torch.Tensor,
                      src_blocks: torch.Tensor) -> None:
    """The same write through PyTorch (``index_copy_``): moves ``dst``'s version counter."""
    dst.index_copy_(0, dst_blocks.to(dst.device), src.index_select(0, src_blocks.to(src.device)))
