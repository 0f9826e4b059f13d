"""Derives the coefficient tables of mplower/numerics/special.py's float32 erf kernel.

Each table is a Chebyshev approximation (mpmath.chebyfit: interpolation at Chebyshev nodes in
40-digit arithmetic, turned into monomial coefficients) rounded to float64; the kernel's error
bound is then measured, not derived from these fits (benchmarks/erf_exhaustive.py checks all
2^32 float32 inputs). Run it with `python benchmarks/erf_fit.py` and paste the output into
special.py: the degrees and intervals below are the ones the kernel's comments describe.
"""

from __future__ import annotations

import mpmath as mp

# The kernel's split: |x| < SPLIT uses erf(x) = x * P(x^2); SPLIT <= |x| <= CLAMP uses
# erfc(x) = exp(-x^2) * Q(T / (T + |x|)), after the continued-fraction-like substitution of
# Numerical Recipes (3rd ed., section 6.2.2, which uses t = 2 / (2 + x)); erfc(6) < 2^-55.
SPLIT, CLAMP, T = 1.0, 6.0, 3.0
DEGREE = 12  # both tables: the kernel runs one Horner loop over blended coefficients
EXP_DEGREE = 10  # exp(f) for |f| <= ln(2) / 2 (with some margin)


def _fit(f, lo: float, hi: float, degree: int) -> list[float]:
    coefficients, _ = mp.chebyfit(f, [lo, hi], degree + 1, error=True)
    return [float(c) for c in coefficients]


def tables() -> dict[str, list[float]]:
    mp.mp.dps = 40
    small = _fit(lambda s: mp.erf(mp.sqrt(s)) / mp.sqrt(s) if s else 2 / mp.sqrt(mp.pi),
                 0, SPLIT * SPLIT, DEGREE)
    large = _fit(lambda t: mp.erfc(T / t - T) * mp.exp((T / t - T) ** 2),
                 T / (T + CLAMP), T / (T + SPLIT), DEGREE)
    exp = _fit(mp.exp, -0.35, 0.35, EXP_DEGREE)
    return {"_ERF_SMALL": small, "_ERFC_LARGE": large, "_EXP": exp}


if __name__ == "__main__":
    for name, values in tables().items():
        print(f"{name} = (")
        for v in values:
            print(f"    {v!r},")
        print(")")
