"""Precision policy sheets: which format each op computes in, and why.

A policy (a TOML sheet, docs/policy.md) names a compute format and an accumulator, three op
lists in the manner of TVM's ToMixedPrecision and PyTorch autocast (`allow`: always lowered;
`follow`: lowered when their inputs are; `deny`: kept in f32), per-op overrides by op kind or
result-name glob, keep-first-and-last, keep-io-types and quality guardrails. A list names ops
(`"mp.relu"`) or groups of ops (`"@data-movement"`): a group is every op that declares the
trait of that name (mplower.ir.opdef.Trait), resolved when an op is decided, so an op added to
the dialect with the trait is in every sheet's list without a sheet edit. `Policy.decide`
is the one function `assign-precision` and the report call to turn that sheet into a
(compute, accumulator, reason) for an op; it knows nothing of targets, which `legalize`
applies afterwards (mplower.lowering.target).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from mplower.dialect.mp import ACCUMULATING
from mplower.dialect.plan import SCALING
from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.graph import Module
from mplower.ir.opdef import OPS, OpError, Trait
from mplower.lowering.scaling import MAX_MARGIN, Scaling
from mplower.lowering.target import ACCUM_FORMATS, COMPUTE_FORMATS, base_accum
from mplower.lowering.tomlsheet import Bounds, KeyPath, Sheet, locate
from mplower.lowering.tomlsheet import builtin_names as _builtin_names
from mplower.numerics.formats import FORMATS, width_rank

# What a guardrail limit may be (docs/policy.md): a relative error beyond 1000 or an SQNR beyond
# 1000 dB means nothing (f64 itself reaches ~320 dB), a count of overflowed values must be
# exact in a float (2^53), an agreement is a fraction.
GUARDRAIL_BOUNDS = {
    "max_rel_l2": Bounds(0, 1e3),
    "min_sqnr_db": Bounds(0, 1e3, " dB"),
    "max_overflow": Bounds(0, 2 ** 53, " values"),
    "max_overflow_rate": Bounds(0, 1),
    "min_top1_agreement": Bounds(0, 1),
    # Elementwise, as numpy.allclose: |y - y_ref| <= atol + rtol |y_ref| (mplower.report.run);
    # an absolute tolerance beyond f32's largest value admits everything.
    "rtol": Bounds(0, 1e3),
    "atol": Bounds(0, 3.4028234663852886e38),
    # A task metric (mplower.lowering.metrics, docs/metrics.md): its value is the user's, in
    # any units; a drop is how much worse than fp32 the plan may be (0: no worse at all).
    "min_metric": Bounds(-1e300, 1e300),
    "max_metric": Bounds(-1e300, 1e300),
    "max_metric_drop": Bounds(0, 1e300),
    "max_metric_drop_rel": Bounds(0, 1e3),
}
GUARDRAILS = tuple(GUARDRAIL_BOUNDS)  # the keys, in the order docs and messages list them
WEIGHT_FORMATS = ("i8",)  # weight-only quantization (`weights = "i8"`)

# Reason strings of Decision (docs/policy.md); follow and override reasons carry a detail.
ALLOW_LIST = "allow-list"
DENY_LIST = "deny-list"
KEEP_FIRST_LAST = "keep-first-last"
NOT_LISTED = "not-listed"

# `@NAME` in a sheet's list: the ops with the trait NAME (`@data-movement`, `@contraction`).
GROUP_PREFIX = "@"
GROUPS = {GROUP_PREFIX + t.value: t for t in Trait}


def follow_reason(fmt: str) -> str:
    return f"follow: inputs {fmt}"


@dataclass(frozen=True)
class Override:
    """`[[override]]`: ops of kind `op` and/or whose result name matches the glob `name`."""

    op: str | None
    name: str | None
    compute: str | None
    accum: str | None

    def matches(self, op: str, result_name: str) -> bool:
        """`result_name` with or without its `%`; the glob likewise (`%fc*` and `fc*` are the
        same rule), since the graph stores names bare and the IR prints them with `%`."""
        return ((self.op is None or self.op == op)
                and (self.name is None
                     or fnmatchcase(result_name.removeprefix("%"), self.name.removeprefix("%"))))

    @property
    def reason(self) -> str:
        return "override " + " ".join(p for p in (self.op, self.name) if p is not None)


def keep_f32_overrides(names: Collection[str]) -> str:
    """`[[override]]` tables that keep these result names in f32, to paste into a sheet
    (what `mplower run --bisect` suggests)."""
    return "".join(f'[[override]]\nname = "{n}"\ncompute = "f32"\n\n' for n in names)


@dataclass(frozen=True)
class Decision:
    compute: str
    accum: str | None  # None for ops that do not accumulate
    reason: str


@dataclass(frozen=True)
class Policy:
    name: str
    compute: str  # format of allow-listed ops, and of follow ops whose inputs are lowered
    accum: str  # accumulator of lowered ACCUMULATING ops
    weights: str | None  # weight-only quantization format of constant operands, if any
    allow: tuple[str, ...]  # op names as the sheet writes them; groups are in `*_groups`
    follow: tuple[str, ...]
    deny: tuple[str, ...]
    keep_io_types: bool  # function arguments and results keep their types
    keep_first_last: bool
    overrides: tuple[Override, ...]
    guardrails: dict[str, float] = field(hash=False)
    source: str = ""  # the sheet's absolute path, or "builtin:NAME"
    description: str = ""
    scaling: Scaling | None = None  # [scaling]: how insert-casts scales the GEMM operands
    # The `@group` entries of each list, as traits (GROUPS).
    allow_groups: frozenset[Trait] = frozenset()
    follow_groups: frozenset[Trait] = frozenset()
    deny_groups: frozenset[Trait] = frozenset()

    def listed(self, op: str) -> str | None:
        """The list that decides `op`: "allow", "follow", "deny" or None.

        An op named in a list is decided by that list (a name overrides a group: int8 follows
        `@data-movement` but denies `mp.concat`). Otherwise its traits pick the list, deny
        before allow before follow, so that the cautious list wins an op in two groups.
        """
        if op in self.deny:
            return "deny"
        if op in self.allow:
            return "allow"
        if op in self.follow:
            return "follow"
        opdef = OPS.get(op)
        if opdef is None:
            return None
        traits = opdef.traits
        for which, groups in (("deny", self.deny_groups), ("allow", self.allow_groups),
                              ("follow", self.follow_groups)):
            if not groups.isdisjoint(traits):
                return which
        return None

    def decide(self, op: str, result_name: str, inputs_lowered: bool,
               is_first_or_last: bool) -> Decision:
        """The compute format, accumulator and reason for one op.

        `inputs_lowered`: the op's float inputs arrive narrower than f32 (matters for follow
        ops only). `is_first_or_last`: the op is the first or last COMPUTE_HEAVY op of its
        function. Precedence, most specific first: overrides with a `name` glob, then
        keep-first-last, then overrides by op kind alone, then the deny/allow/follow lists
        (`listed`);
        ops in no list stay f32 ("not-listed"), as TVM treats unregistered ops as NEVER.
        Among matching overrides a later one wins, field by field.
        """
        which = self.listed(op)
        if which == "deny":
            compute, reason = "f32", DENY_LIST
        elif which == "allow":
            compute, reason = self.compute, ALLOW_LIST
        elif which == "follow":
            compute = self.compute if inputs_lowered else "f32"
            reason = follow_reason(compute)
        else:
            compute, reason = "f32", NOT_LISTED
        accum = self.accum
        matching = [o for o in self.overrides if o.matches(op, result_name)]
        for o in matching:
            if o.name is None:
                compute, accum, reason = o.compute or compute, o.accum or accum, o.reason
        if self.keep_first_last and is_first_or_last and compute != "f32":
            compute, accum, reason = "f32", "f32", KEEP_FIRST_LAST
        for o in matching:
            if o.name is not None:
                compute, accum, reason = o.compute or compute, o.accum or accum, o.reason
        return Decision(compute, _accumulator(op, compute, accum), reason)


def _accumulator(op: str, compute: str, accum: str) -> str | None:
    """The accumulator that fits `compute`: integers accumulate exactly in i32, and a float
    accumulator never narrower than the compute format (a denied op of an f16 sheet, or the
    float fallback of an int8 one, accumulates in f32)."""
    if op not in ACCUMULATING:
        return None
    if FORMATS[compute].is_int or FORMATS[accum].is_int:
        return base_accum(compute)
    return accum if width_rank(accum) >= width_rank(compute) else "f32"


_BUILTIN_DIR = Path(__file__).parent.parent / "policies"  # package data of mplower


def builtin_policies() -> list[str]:
    return _builtin_names(_BUILTIN_DIR)


def load_policy(spec: str, *, module: Module | None = None,
                known_ops: Collection[str] | None = None) -> Policy:
    """Load a built-in policy by name or a policy sheet by path (see docs/policy.md).

    `module`: the spec is that module's `mp.policy`, so a path is relative to its IR file's
    folder and may not leave it; without it the spec was named by the user, relative to the
    current folder. `known_ops`, when given, is checked against every op name in the sheet.
    Every problem is a DiagnosticError located in the sheet.
    """
    path, source = locate(spec, "policy", _BUILTIN_DIR, module,
                          "give its guardrails with --guardrail KEY=VALUE instead")
    return _parse(Sheet.read(path), path.stem, source, known_ops)


def module_scaling(module: Module) -> Scaling | None:
    """The sheet's `[scaling]` that assign-precision recorded on `module` (mp.scaling), if any;
    a malformed attribute is a located error."""
    value = module.attrs.get(SCALING)
    if value is None:
        return None
    try:
        return Scaling.of(value)
    except OpError as e:
        raise DiagnosticError.at(module.attr_loc(SCALING), e.message) from None


_TOP_KEYS = ("policy", "override", "guardrails", "scaling")
_SCALING_KEYS = ("recipe", "weights", "block_size", "weight_block_size", "scale_format",
                 "history", "amax_compute", "margin", "pow2", "accum_bits", "promote_every")
_POLICY_KEYS = ("name", "description", "compute", "accum", "weights", "allow", "follow", "deny",
                "keep_io_types", "keep_first_last")
_OVERRIDE_KEYS = ("op", "name", "compute", "accum")


def _parse(sheet: Sheet, stem: str, source: str, known_ops: Collection[str] | None) -> Policy:
    data = sheet.data
    sheet.check_keys(data, (), _TOP_KEYS)
    head = sheet.table(data, ("policy",), required=True)
    sheet.check_keys(head, ("policy",), _POLICY_KEYS)
    compute = sheet.string(head, ("policy", "compute"), required=True)
    sheet.format(compute, ("policy", "compute"), COMPUTE_FORMATS, "compute")
    accum = sheet.string(head, ("policy", "accum"), base_accum(compute))
    _check_accum(sheet, ("policy",), compute, accum)
    weights = sheet.string(head, ("policy", "weights"))
    if weights is not None:
        sheet.format(weights, ("policy", "weights"), WEIGHT_FORMATS, "weight")

    lists: dict[str, tuple[str, ...]] = {}
    groups: dict[str, frozenset[Trait]] = {}
    for which in ("allow", "follow", "deny"):
        kp = ("policy", which)
        written = sheet.strings(head, kp)
        lists[which] = tuple(e for e in written if not e.startswith(GROUP_PREFIX))
        groups[which] = frozenset(GROUPS[sheet.choice(e, kp, GROUPS, "op group")]
                                  for e in written if e.startswith(GROUP_PREFIX))
        for group in (e for e in written if e.startswith(GROUP_PREFIX)):
            if other := next((w for w, gs in groups.items()
                              if w != which and GROUPS[group] in gs), None):
                raise sheet.error(kp, f"group '{group}' is in both {other} and {which}",
                                  value=group)
        for op in lists[which]:
            _check_op(sheet, kp, op, known_ops)
            if other := next((w for w, ops in lists.items() if w != which and op in ops), None):
                raise sheet.error(kp, f"op '{op}' is in both {other} and {which}", value=op)

    guardrails_table = sheet.table(data, ("guardrails",))
    if "metric" in guardrails_table:  # naming code in a file would run it: the user names it
        raise sheet.error(("guardrails", "metric"), (
            "a sheet holds metric limits (min_metric, max_metric_drop, ...), not the metric: "
            "mplower runs no code a file names; give the metric on the command line "
            "(--metric top1:labels, --metric pkg.module:function)"))
    sheet.check_keys(guardrails_table, ("guardrails",), GUARDRAILS)
    return Policy(
        name=sheet.string(head, ("policy", "name"), stem),
        compute=compute,
        accum=accum,
        weights=weights,
        allow=lists["allow"],
        follow=lists["follow"],
        deny=lists["deny"],
        keep_io_types=sheet.boolean(head, ("policy", "keep_io_types"), True),
        keep_first_last=sheet.boolean(head, ("policy", "keep_first_last"), False),
        overrides=tuple(_override(sheet, o, ("override", i), known_ops)
                        for i, o in enumerate(sheet.tables(data, ("override",)))),
        guardrails={k: sheet.number(guardrails_table, ("guardrails", k), GUARDRAIL_BOUNDS[k])
                    for k in guardrails_table},
        source=source,
        description=sheet.string(head, ("policy", "description"), ""),
        scaling=_scaling(sheet, data),
        allow_groups=groups["allow"],
        follow_groups=groups["follow"],
        deny_groups=groups["deny"],
    )


def _scaling(sheet: Sheet, data: dict[str, Any]) -> Scaling | None:
    table = sheet.table(data, ("scaling",))
    if not table:
        return None
    sheet.check_keys(table, ("scaling",), _SCALING_KEYS)
    d = Scaling()
    # Each at its own line and column when out of range (the margin's range is what works).
    bounds = {"margin": Bounds(0, MAX_MARGIN)}
    ints = {k: int(sheet.number(table, ("scaling", k), bounds.get(k, Bounds(0, 2 ** 20)),
                                getattr(d, k)))
            for k in ("block_size", "weight_block_size", "history", "margin", "accum_bits",
                      "promote_every")}
    scaling = Scaling(**{k: sheet.string(table, ("scaling", k), getattr(d, k))
                         for k in ("recipe", "weights", "scale_format", "amax_compute")}, **ints,
                      pow2=sheet.boolean(table, ("scaling", "pow2"), d.pow2))
    if (problem := scaling.problem()) is not None:
        raise sheet.error(("scaling",), f"[scaling]: {problem}")
    return scaling


def _override(sheet: Sheet, table: dict[str, Any], kp: KeyPath,
              known_ops: Collection[str] | None) -> Override:
    sheet.check_keys(table, kp, _OVERRIDE_KEYS)
    op = sheet.string(table, (*kp, "op"))
    name = sheet.string(table, (*kp, "name"))
    compute = sheet.string(table, (*kp, "compute"))
    accum = sheet.string(table, (*kp, "accum"))
    if op is None and name is None:
        raise sheet.error(kp, "an [[override]] needs 'op' or 'name' (a glob on result names)")
    if compute is None and accum is None:
        raise sheet.error(kp, "an [[override]] needs 'compute' or 'accum'")
    if op is not None:
        _check_op(sheet, (*kp, "op"), op, known_ops)
    if compute is not None:
        sheet.format(compute, (*kp, "compute"), COMPUTE_FORMATS, "compute")
    if accum is not None:
        _check_accum(sheet, kp, compute, accum)
    return Override(op, name, compute, accum)


def _check_accum(sheet: Sheet, kp: KeyPath, compute: str | None, accum: str) -> None:
    """`accum` names an accumulator that fits `compute` (when the same table sets one)."""
    sheet.format(accum, (*kp, "accum"), ACCUM_FORMATS, "accumulator")
    if compute is None:
        return
    if FORMATS[compute].is_int != FORMATS[accum].is_int:
        raise sheet.error((*kp, "accum"), f"{compute} compute accumulates in "
                          f"{base_accum(compute)}, not {accum}", value=accum)
    if width_rank(accum) < width_rank(compute):
        raise sheet.error((*kp, "accum"), f"accumulator {accum} is narrower than compute "
                          f"format {compute}", value=accum)


def _check_op(sheet: Sheet, kp: KeyPath, op: str, known_ops: Collection[str] | None) -> None:
    if known_ops is not None:
        sheet.choice(op, kp, known_ops, "op")
