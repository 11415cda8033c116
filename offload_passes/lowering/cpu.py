"""The CPU lowerings: ``eager`` (AOT + our reinplace, run op by op) and ``inductor`` (our reinplace as
Inductor's ``post_grad_custom_pre_pass``, in-place custom ops retargeted to their ``offload_inductor::``
aliases, which torch 2.8's Inductor needs: it cannot run a mutable custom op that has a Functionalize
kernel). One of the lowerings of ``modes.MODES``; the backend core (``backend.py``) does the rest.
"""
from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import fx

from .. import _compat
from ..modes import CPU_EXE_MODES, check_exe_mode
from ..options import OffloadOptions
from ..passes import _fx
from ..passes.inductor_targets import define_aliases, retarget_for_inductor
from ..passes.reinplace import ReinplaceReport, reinplace
from ..passes.manager import CompileContext, Pass
from . import LowerContext

__all__ = ["CpuLowering", "pass_uuid"]

def _package_dir(module: Any) -> Path:
    return Path(module.__file__).resolve().parent


from .. import custom_ops as _custom_ops, passes as _passes  # noqa: E402  (their folders: custom_ops/ is mapped)

_ROOT = _package_dir(__import__(__package__))
#: Everything whose change can change what the custom Inductor pass (or the graph it sees) produces:
#: every pass module, the op specs and kernels' Python, the FX and version glue. Inductor's FX-graph
#: cache keys on :func:`pass_uuid`.
UUID_FILES = (sorted(_package_dir(_passes).rglob("*.py")) + sorted(_package_dir(_custom_ops).glob("*.py"))
              + [_ROOT / n for n in ("_compat.py", "options.py", "modes.py", "pipeline.py", "outcome.py",
                                     "lowering/cpu.py")] + sorted((_ROOT / "state").glob("*.py")))


def pass_uuid(options: Optional[OffloadOptions] = None) -> str:
    """The custom pass's cache key: the bytes of :data:`UUID_FILES`, the torch version and the options
    that reach the pass (they change the rewritten graph)."""
    h = hashlib.sha256()
    for f in UUID_FILES:
        if f.exists():
            h.update(f.name.encode())
            h.update(f.read_bytes())
    h.update(torch.__version__.encode())
    if options is not None:
        h.update(repr(sorted(options.to_dict().items())).encode())
    return h.hexdigest()


class _ReinplacePass:
    """Inductor ``post_grad_custom_pre_pass``: our reinplace, with a stable uuid for the FX cache."""

    def __init__(self, on_graph: Callable[[fx.Graph, str], None], options: Optional[OffloadOptions] = None):
        self.on_graph = on_graph
        self.options = options

    def __call__(self, graph: fx.Graph) -> None:
        self.on_graph(graph, "functional")
        self.on_graph(graph, "reinplace")

    def uuid(self) -> str:
        return pass_uuid(self.options)


def _custom_op_overloads() -> list:
    """The default overloads of our ``custom::`` ops (custom_ops.CUSTOM_OPS)."""
    from ..custom_ops import CUSTOM_OPS

    return [getattr(torch.ops.custom, name).default for name in CUSTOM_OPS]


def _inductor_pass(on_graph: Callable[[fx.Graph, str], None], options: Optional[OffloadOptions] = None):
    CustomGraphPass = _compat.custom_graph_pass_base()

    class ReinplaceGraphPass(_ReinplacePass, CustomGraphPass):
        pass

    return ReinplaceGraphPass(on_graph, options)


