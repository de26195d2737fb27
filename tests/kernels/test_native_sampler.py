"""The native host sampler (plugins/cpu/sampler.cc through pipeline/native_sampler.py): numpy's
tokens up to rounding at a boundary between two tokens, each row's bits independent of the rows
beside it, the same bits in its portable and AVX-512 forms, and the pipeline drawing with it where
the engine dir's kernel library has it."""

from __future__ import annotations

import ctypes.util
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tandem.pipeline import native_sampler
from tandem.pipeline.llm import LLM
from tandem.pipeline.native_sampler import NativeSampler
from tandem.pipeline.sampler import filtered_probs, uniforms
from tandem.pipeline.sampling_params import SamplingParams
from tandem.plugins import cpu_kernels
from tandem.plugins.cpu_features import cpu_signature
from tandem.testing.sampling_reference import lm_like_logits

SETTINGS = [(0.8, 0, 1.0), (1.0, 1, 1.0), (1.3, 20, 1.0), (0.5, 383, 1.0), (2.0, 0, 0.9), (0.8, 40, 0.95),
            (1.0, 0, 0.5), (1.0, 3000, 0.99), (1e-5, 0, 1.0), (0.7, 0, 1e-300), (1.0, 0, 0.999)]
ROUNDING = 1e-6      # how far the two samplers' cumulative probabilities may differ


@pytest.fixture(scope="module")
def native() -> NativeSampler:
    library = cpu_kernels.library()
    if library is None:
        pytest.skip("no C++ compiler here: the kernel library, and so the native sampler, is not built")
    return NativeSampler(library)


def _draw(native: NativeSampler, logits: np.ndarray, params: list[SamplingParams], u) -> tuple[np.ndarray, np.ndarray]:
    probs = np.zeros(logits.shape)
    return native.sample(logits, params, np.asarray(u, np.float32), probs), probs


@pytest.mark.parametrize("vocab, spread", [(384, 4.0), (384, 0.1), (4096, 3.0), (4096, 0.05), (40_000, 2.0),
                                           (40_000, 0.3)])
@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS)
def test_native_tokens_are_numpys_up_to_rounding(native, vocab, spread, temperature, top_k, top_p):
    """Every row's kept tokens and probabilities are numpy's (within rounding), and its token at any
    uniform is one numpy's cumulative probabilities allow within rounding of u."""
    rng = np.random.default_rng(vocab + top_k)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    batch = np.stack([lm_like_logits(rng, vocab, spread) for _ in range(5)])
    for u in (0.0, 0.3, 0.999, 1 - 2**-24, *rng.random(4)):
        tokens, probs = _draw(native, batch, [params] * 5, [u] * 5)
        for row, token, got in zip(batch, tokens.tolist(), probs):
            ref = filtered_probs(row, temperature, top_k, top_p)
            assert np.abs(got - ref).max() < ROUNDING and abs(got.sum() - 1) < 1e-9
            assert np.array_equal(got > 1e-30, ref > 1e-30)            # the same tokens kept
            cdf = np.cumsum(ref)
            below = cdf[token - 1] if token else 0.0
            assert got[token] > 0 and below <= u + ROUNDING and cdf[token] > u - ROUNDING, (token, u)


@pytest.mark.parametrize("vocab", [384, 40_000])
def test_a_native_rows_bits_do_not_depend_on_the_rows_beside_it(native, vocab):
    """Rows of every kind, peaked and flat, in batches of any order and company: each row's token
    and probabilities are the bits it gets alone."""
    rng = np.random.default_rng(vocab)
    settings = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in SETTINGS]
    logits = np.stack([lm_like_logits(rng, vocab, 2.0 if i % 3 else 0.05) for i in range(22)])
    params = [settings[i % len(settings)] for i in range(22)]
    u = uniforms([7], np.arange(22)[None])[0]
    alone = [_draw(native, logits[i : i + 1], params[i : i + 1], u[i : i + 1]) for i in range(22)]
    for rows in (np.arange(22), np.arange(22)[::-1], np.array([5, 1, 4, 10, 17, 20, 13])):
        tokens, probs = _draw(native, logits[rows], [params[i] for i in rows], u[rows])
        for j, i in enumerate(rows):
            assert tokens[j] == alone[i][0][0] and probs[j].tobytes() == alone[i][1][0].tobytes()


