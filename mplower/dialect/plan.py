"""The precision plan of one op: the `mp.*` annotations the passes write, as one value.

assign-precision, lower-sparse, legalize, quantize and bisect decide what an op computes in;
insert-casts, the executor, the ONNX exporter and the reports read it back. Every one of them
goes through `Plan`: the annotation names are declared here and nowhere else, and what
legalize (or quantize) fell back from is stored as structure, a dictionary attribute

    mp.requested = {precision = f8E4M3FN, accum = f32, kernel = "sparse_2_4"}

(`accum` and a dense `kernel` left out), not as text that readers would parse again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mplower.dialect.mp import OpError, attr_type
from mplower.ir.graph import Function
from mplower.ir.types import TypeAttr, attr_to_str

PRECISION = "mp.precision"  # the compute format
ACCUM = "mp.accum"  # the accumulator of a matmul, conv or reduction
KERNEL = "mp.kernel"  # dense, or a structured sparse kernel (mplower.lowering.target.KERNELS)
REASON = "mp.reason"  # why, in words, for people
REQUESTED = "mp.requested"  # what the policy asked for before a fallback (`Requested`)
FALLBACK = "mp.fallback"  # the fallback's reason code(s), comma-separated in the IR
SPARSE_REASON = "mp.sparse_reason"  # lower-sparse's reason code for a dense choice
# In the order a plan writes them, which is the order they print in when an op gets them all.
PLAN_ATTRS = (PRECISION, ACCUM, KERNEL, REQUESTED, FALLBACK, REASON, SPARSE_REASON)
DENSE = "dense"  # the kernel of an op without `mp.kernel`


@dataclass(frozen=True)
class Requested:
    """What the plan asked for before a pass fell back from it."""

    precision: str
    accum: str | None = None
    kernel: str = DENSE

    @classmethod
    def of(cls, value: Any) -> Requested:
        if not isinstance(value, dict) or "precision" not in value \
                or set(value) - {"precision", "accum", "kernel"}:
            raise OpError(f"{REQUESTED} must be a dictionary {{precision = T, accum = T, "
                          f"kernel = \"K\"}} (accum and kernel optional), "
                          f"got {attr_to_str(value)}")
        kernel = value.get("kernel", DENSE)
        if not isinstance(kernel, str):
            raise OpError(f"{REQUESTED}: kernel must be a string, got {attr_to_str(kernel)}")
        accum = value.get("accum")
        return cls(attr_type(value["precision"]), None if accum is None else attr_type(accum),
                   kernel)

    def attr(self) -> dict[str, Any]:
        out: dict[str, Any] = {"precision": TypeAttr(self.precision)}
        if self.accum is not None:
            out["accum"] = TypeAttr(self.accum)
        if self.kernel != DENSE:
            out["kernel"] = self.kernel
        return out

    def as_dict(self) -> dict[str, str | None]:
        """As the run report shows a plan: every key, accum None where there is none."""
        return {"precision": self.precision, "accum": self.accum, "kernel": self.kernel}

    def __str__(self) -> str:  # `bf16/f32 sparse_2_4`, as messages and mp.reason say it
        text = self.precision + (f"/{self.accum}" if self.accum else "")
        return text if self.kernel == DENSE else f"{text} {self.kernel}"


@dataclass(frozen=True)
class Plan:
    """An op's plan annotations; a field that is None (or an empty `fallback`) is absent.

    `kernel` is None when the op has no `mp.kernel` (it runs dense: `kernel_or_dense`); a pass
    that chose the dense kernel writes it explicitly.
    """

    precision: str | None = None
    accum: str | None = None
    kernel: str | None = None
    reason: str | None = None
    requested: Requested | None = None
    fallback: tuple[str, ...] = ()
    sparse_reason: str | None = None

    @classmethod
    def of(cls, attrs: dict[str, Any]) -> Plan:
        """The plan in an op's attributes; OpError for a malformed one (`mp.precision = "x"`)."""
        if not any(name in attrs for name in PLAN_ATTRS):
            return _EMPTY  # most ops of an unplanned module: no work
        get = attrs.get
        precision, accum, requested, fallback = (get(PRECISION), get(ACCUM), get(REQUESTED),
                                                 get(FALLBACK))
        return cls(
            precision=None if precision is None else attr_type(precision),
            accum=None if accum is None else attr_type(accum),
            kernel=_text(attrs, KERNEL),
            reason=_text(attrs, REASON),
            requested=None if requested is None else Requested.of(requested),
            fallback=tuple(str(fallback).split(",")) if fallback is not None else (),
            sparse_reason=_text(attrs, SPARSE_REASON))

    @classmethod
    def at(cls, f: Function, node: int) -> Plan:
        return cls.of(f.attrs_of(node))

    @property
    def kernel_or_dense(self) -> str:
        return self.kernel or DENSE

    def attrs(self) -> dict[str, Any]:
        """The annotations of this plan, as attribute values, in `PLAN_ATTRS` order."""
        return {name: value for name, value in self._values().items() if value is not None}

    def write(self, f: Function, node: int) -> None:
        """Make the op's annotations say this plan (rewriter API; other attributes untouched).

        Only the annotations that change are written, so one a pass leaves alone keeps its
        place and spelling, and new ones follow in `PLAN_ATTRS` order.
        """
        old = Plan.at(f, node)._values()
        for name, value in self._values().items():
            if value is None:
                f.del_attr(node, name)
            elif value != old[name]:
                f.set_attr(node, name, value)

    def _values(self) -> dict[str, Any]:
        """Each annotation's attribute value, in `PLAN_ATTRS` order (None: absent)."""
        p, a, req = self.precision, self.accum, self.requested
        return {PRECISION: None if p is None else TypeAttr(p),
                ACCUM: None if a is None else TypeAttr(a),
                KERNEL: self.kernel,
                REQUESTED: None if req is None else req.attr(),
                FALLBACK: ",".join(self.fallback) if self.fallback else None,
                REASON: self.reason,
                SPARSE_REASON: self.sparse_reason}


_EMPTY = Plan()


def _text(attrs: dict[str, Any], name: str) -> Any:
    """A string annotation as written; the verifier leaves discardable attributes alone, so
    another value passes through unchanged (and prints back as it was)."""
    return attrs.get(name)


__all__ = ["ACCUM", "DENSE", "FALLBACK", "KERNEL", "PLAN_ATTRS", "PRECISION", "REASON",
           "REQUESTED", "SPARSE_REASON", "Plan", "Requested"]
