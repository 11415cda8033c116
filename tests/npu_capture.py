"""The FX graph npugraph_ex's graph passes finished with (shared by tests/converters and tests/distributed)."""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def captured_npugraph_ex_graph() -> Iterator[dict]:
    """Yields a dict that holds, after a compile, ``"gm"`` / ``"graph"``: the module and graph as
    ``resolve_default_stream_markers`` (the last pass before npugraph_ex builds its ACL graph) left them."""
    import npugraph_ex._acl_concrete_graph.graph_pass as gp

    captured: dict = {}
    original = gp.resolve_default_stream_markers

    def spy(gm):
        out = original(gm)
        captured["gm"], captured["graph"] = gm, gm.graph
        return out

    gp.resolve_default_stream_markers = spy
    try:
        yield captured
    finally:
        gp.resolve_default_stream_markers = original
