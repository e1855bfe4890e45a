"""The native `iiet` lm-eval backend against lm-eval's own `hf` backend on the export of the same
checkpoint: megatron's model at TP=2, PP=2 and TP=1 with DP=2, and the one-process torch runner,
at batch sizes 1 and 8."""

import math

import pytest

from megatron_iiet.distributed import spawn_local
from tests.eval import workers

LOGPROB_TOL = 1e-4  # native vs hf: two implementations, fp32
BATCH_TOL = 1e-5  # batch size 1 vs 8, one implementation


def _hf_results(folder):
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=str(folder), trust_remote_code=True, batch_size=1, device="cpu",
              dtype="float32")
    ll, rolling, gen = workers.requests()
    out = {}
    for batch_size in (1, 8):
        hf.batch_size_per_gpu = batch_size
        out[batch_size] = {"loglikelihood": hf.loglikelihood(ll),
                           "rolling": hf.loglikelihood_rolling(rolling),
                           "generate": hf.generate_until(gen)}
    return out


def _close(a, b, tol):
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


def _assert_same(got, want, tol, where):
    for (lp, greedy), (lp_ref, greedy_ref) in zip(got["loglikelihood"], want["loglikelihood"],
                                                  strict=True):
        assert _close(lp, lp_ref, tol), (where, lp, lp_ref)
        assert greedy == greedy_ref, where
    for r, r_ref in zip(got["rolling"], want["rolling"], strict=True):
        assert _close(r, r_ref, tol), (where, r, r_ref)
    assert got["generate"] == want["generate"], where


@pytest.fixture(scope="module")
def native(trained):
    """Two ranks: TP=2 (and the model's own loss there), PP=2, then TP=1 with the two ranks
    data-parallel."""
    return spawn_local(workers.score_at_layouts, 2, timeout_s=400, checkpoint=str(trained[1]),
                       layouts=[(2, 1), (1, 2), (1, 1)], own_loss_text=workers.CODE[1])[0]


@pytest.mark.distributed
def test_native_matches_hf_at_every_layout_and_batch_size(native, exported):
    hf = _hf_results(exported)
    _assert_same(hf[8], hf[1], BATCH_TOL, "hf batch 8 vs 1")
    layouts = {"1,1": "TP=1, DP=2", "2,1": "TP=2", "1,2": "PP=2"}
    assert set(native) == {*layouts, "own_loss"}
    for key, label in layouts.items():
        results = native[key]
        _assert_same(results[8], results[1], BATCH_TOL, f"native {label} batch 8 vs 1")
        _assert_same(results[1], hf[1], LOGPROB_TOL, f"native {label} vs hf")
    # the requests are not degenerate: finite, negative, different from each other
    values = [lp for lp, _ in hf[1]["loglikelihood"]]
    assert all(math.isfinite(v) and v < 0 for v in values) and len(set(values)) == len(values)
    assert all(isinstance(t, str) for t in hf[1]["generate"])


def test_one_process_torch_runner_matches_hf(trained, exported):
    from megatron_iiet.eval.local_scorer import LocalScorer
    from megatron_iiet.eval.native_lm import IIETMegatronLM

    lm = IIETMegatronLM(checkpoint=str(trained[1]), progress=False)  # runner auto: torch here
    assert isinstance(lm.scorer, LocalScorer)
    results = workers.run_all(lm)
    hf = _hf_results(exported)
    _assert_same(results[8], results[1], BATCH_TOL, "torch runner batch 8 vs 1")
    _assert_same(results[1], hf[1], LOGPROB_TOL, "torch runner vs hf")
    # Choices of one context run on one pass over it; alone, each request runs whole.
    from megatron_iiet.eval.local_scorer import _worth_sharing

    ll = workers.requests()[0]
    question = [lm._encode_pair(*r.args) for r in ll if r.args[0].startswith("Question")]
    assert len({tuple(context) for context, _ in question}) == 1
    assert _worth_sharing(list(range(len(question))), [(c + k, len(k)) for c, k in question])
    alone = [lm.loglikelihood([r])[0] for r in ll]
    for (lp, greedy), (lp_ref, greedy_ref) in zip(results[8]["loglikelihood"], alone, strict=True):
        assert _close(lp, lp_ref, BATCH_TOL) and greedy == greedy_ref, (lp, lp_ref)


def test_torch_runner_refuses_a_layout(trained):
    from megatron_iiet.errors import OperatorError
    from megatron_iiet.eval.native_lm import IIETMegatronLM

    with pytest.raises(OperatorError, match="runner=torch scores in one process"):
        IIETMegatronLM(checkpoint=str(trained[1]), tensor_parallel=2, runner="torch")
    with pytest.raises(OperatorError, match="runner 'jax'"):
        IIETMegatronLM(checkpoint=str(trained[1]), runner="jax")


@pytest.mark.distributed
def test_rolling_loglikelihood_is_the_models_summed_token_loss(native):
    got = native["own_loss"]  # at TP=2
    assert got["tokens"] > 10
    assert abs(got["rolling"] + got["loss_sum"]) <= 1e-4 * abs(got["loss_sum"]), got
