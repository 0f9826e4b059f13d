"""Write a weights .npz for the sparse lit tests: `weights.py OUT NAME=KxN:KIND ...`.

KIND is `dense` (standard normal, no zeros), `2:4` or `1:2` (that pattern along K, axis 0),
or a fraction of zeros such as `0.9` (the smallest magnitudes zeroed). Plain numpy, so that
the inputs do not depend on the code under test; seeded, so that every run writes the same.
"""

import sys

import numpy as np


def make(shape: tuple[int, int], kind: str, rng: np.random.Generator) -> np.ndarray:
    w = rng.standard_normal(shape).astype(np.float32)
    if kind == "dense":
        return w
    if kind in ("2:4", "1:2"):
        keep, group = (2, 4) if kind == "2:4" else (1, 2)
        g = w.reshape(shape[0] // group, group, shape[1])
        order = np.argsort(-np.abs(g), axis=1, kind="stable")
        mask = np.zeros(g.shape, bool)
        np.put_along_axis(mask, order[:, :keep], True, axis=1)
        return np.where(mask, g, 0).reshape(shape).astype(np.float32)
    cut = np.quantile(np.abs(w), float(kind))
    return np.where(np.abs(w) > cut, w, 0).astype(np.float32)


def main() -> None:
    rng = np.random.default_rng(0)
    arrays = {}
    for spec in sys.argv[2:]:
        name, rest = spec.split("=")
        dims, kind = rest.split(":", 1)
        k, n = (int(d) for d in dims.split("x"))
        arrays[name] = make((k, n), kind, rng)
    np.savez(sys.argv[1], **arrays)


main()
