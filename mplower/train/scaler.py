"""Loss scaling: the factor the backward pass's seed is multiplied by, and how it moves.

`dynamic` follows torch.amp.GradScaler (https://pytorch.org/docs/stable/amp.html#gradient-scaling,
torch/amp/grad_scaler.py and `_amp_update_scale_`): start at `init` (2^16); a step whose
unscaled gradients hold inf or NaN is skipped and the scale multiplied by `backoff` (0.5), the
count of finite steps reset; after `interval` (2000) consecutive finite steps the scale is
multiplied by `growth` (2.0) and the count restarts. The scale is an f32, as GradScaler's.
`static=S` keeps S for good and `none` is S = 1; neither skips a step, as PyTorch without a
GradScaler does not: there, inf or NaN gradients stop the run (mplower.train.trainer).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DYNAMIC = "dynamic"
NONE = "none"


@dataclass
class LossScaler:
    scale: np.float32
    dynamic: bool = False
    growth: float = 2.0
    backoff: float = 0.5
    interval: int = 2000
    finite_steps: int = 0  # GradScaler's growth tracker

    def update(self, found_inf: bool) -> bool:
        """Account for one step's gradients; True when the step must be skipped."""
        if not self.dynamic:
            return False
        if found_inf:
            self.scale = np.float32(self.scale * np.float32(self.backoff))
            self.finite_steps = 0
            return True
        self.finite_steps += 1
        if self.finite_steps == self.interval:
            grown = np.float32(self.scale * np.float32(self.growth))
            if np.isfinite(grown):  # GradScaler never grows the scale to inf
                self.scale = grown
            self.finite_steps = 0
        return False


def _finite_f32(x: float) -> bool:
    """Whether `x` is a finite float32 (1e39 is not: the scale is an f32)."""
    with np.errstate(over="ignore"):
        return bool(np.isfinite(np.float32(x)))


def parse_loss_scale(spec: str, init: float = 2.0 ** 16, growth: float = 2.0,
                     backoff: float = 0.5, interval: int = 2000) -> LossScaler:
    """`dynamic`, `static=S` or `none`; ValueError with the accepted forms otherwise. The
    dynamic options are checked whatever `spec` is: a bad value given is never ignored."""
    if not (init > 0 and _finite_f32(init) and growth > 1 and _finite_f32(growth)
            and 0 < backoff < 1 and interval >= 1):
        raise ValueError(f"dynamic loss scaling needs a finite f32 init > 0, a finite "
                         f"growth > 1, 0 < backoff < 1 and interval >= 1; got init {init}, "
                         f"growth {growth}, backoff {backoff}, interval {interval}")
    if spec == DYNAMIC:
        return LossScaler(np.float32(init), True, growth, backoff, interval)
    if spec == NONE:
        return LossScaler(np.float32(1.0))
    if spec.startswith("static="):
        try:
            value = float(spec[len("static="):])
        except ValueError:
            value = 0.0
        if value > 0 and np.isfinite(np.float32(value)):
            return LossScaler(np.float32(value))
    raise ValueError(f"--loss-scale must be dynamic, static=S (S > 0) or none, got '{spec}'")
