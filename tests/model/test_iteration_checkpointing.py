"""Per-pass (iteration-level) checkpointing, alone and with megatron-style layer recompute,
gives bitwise the same losses and gradients as no checkpointing, with dropout on."""

import pytest
import torch

from megatron_iiet.distributed import spawn_local
from tests.workers import VARIANTS, checkpointing_matches, kept_tail_recompute

MODES = {
    "all_passes": dict(iteration_checkpointing="all_passes"),
    "all_but_last_pass": dict(iteration_checkpointing="all_but_last_pass"),
    "all_passes_keep_tail": dict(iteration_checkpointing="all_passes_keep_tail"),
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


def test_keeping_the_tail_skips_fc2_and_the_norm_in_the_recompute():
    """Without dropout, all_passes_keep_tail recomputes each pass only up to its gated activation:
    one matmul (FC2) less per pass than all_passes, and no norm, with the plain step's gradients
    bit for bit."""
    results = spawn_local(kept_tail_recompute, 1, variants=VARIANTS)[0]
    for variant in {v for v, _ in results}:
        plain = results[(variant, "none")]
        full = results[(variant, "all_passes")]
        kept = results[(variant, "all_passes_keep_tail")]
        passes = plain["passes"] * 2  # two micro-batches
        for k, g in plain["grads"].items():
            assert torch.equal(g, kept["grads"][k]), f"{variant}: {k} differs"
        assert full["calls"]["mm"] - kept["calls"]["mm"] == passes, (variant, full, kept)
        assert kept["calls"]["native_layer_norm"] == plain["calls"]["native_layer_norm"], variant
        assert kept["calls"]["mm"] > plain["calls"]["mm"], variant  # the rest is recomputed
