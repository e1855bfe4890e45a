"""Per-pass (iteration-level) checkpointing, alone and with megatron-style layer recompute,
gives bitwise the same losses and gradients as no checkpointing, with dropout on."""

import pytest

from megatron_iiet.distributed import spawn_local
from tests.workers import VARIANTS, checkpointing_matches

MODES = {
    "all_passes": dict(iteration_checkpointing="all_passes"),
    "all_but_last_pass": dict(iteration_checkpointing="all_but_last_pass"),
    "layer_full_uniform": dict(recompute_granularity="full", recompute_method="uniform",
                               recompute_num_layers=2),
    "layer_block_then_passes": dict(recompute_granularity="full", recompute_method="block",
                                    recompute_num_layers=2, iteration_checkpointing="all_passes"),
}


@pytest.fixture(scope="module")
def results():
    return spawn_local(checkpointing_matches, 1, variants=VARIANTS, modes=MODES)[0]


@pytest.mark.parametrize("mode", list(MODES))
def test_checkpointed_equals_plain_bitwise(results, mode):
    for (variant, m), r in results.items():
        if m != mode:
            continue
        assert r["dropout_active"], f"{variant}: dropout had no effect; the test proves nothing"
        assert r["losses_equal"], f"{variant} {mode}: losses differ"
        assert not r["mismatched_grads"], f"{variant} {mode}: {r['mismatched_grads']}"
