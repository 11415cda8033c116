"""``OpSpec``: every fact about one of our ops, in one frozen record (pure data; no registration here).

Each op module declares ``SPEC = OpSpec(...)`` (``SPECS`` if it defines several ops) near its top and
registers from it; :data:`offload_passes.custom_ops.OP_SPECS` lists them all. Everything else is
*derived* from the specs, never typed again:

* schema facts, parsed from :attr:`OpSpec.schema` with torch's schema parser: mutated arguments
  (``Tensor(a!)``) and their positions, the functional twin's schema and output order
  (non-ref returns, then the mutated arguments in schema order);
* GE facts (``ge_graph`` mode, docs/platform.md §3): inputs = tensor arguments in schema order with
  the same names, attrs = the other arguments (renamed by :attr:`GeOp.attr_names`), outputs =
  :attr:`OpSpec.ge_outputs`; a mutated input is a *ref pair* (a GE output with the input's name),
  which gives the ref map ``output index -> input index`` (:attr:`OpSpec.ge_ref_map`);
* the tables built from all specs (:func:`reinplace_pairs`, :func:`ge_ref_table`,
  :func:`counted_names`): npugraph_ex/TorchAir reinplace registrations, TorchAir's GE ref table,
  ``passes._fx.count_ops`` keys;
* limits: named numbers with a one-line meaning; those several ops share are defined once here
  (:data:`SHARED_LIMITS`) and referenced by each spec that obeys them;
* argument binding (:class:`Binder`, :attr:`OpSpec.binder`): a call's positional and keyword arguments in
  schema order with the defaults filled, the one binding every kernel, converter and pass uses; a bad
  call raises :class:`OpArgumentError` naming the op and the argument.

Schema strings stay byte-identical to CANN's (``ops_def_registration.cpp``); the functional twin's
string is derived from the in-place one and checked against CANN's in ``tests/ops/test_schemas.py``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Dict, FrozenSet, Iterable, Mapping, Optional, Sequence, Tuple

from offload_passes import _compat


@dataclass(frozen=True)
class Limit:
    """A named limit of an op (a kernel's tiling bound, an alignment ...)."""

    #: Python name the value is bound to in the op module and its users (``MAX_TOPK``).
    name: str
    #: The number.
    value: int
    #: One line: what it bounds and why.
    meaning: str


#: Limits several ops share (one definition each; the DSA ops must agree on them, and so must the
#: backend's preconditions and options that decide whether the rewrite may emit the ops).
SHARED_LIMITS: Dict[str, Limit] = {lim.name: lim for lim in (
    Limit("MAX_TOPK", 2048, "top-k width K (selected ids per query token) the DSA kernels tile for"),
    Limit("MAX_RAW_SEQ", 4, "query tokens per batch row (raw_seq = 1 + next_n MTP drafts)"),
    Limit("MAX_DKV", 512, "latent KV dim (last dim of the kv caches) of plan/serve/install"),
    Limit("MIN_DR", 0, "smallest rope dim of serve/install: 0 is the no-rope mode, rope tensors [..., 0]"),
    Limit("MAX_DR", 128, "rope dim (last dim of the k_rope caches) of serve/install"),
    Limit("MAX_POOL", 16384, "pool slots per batch row (PS); plan and install address the same pool"),
    Limit("WAYS", 16, "pool associativity: PS is split into PS/16 sets of 16 ways (one LRU counter each)"),
    Limit("TOPK_GRANULARITY", 8, "serve/install need topk to be a multiple of this"),
    Limit("MIN_SELECTION_BLOCK_SIZE", 16, "smallest selection block size (a power of two) of serve/install"),
    Limit("MAX_SELECTION_BLOCK_SIZE", 128, "largest selection block size (a power of two) of serve/install"),
    Limit("INDEXER_MAX_SPARSE_COUNT", 2048, "torch_npu's documented upper limit of the indexers' sparse_count"),
)}


def shared_limits(*names: str) -> Tuple[Limit, ...]:
    """The shared limits named (KeyError naming the known ones otherwise)."""
    missing = [n for n in names if n not in SHARED_LIMITS]
    if missing:
        raise KeyError(f"unknown shared limit(s) {missing}; known: {sorted(SHARED_LIMITS)}")
    return tuple(SHARED_LIMITS[n] for n in names)


class OpArgumentError(TypeError, RuntimeError):
    """A call whose arguments do not bind to the op's schema (too many, unknown, given twice, missing).

    A ``TypeError`` (Python's error for a bad call) and a ``RuntimeError`` (every other error of our ops),
    so either ``except`` catches it; the message names the op and the argument.
    """


_MISSING = object()


class Binder:
    """Binds a call to a schema: the arguments in schema order, defaults filled in.

    Kernels take ``(*args, **kwargs)`` (the dispatcher hands keyword-only arguments by name and may leave
    out those equal to their defaults), converters get FX node arguments, passes read graph nodes: all bind
    here, so a bad call fails the same way everywhere (:class:`OpArgumentError`).
    """

    __slots__ = ("op", "names", "_index", "_defaults")

    def __init__(self, schema: "_compat.FunctionSchema", op: str) -> None:
        self.op = op
        self.names: Tuple[str, ...] = tuple(a.name for a in schema.arguments)
        self._index = {n: i for i, n in enumerate(self.names)}
        self._defaults = tuple(a.default_value if a.has_default_value() else _MISSING for a in schema.arguments)

    def __call__(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Tuple[Any, ...]:
        n, total = len(args), len(self.names)
        if not kwargs and n == total:  # the dispatcher's and our own kernels' calls: nothing to do
            return tuple(args)
        if n > total:
            raise OpArgumentError(f"{self.op}: {n} positional arguments, the schema takes {total}")
        out = list(args) + [_MISSING] * (total - n)
        for name, value in kwargs.items():
            i = self._index.get(name)
            if i is None:
                raise OpArgumentError(f"{self.op}: unknown argument {name!r}; the schema's arguments are "
                                      f"{', '.join(self.names)}")
            if i < n:
                raise OpArgumentError(f"{self.op}: argument {name!r} given twice (by position and by name)")
            out[i] = value
        for i in range(n, total):
            if out[i] is _MISSING:
                out[i] = self._defaults[i]
                if out[i] is _MISSING:
                    raise OpArgumentError(f"{self.op}: missing argument {self.names[i]!r}")
        return tuple(out)


_BINDERS: Dict[Tuple[str, str], Binder] = {}


def schema_binder(schema: "_compat.FunctionSchema") -> Binder:
    """The :class:`Binder` of any op's schema (``OpOverload._schema``), kept per schema string."""
    key = (schema.name, str(schema))
    b = _BINDERS.get(key)
    if b is None:
        op = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
        b = _BINDERS[key] = Binder(schema, op)
    return b


#: What an op is for; ``count_ops`` reports the ``offload`` and ``decode`` ones.
ROLES = ("offload", "decode", "cache_write", "comm")

#: What an argument is for (:attr:`OpSpec.arg_roles`): the passes and the side-stream schedule read an
#: argument by its role, never by its position (``dsa_install_sc`` takes ``dsa_install``'s arguments after
#: its plan).
ARG_ROLES = ("plan", "records", "selection", "selection_table", "pool", "metadata")

_ALIAS = re.compile(r"Tensor\([a-z]+!\)")


def is_tensor_arg(arg: "_compat.SchemaArgument") -> bool:
    """``Tensor`` or ``Tensor?``: a GE input (everything else is a GE attr)."""
    t = arg.type
    if t.kind() == "OptionalType":
        t = t.getElementType()
    return t.kind() == "TensorType"


@dataclass(frozen=True)
class GeOp:
    """The CANN (GE) op our GE converter lowers an op (and its twin) to, ``ge_graph`` mode."""

    #: CANN op type, e.g. ``DsaServe``.
    type: str
    #: GE output names in IR order (mutated inputs appear under their own names: ref pairs).
    outputs: Tuple[str, ...]
    #: torch argument name -> GE attr name, for the attrs GE spells differently (renames only).
    attr_names: Mapping[str, str] = field(default_factory=dict, hash=False)
    #: Optional tensor inputs left out of the GE node (not even as an empty input) when absent, as
    #: torch_npu's own converter does (older CANN definitions lack them).
    omit_if_none: Tuple[str, ...] = ()
    #: TorchAir's GE ref analysis (``graph_pass._get_output_to_input_ref_idx``) already lists this
    #: type; only the other mutating GE types go into our patch (:func:`ge_ref_table`).
    ref_known: bool = False


@dataclass(frozen=True)
class OpSpec:
    """Every fact about one op (and its functional twin, if any). Pure data plus derived views."""

    #: torch.library namespace: ``custom`` (CANN's ops) or ``offload_ref`` (CPU references / doubles).
    namespace: str
    #: ``custom::dsa_serve``'s ``dsa_serve``: the in-place op, or the only op.
    name: str
    #: The exact schema string (without namespace) as CANN / torch_npu define it; byte-identical.
    schema: str
    #: What the op is for, one of :data:`ROLES` (``count_ops`` reports ``offload`` and ``decode``).
    role: str
    #: One line saying what the op does.
    summary: str
    #: Name of the functional twin (same arguments, no aliasing, returns the new values), or None.
    functional: Optional[str] = None
    #: Named limits the op's validation enforces (shared ones come from :data:`SHARED_LIMITS`).
    limits: Tuple[Limit, ...] = ()
    #: The CANN op our GE converter emits, or None where no converter of ours lowers the op
    #: (TorchAir's own converter, a CPU-only op, or a test double).
    ge: Optional[GeOp] = None
    #: Module of ``offload_passes.custom_ops.cuda`` holding the op's Triton (CUDA) kernels, or None.
    cuda_kernel: Optional[str] = None
    #: Argument name -> its role (one of :data:`ARG_ROLES`), for the arguments a pass reads by role.
    arg_roles: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"OpSpec {self.name}: role must be one of {ROLES}, got {self.role!r}")
        if self.parsed.name != self.name:
            raise ValueError(f"OpSpec {self.name}: schema names {self.parsed.name!r}")
        names = [lim.name for lim in self.limits]
        if len(set(names)) != len(names):
            raise ValueError(f"OpSpec {self.name}: limits named twice in {names}")
        if self.ge_type is not None:
            missing = [m for m in self.mutated if m not in self.ge_outputs]
            if missing:
                raise ValueError(f"OpSpec {self.name}: mutated inputs {missing} have no same-named GE output")
            n_ret = len(self.parsed.returns) - sum(r.alias_info is not None for r in self.parsed.returns)
            if len(self.non_ref_outputs) != n_ret:
                raise ValueError(f"OpSpec {self.name}: GE outputs {self.non_ref_outputs} that are not refs must "
                                 f"match the schema's {n_ret} returns")
        if self.functional is not None and not self.mutated:
            raise ValueError(f"OpSpec {self.name}: a functional twin needs mutated arguments")
        unknown = sorted(set(self.arg_roles) - set(self.arg_names))
        if unknown:
            raise ValueError(f"OpSpec {self.name}: arg_roles names {unknown}, not arguments of the schema")
        bad = sorted({r for r in self.arg_roles.values() if r not in ARG_ROLES})
        if bad:
            raise ValueError(f"OpSpec {self.name}: arg_roles must be among {ARG_ROLES}, got {bad}")

    # ------------------------------------------------------------------ schema
    @cached_property
    def parsed(self) -> "_compat.FunctionSchema":
        """The schema parsed by torch (names, types, alias annotations, defaults)."""
        return _compat.parse_schema(self.schema)

    @property
    def qualname(self) -> str:
        return f"{self.namespace}::{self.name}"

    @cached_property
    def binder(self) -> Binder:
        """Binds a call of the op (or of its twin: same arguments) to the schema (:class:`Binder`)."""
        return Binder(self.parsed, self.qualname)

    @cached_property
    def twin_binder(self) -> Optional[Binder]:
        """The :attr:`binder` of the functional twin (same arguments, messages name the twin), or None."""
        return Binder(self.parsed, self.functional_qualname) if self.functional else None

    @property
    def functional_qualname(self) -> Optional[str]:
        return f"{self.namespace}::{self.functional}" if self.functional else None

    @property
    def op_names(self) -> Tuple[str, ...]:
        """The short names this spec defines: the op, then its twin."""
        return (self.name,) + ((self.functional,) if self.functional else ())

    @property
    def arg_names(self) -> Tuple[str, ...]:
        return tuple(a.name for a in self.parsed.arguments)

    @property
    def mutated_positions(self) -> Tuple[int, ...]:
        """Positions of the mutated (``Tensor(x!)``) arguments; the twin takes the same arguments."""
        return tuple(i for i, a in enumerate(self.parsed.arguments)
                     if a.alias_info is not None and a.alias_info.is_write)

    def args_of(self, role: str) -> Tuple[str, ...]:
        """The names of the arguments with ``role`` (:attr:`arg_roles`), schema order."""
        if role not in ARG_ROLES:
            raise KeyError(f"{self.qualname}: unknown argument role {role!r}; roles: {ARG_ROLES}")
        return tuple(a for a in self.arg_names if self.arg_roles.get(a) == role)

    @property
    def mutated(self) -> Tuple[str, ...]:
        """Names of the mutated arguments, schema order."""
        args = self.parsed.arguments
        return tuple(args[i].name for i in self.mutated_positions)

    @property
    def num_leading_outputs(self) -> int:
        """Outputs the in-place op returns itself (they lead the twin's outputs)."""
        return sum(1 for r in self.parsed.returns if r.alias_info is None)

    @property
    def functional_schema(self) -> Optional[str]:
        """The twin's schema string: same arguments without alias annotations, returning the in-place
        op's own returns then one tensor per mutated argument (CANN's convention)."""
        if self.functional is None:
            return None
        head, _, _ = self.schema.rpartition(" -> ")
        args = _ALIAS.sub("Tensor", head[len(self.name):])
        n = self.num_leading_outputs + len(self.mutated)
        returns = "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")"
        return f"{self.functional}{args} -> {returns}"

    # ------------------------------------------------------------------ limits
    def limit_values(self, *names: str) -> Tuple[int, ...]:
        """The values of the limits named, in that order (to bind several module constants at once)."""
        return tuple(self.limit(n) for n in names)

    def limit(self, name: str) -> int:
        """The value of limit ``name`` (KeyError naming the op's limits otherwise)."""
        for lim in self.limits:
            if lim.name == name:
                return lim.value
        raise KeyError(f"{self.qualname} has no limit {name!r}; its limits: {[lim.name for lim in self.limits]}")

    # ------------------------------------------------------------------ GE
    @property
    def ge_type(self) -> Optional[str]:
        return self.ge.type if self.ge else None

    @property
    def ge_outputs(self) -> Tuple[str, ...]:
        return self.ge.outputs if self.ge else ()

    @property
    def omit_if_none(self) -> Tuple[str, ...]:
        return self.ge.omit_if_none if self.ge else ()

    @property
    def ge_inputs(self) -> Tuple[str, ...]:
        """GE input names: the tensor arguments in schema order."""
        return tuple(a.name for a in self.parsed.arguments if is_tensor_arg(a))

    @property
    def ge_attrs(self) -> Tuple[str, ...]:
        """GE attr names: the non-tensor arguments in schema order, renamed by :attr:`GeOp.attr_names`."""
        return tuple(self.ge_attr(a.name) for a in self.parsed.arguments if not is_tensor_arg(a))

    def ge_attr(self, torch_name: str) -> str:
        return self.ge.attr_names.get(torch_name, torch_name) if self.ge else torch_name

    @property
    def non_ref_outputs(self) -> Tuple[str, ...]:
        """GE outputs that are not ref pairs (what the in-place op returns)."""
        return tuple(o for o in self.ge_outputs if o not in self.mutated)

    @property
    def functional_outputs(self) -> Tuple[str, ...]:
        """The twin's outputs by GE name: non-ref outputs, then the mutated arguments in schema order."""
        return self.non_ref_outputs + self.mutated

    @property
    def ge_ref_map(self) -> Dict[int, int]:
        """GE ref pairs: output index -> index of the same-named input."""
        inputs = self.ge_inputs
        return {self.ge_outputs.index(m): inputs.index(m) for m in self.mutated} if self.ge_type else {}


