"""The rank statistics of benchmarks/cost_validation.py (the cost model against onnxruntime),
checked against hand-computed examples."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "cost_validation.py"


@pytest.fixture(scope="module")
def cv():
    spec = importlib.util.spec_from_file_location("cost_validation", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ranks_share_the_mean_rank_between_ties(cv) -> None:
    assert cv.ranks([10.0, 20.0, 20.0, 5.0]) == [2.0, 3.5, 3.5, 1.0]
    assert cv.ranks([3.0, 3.0, 3.0]) == [2.0, 2.0, 2.0]


def test_spearman_without_ties_is_one_minus_six_sum_d_squared_over_n_n2_minus_1(cv) -> None:
    # d = [-1, 1, -1, 1, 0]: 1 - 6 * 4 / (5 * 24) = 0.8
    assert cv.spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8, abs=1e-15)
    assert cv.spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0, abs=1e-15)


def test_spearman_with_ties_is_the_pearson_correlation_of_mean_ranks(cv) -> None:
    # y's ranks [1, 2, 3.5, 5, 3.5]; centred: x [-2, -1, 0, 1, 2], y [-2, -1, .5, 2, .5];
    # covariance 8, variances 10 and 9.5.
    assert cv.spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(8 / math.sqrt(95),
                                                                          rel=1e-14)


def test_spearman_refuses_sequences_of_different_lengths_or_constant(cv) -> None:
    with pytest.raises(ValueError, match="same length"):
        cv.spearman([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="constant sequence"):
        cv.spearman([1, 2, 3], [4, 4, 4])


def test_spearman_agrees_with_scipy_on_data_with_ties(cv) -> None:
    stats = pytest.importorskip("scipy.stats")
    import numpy as np

    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 6, 40).tolist(), rng.integers(0, 6, 40).tolist()
    assert cv.spearman(x, y) == pytest.approx(stats.spearmanr(x, y)[0], rel=1e-12)