def test_the_portable_and_avx512_forms_give_the_same_bits(native, monkeypatch):
    if "avx512f" not in cpu_signature():
        pytest.skip("this CPU has no AVX-512: only the portable form runs here")
    rng = np.random.default_rng(5)
    for vocab in (384, 4097, 40_000):       # 4097: a part vector and a part block at the end
        logits = np.stack([lm_like_logits(rng, vocab, s) for s in (0.05, 1.0, 3.0)])
        for t, k, p in SETTINGS:
            params = [SamplingParams(temperature=t, top_k=k, top_p=p)] * 3
            u = rng.random(3)
            fast = _draw(native, logits, params, u)
            monkeypatch.setenv("TANDEM_CPU_KERNELS_PORTABLE", "1")    # the library reads it at each call
            portable = _draw(native, logits, params, u)
            monkeypatch.delenv("TANDEM_CPU_KERNELS_PORTABLE")
            assert fast[0].tolist() == portable[0].tolist() and fast[1].tobytes() == portable[1].tobytes()


def test_masked_and_extreme_rows(native):
    """Masked tokens (a grammar's -inf) are never drawn; one allowed token is always drawn; a row
    with nothing finite draws token 0; huge temperatures stay valid."""
    rng = np.random.default_rng(11)
    logits = rng.standard_normal((4, 500)).astype(np.float32) * 3
    allowed = rng.random(500) < 0.05
    logits[:, ~allowed] = -np.inf
    logits[1, :] = -np.inf
    logits[1, 123] = 2.0
    logits[2, :] = -np.inf
    for t, k, p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.0, 0, 0.9), (1e30, 0, 1.0), (3.4e38, 10, 0.5)]:
        for u in (0.0, 0.5, 1 - 2**-24, *rng.random(5)):
            tokens, probs = _draw(native, logits, [SamplingParams(temperature=t, top_k=k, top_p=p)] * 4, [u] * 4)
            assert allowed[tokens[0]] and allowed[tokens[3]] and tokens[1] == 123 and tokens[2] == 0
            assert not probs[0][~allowed].any() and probs[1][123] == 1.0 and np.isfinite(probs).all()


def test_a_library_without_the_sampler_leaves_numpy_to_sample(tmp_path):
    assert native_sampler.load(None) is None
    assert native_sampler.load(tmp_path / "missing.so") is None
    libm = ctypes.util.find_library("m")
    if libm:        # a shared library that loads but predates the sampler
        assert native_sampler.load(Path(libm)) is None


def test_the_pipeline_draws_with_the_engine_dirs_native_sampler(engine_dirs, monkeypatch):
    """An engine dir whose kernel library has the sampler: every host draw of a sampled request goes
    through it (the first token, plain steps, bursts), and a seed gives the same tokens alone and
    beside other requests."""
    llm = LLM(engine_dirs["qwen3_5_mtp3"])
    if cpu_kernels.library() is None:
        assert llm.sampler.native is None
        pytest.skip("no C++ compiler here: the engine dir carries no kernel library")
    assert llm.sampler.native is not None
    calls = []
    real = NativeSampler.sample
    monkeypatch.setattr(NativeSampler, "sample", lambda self, *a, **k: calls.append(len(a[1])) or real(self, *a, **k))
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True, speculative=False)
    alone = llm.generate([[5, 9, 77, 120]], params)[0].token_ids
    assert sum(calls) == 16          # one draw a token, none by numpy
    others = [replace(params, seed=s, max_tokens=9 + s) for s in range(5)]
    together = llm.generate([[5, 9, 77, 120], *[[3 + s, 40] for s in range(5)]], [params, *others])
    assert together[0].token_ids == alone


@pytest.mark.parametrize("form", ["fast", "portable"])
def test_native_logprobs_are_numpys_to_rounding(native, monkeypatch, form):
    """tandem_logprobs_rows: each row's token logprob and its top n (most likely first, the lower id
    first among equals, as TopK) are numpy's from_rows to float32 rounding; strided rows (a bucket's
    logits) read in place; rows with ties and -inf logits too."""
    from tandem.pipeline.logprobs import from_rows

    if form == "portable":
        monkeypatch.setenv("TANDEM_CPU_KERNELS_PORTABLE", "1")    # the library reads it at each call
    rng = np.random.default_rng(3)
    logits = np.stack([lm_like_logits(rng, 4096, 1.5) for _ in range(6)]).astype(np.float32)
    logits[1, :50] = logits[1, 4000]                     # ties at the top
    logits[2, ::3] = -np.inf                             # masked-out logits
    padded = np.zeros((6, 5000), np.float32)
    padded[:, :4096] = logits
    tokens = [int(t) for t in rng.integers(0, 4096, 6)]
    tokens[2] = 1
    for rows, n in ((logits, 5), (padded[:, :4096], 20), (logits, 0)):
        token_lp, top_ids, top_lp = native.logprobs(rows, tokens, n)
        want = from_rows(logits, tokens, [n] * 6)
        np.testing.assert_allclose(token_lp, [w.logprob for w in want], rtol=0, atol=2e-6)
        for i, w in enumerate(want):
            assert top_ids[i].tolist() == [t for t, _ in w.top]
            np.testing.assert_allclose(top_lp[i], [v for _, v in w.top], rtol=0, atol=2e-6)