# ---------------------------------------------------------------------- tables derived from specs

def reinplace_pairs(specs: Iterable[OpSpec]) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """Functional twin -> (in-place op, mutated argument positions), qualified names."""
    return {s.functional_qualname: (s.qualname, s.mutated_positions) for s in specs if s.functional}


def ge_ref_table(specs: Iterable[OpSpec]) -> Dict[str, Dict[int, int]]:
    """GE op type -> ref map, for the mutating GE types TorchAir's ref analysis does not list."""
    return {s.ge.type: s.ge_ref_map for s in specs if s.ge and s.mutated and not s.ge.ref_known}


def counted_names(specs: Iterable[OpSpec]) -> FrozenSet[str]:
    """Short names ``count_ops`` reports (the ``offload`` and ``decode`` ops and their twins)."""
    return frozenset(n for s in specs if s.role in ("offload", "decode") for n in s.op_names)


def find_spec(specs: Iterable[OpSpec], name: str) -> OpSpec:
    """The spec of ``name`` (in-place, functional or qualified name); KeyError naming the known ops."""
    specs = tuple(specs)
    for s in specs:
        if name in s.op_names or name in (s.qualname, s.functional_qualname):
            return s
    known = sorted(n for s in specs for n in s.op_names)
    raise KeyError(f"spec_for: name {name!r} is not one of our ops; known: {known}")
