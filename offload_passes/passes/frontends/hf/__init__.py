"""The Hugging Face front-end (``name = "hf"``): transformers' dense DSA attention → a sparse attention over
the K selected positions (``attention.py``; exact: the same softmax terms), then, with its preconditions,
the offload through the shared core. An offload refusal keeps the sparse rewrite.

Detection ``detect.py`` (the mask forms ``masks.py``, the dense attention ``dense.py``, the checks
``verify.py``); preconditions and emission ``frontend.py``, whose dead-code walk removes the dense nodes.
"""
from __future__ import annotations

from .attention import hf_sparse_attention, hf_sparse_attention_rows
from .detect import HfDetectReport, HfSite, detect_hf
from .frontend import HF, HfFrontEnd, dense_masks_left

__all__ = ["HF", "HfFrontEnd", "HfDetectReport", "HfSite", "detect_hf", "hf_sparse_attention",
           "hf_sparse_attention_rows", "dense_masks_left"]
