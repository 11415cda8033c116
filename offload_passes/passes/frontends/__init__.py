"""The front-ends: the graph forms the passes understand, tried in order (:data:`FRONT_ENDS`).

The pipeline (``pipeline.py``) tries them in order and the first whose detection finds DSA sites owns
the graph:

* ``recipe`` (``frontends/recipe.py``): the graph of cann-recipes' GLM-5.2 modeling (and of models/glm):
  lightning indexer → ``npu_gather_selection_kv_cache`` → sparse flash attention;
* ``hf`` (``frontends/hf/``): transformers' DSA families, a dense attention under a top-k mask, rewritten
  to a sparse attention (with the offload when its preconditions hold).

Each implements ``frontends/protocol.py::FrontEnd``; a third form adds one module implementing it and one
entry here (``tests/passes/test_frontends.py`` checks that every entry implements every member).
"""
from __future__ import annotations

from .hf import HF
from .protocol import FrontEnd
from .recipe import RECIPE

__all__ = ["FRONT_ENDS"]

#: The front-ends, tried in order; the first whose detection finds DSA sites rewrites the graph.
FRONT_ENDS: tuple[FrontEnd, ...] = (RECIPE, HF)
