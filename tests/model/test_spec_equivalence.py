"""The decoder computes the spec's formulas (checked against direct implementations)."""

import pytest

from megatron_iiet.distributed import spawn_local
from tests.workers import VARIANTS, flops_against_counter, spec_equivalence, variant_id


@pytest.fixture(scope="module")
def spec():
    return spawn_local(spec_equivalence, 1)[0]


def test_history_form_with_onehot_weights_is_repeated_block(spec):
    # W, Wc one-hot on the current layer and Np, Nc the identity: r+1 applications of Block_l.
    assert spec["history_onehot_vs_repeated_block"] <= 1e-6 * spec["history_onehot_scale"]


def test_fixed_point_form_is_the_direct_loop(spec):
    assert spec["fixed_point_vs_direct_loop"] <= 1e-6 * spec["fixed_point_scale"]


def test_flops_accounting_counts_every_pass():
    counted = spawn_local(flops_against_counter, 1, variants=VARIANTS)[0]
    for variant in map(variant_id, VARIANTS):
        measured, analytic = counted[variant]
        assert abs(measured - analytic) <= 0.005 * measured, (variant, measured, analytic)
