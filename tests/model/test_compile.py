"""``model.compile``: each pass under torch.compile gives eager's losses and gradients to fp32
rounding (inductor fuses and reorders reductions, so not bitwise), at TP=1 and TP=2, and per-pass
checkpointing of a compiled pass replays its dropout masks exactly."""

import pytest
import torch

from megatron_iiet.distributed import spawn_local
from tests.workers import compiled_against_eager, loss_and_grads

# The history (IIET), the stage norms (PCformer: a pass with a norm) and the plain block.
VARIANTS = [("iiet", "history", None), ("pcformer_rk2", "history", None),
            ("vanilla", "history", None)]
LOSS_RTOL = 1e-6
# ||compiled - eager|| of each parameter's gradient, relative to the norm of the whole gradient
# (measured <= 2e-7), and relative to that parameter's own gradient (measured <= 3e-5: the
# history weights' and PCformer's alpha, whose gradients are ~1e-4 of the whole and sums over
# every token with heavy cancellation, so reordering them in fp32 shows most).
GRAD_RTOL_OF_TOTAL = 1e-6
GRAD_RTOL_OF_OWN = 1e-4


def _grad_errors(a: dict, b: dict) -> tuple[dict, dict]:
    total = torch.sqrt(sum(g.norm() ** 2 for g in a.values()))
    diff = {k: (a[k] - b[k]).norm() for k in a}
    return ({k: (d / total).item() for k, d in diff.items()},
            {k: (d / a[k].norm().clamp_min(1e-30)).item() for k, d in diff.items()})


@pytest.fixture(scope="module")
def tp1():
    return spawn_local(compiled_against_eager, 1, timeout_s=900, variants=VARIANTS)[0]


@pytest.mark.parametrize("variant", ["iiet-history", "pcformer_rk2", "vanilla"])
def test_compiled_matches_eager(tp1, variant):
    (eager_losses, eager_grads), (losses, grads) = tp1[variant]["eager"], tp1[variant]["compiled"]
    assert losses == pytest.approx(eager_losses, rel=LOSS_RTOL)
    of_total, of_own = _grad_errors(eager_grads, grads)
    for errors, tolerance in ((of_total, GRAD_RTOL_OF_TOTAL), (of_own, GRAD_RTOL_OF_OWN)):
        worst = max(errors, key=errors.get)
        assert errors[worst] < tolerance, f"{variant}: {worst} differs by {errors[worst]:.2e}"


@pytest.mark.parametrize("variant", ["iiet-history", "pcformer_rk2", "vanilla"])
def test_checkpointed_compiled_pass_replays_dropout(tp1, variant):
    (plain_losses, plain_grads) = tp1[variant]["dropout_plain"]
    (losses, grads) = tp1[variant]["dropout_checkpointed"]
    assert plain_losses != tp1[variant]["compiled"][0], "dropout had no effect"
    assert losses == plain_losses
    assert all(torch.equal(plain_grads[k], grads[k]) for k in plain_grads)


def test_compiled_at_tp2_matches_eager_tp1(tp1):
    ranks = spawn_local(loss_and_grads, 2, 2, 1, timeout_s=900, variants=[VARIANTS[0]],
                        compile=True)
    eager_losses, eager_grads = tp1["iiet-history"]["eager"]
    got = ranks[0]["iiet-history"]
    assert got["losses"] == pytest.approx(eager_losses, rel=LOSS_RTOL)
    of_total, of_own = _grad_errors(eager_grads, got["grads"])
    assert max(of_total.values()) < GRAD_RTOL_OF_TOTAL
    assert max(of_own.values()) < GRAD_RTOL_OF_OWN
