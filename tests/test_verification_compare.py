"""The build's comparison of engine outputs with the reference (engines/verification.compare),
against the whole-array float64 formula it computes row by row."""

from __future__ import annotations

import numpy as np

from tandem.engines.verification import compare


def _whole_array(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    r, g = ref.astype(np.float64), got.astype(np.float64)
    return float(np.abs(r - g).max()), max(1.0, float(np.abs(r).max()))


def test_row_by_row_equals_the_whole_array_formula():
    rng = np.random.default_rng(0)
    ref = {"logits": (30 * rng.standard_normal((8, 5, 33))).astype(np.float32),
           "state": rng.standard_normal((8, 2, 3)).astype(np.float32), "scalar": np.float32(2.5)}
    got = {k: (v + 1e-5 * rng.standard_normal(np.shape(v))).astype(np.float32) for k, v in ref.items()}
    result = compare(ref, got, "float32", 0.1)
    for name in ("logits", "state"):
        diff, scale = _whole_array(ref[name], got[name])
        assert result.max_abs_diff[name] == diff and result.scale[name] == scale
    assert result.passed
    got["state"][5, 1, 2] += 1.0
    assert not compare(ref, got, "float32", 0.1).passed


def test_a_nan_anywhere_fails_even_before_larger_rows():
    ref = {"x": np.zeros((3, 4), np.float32)}
    got = {"x": np.zeros((3, 4), np.float32)}
    got["x"][0, 1] = np.nan
    got["x"][2, 0] = 5e-5
    result = compare(ref, got, "float32", 0.0)
    assert np.isnan(result.max_abs_diff["x"]) and not result.passed


def test_float16_skips_the_float_outputs_of_a_flipped_sequence():
    ref = {"tokens": np.array([[1, 2], [3, 4]]), "h": np.zeros((2, 3), np.float16)}
    got = {"tokens": np.array([[1, 2], [3, 9]]), "h": np.array([[0, 0, 0], [7, 7, 7]], np.float16)}
    result = compare(ref, got, "float16", 0.0)
    assert result.passed and result.max_abs_diff == {"tokens": 1.0, "h": 0.0}
    assert not compare(ref, got, "float32", 0.0).passed
