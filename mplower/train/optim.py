"""The optimizers, in f32 on the f32 master weights, as PyTorch defines them.

SGD with momentum (torch.optim.SGD: buf = momentum * buf + g, the first buf = g; w -= lr * buf,
with weight decay added to g first) and Adam (torch.optim.Adam, bias-corrected: m and v running
means of g and g^2, w -= lr * m_hat / (sqrt(v_hat) + eps)). Every operation is an elementwise
numpy op in float32, so an update is the same bits on any machine and thread count.
`parse_optimizer` reads the CLI's `sgd{lr=0.1 momentum=0.9}` with the pass option syntax.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np

from mplower.pass_manager import PipelineError, parse_options

F32 = np.float32


@dataclass
class SGD:
    name: ClassVar[str] = "sgd"
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}  # state, not an option

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
        lr, mom, wd = F32(self.lr), F32(self.momentum), F32(self.weight_decay)
        for k, g in grads.items():
            if wd:
                g = g + wd * params[k]
            if mom:
                buf = self._bufs.get(k)
                g = self._bufs[k] = g.copy() if buf is None else mom * buf + g
            params[k] = params[k] - lr * g


@dataclass
class Adam:
    name: ClassVar[str] = "adam"
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:  # state, not options
        self._t = 0
        self._m: dict[str, np.ndarray] = {}
        self._v: dict[str, np.ndarray] = {}

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
        self._t += 1
        b1, b2, one = F32(self.beta1), F32(self.beta2), F32(1)
        c1, c2 = one - b1 ** self._t, one - b2 ** self._t
        lr, eps, wd = F32(self.lr), F32(self.eps), F32(self.weight_decay)
        for k, g in grads.items():
            if wd:
                g = g + wd * params[k]
            m = self._m[k] = b1 * self._m.get(k, np.zeros_like(g)) + (one - b1) * g
            v = self._v[k] = b2 * self._v.get(k, np.zeros_like(g)) + (one - b2) * (g * g)
            params[k] = params[k] - lr * (m / c1) / (np.sqrt(v / c2) + eps)


Optimizer = SGD | Adam
OPTIMIZERS: dict[str, type[SGD | Adam]] = {"sgd": SGD, "adam": Adam}


def parse_optimizer(text: str) -> Optimizer:
    """`sgd`, `sgd{lr=0.1 momentum=0.9}`, `adam{lr=1e-3}`; ValueError naming the problem."""
    name, _, opts = text.strip().partition("{")
    cls = OPTIMIZERS.get(name.strip())
    if cls is None or (opts and not opts.endswith("}")):
        raise ValueError(f"--optimizer must be sgd{{...}} or adam{{...}}, got '{text}'")
    try:
        options = parse_options(cls, opts[:-1])  # type: ignore[arg-type]
    except PipelineError as e:
        raise ValueError(str(e).replace(f"pass '{cls.name}'", f"optimizer '{cls.name}'")) \
            from None
    opt = cls(**options)
    for name in ("lr", *(f.name for f in fields(opt) if f.name != "lr")):
        value = getattr(opt, name)
        with np.errstate(over="ignore"):  # the update runs in f32: 1e39 is inf there
            finite = bool(np.isfinite(F32(value)))
        if not finite:  # nan, inf: every weight would be NaN after a step
            raise ValueError(f"optimizer '{cls.name}': {name} must be a finite f32 number, "
                             f"got {value}")
    if opt.lr <= 0:
        raise ValueError(f"optimizer '{cls.name}': lr must be > 0, got {opt.lr}")
    return opt