class CpuLowering:
    """``eager`` (AOT + our reinplace, run op by op) and ``inductor`` (our reinplace as Inductor's
    ``post_grad_custom_pre_pass``, in-place custom ops retargeted to their ``offload_inductor::`` aliases)."""

    state_from_caches = True

    def __init__(self, mode: str, **npu_kw: Any):
        check_exe_mode(mode, CPU_EXE_MODES, where=" for the CPU lowering")
        given = sorted(k for k, v in npu_kw.items() if v not in (None, {}, True))
        if given:
            raise ValueError(f"{given} only apply to the NPU exe_modes, not {mode!r}")
        self.mode = mode

    def configure(self, ctx: CompileContext) -> None:
        return None  # the options as given, installs in program order

    def passes(self, ctx: CompileContext) -> list[Pass]:
        return []  # everything of its own runs after AOT (our reinplace)

    def lower(self, gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: LowerContext) -> Callable:
        ctx.ignore_compile_mode()  # the CPU modes run op by op or through our Inductor settings
        timings, report = ctx.timings, ctx.report
        if not report.rewritten or (ctx.state is None and self.mode == "eager"):
            # untouched: no DSA at all, or refused (the model's own in-place ops run as written)
            timings["aot_s"] = 0.0
            timings["reinplace_s"] = 0.0
            return gm.forward
        rinfo: dict = {}
        on_graph = self._on_graph(ctx, rinfo)
        if self.mode == "eager":
            fn = _lower_eager(gm, example_inputs, on_graph, timings)
        else:
            fn = _lower_inductor(gm, example_inputs, on_graph, timings, ctx.options)
        if "report" in rinfo:
            report.reinplace = rinfo["report"].to_dict()
            report.ops["after"] = rinfo["ops_after"]
            ctx.final_graph = rinfo["final_graph"]
        elif ctx.state is not None and self.mode == "inductor":
            report.reinplace = {"cached": True}
        return fn

    @staticmethod
    def _on_graph(ctx: Any, rinfo: dict) -> Callable[[fx.Graph, str], None]:
        """The post-AOT callback: dump the functional graph, reinplace it, dump the result."""
        def on_graph(graph: fx.Graph, stage: str) -> None:
            if stage == "functional":
                if ctx.dumper:
                    ctx.dumper.graph(ctx.graph_id, "functional", graph)
                rinfo["t0"] = time.perf_counter()
                return
            with _fx.paused_gc():
                rep: ReinplaceReport = reinplace(graph)
            ctx.timings["reinplace_s"] = time.perf_counter() - rinfo.pop("t0")
            rinfo.update(report=rep, ops_after=_fx.count_ops(graph), final_graph=graph)
            if ctx.dumper:
                ctx.dumper.graph(ctx.graph_id, "reinplace", graph)

        return on_graph


def _lower_eager(gm: fx.GraphModule, example_inputs: Sequence[Any], on_graph, timings: dict) -> Callable:
    aot_module_simplified, make_boxed_func = _compat.aot_module_simplified(), _compat.make_boxed_func()

    def inner(fx_gm: fx.GraphModule, ex: Sequence[Any]):
        timings["aot_s"] = time.perf_counter() - t0
        on_graph(fx_gm.graph, "functional")
        on_graph(fx_gm.graph, "reinplace")
        fx_gm.recompile()
        return make_boxed_func(fx_gm.forward)

    t0 = time.perf_counter()
    return aot_module_simplified(gm, example_inputs, fw_compiler=inner, inference_compiler=inner,
                                 keep_inference_input_mutations=True)


def _lower_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], on_graph, timings: dict,
                    options: Optional[OffloadOptions] = None) -> Callable:
    compile_fx = _compat.inductor_compile_fx()

    t0 = time.perf_counter()

    def hook(graph: fx.Graph, stage: str) -> None:
        if stage == "functional":
            timings["aot_s"] = time.perf_counter() - t0
        on_graph(graph, stage)
        if stage == "reinplace":  # in-place custom ops as every Inductor version runs them
            retarget_for_inductor(graph)

    define_aliases(_custom_op_overloads())  # a warm FX-graph cache calls them without our pass
    kw = {}
    if not _compat.inductor_lowers_assert_async():  # torch 2.8: keep the guards (see inductor_targets)
        kw["decompositions"] = _compat.inductor_decompositions_keeping_asserts()
    return compile_fx(gm, example_inputs, config_patches={"post_grad_custom_pre_pass": _inductor_pass(hook, options)},
                      **kw)
