"""Config validation, presets and FLOPs arithmetic (in-process: no process group needed)."""

import pytest

from megatron_iiet.distributed import spawn_local
from megatron_iiet.model.config import preset
from megatron_iiet.model.flops import passes_per_layer, step_flops
from tests.workers import preset_parameter_counts


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(architecture="transformer_xl"), "architecture"),
        (dict(formulation="newton"), "formulation"),
        (dict(iterations=[3] * 5), "iterations"),  # tiny has 4 layers
        (dict(iterations=[3, 3, 3, 4]), "iterations"),  # beyond max_iterations
        (dict(architecture="vanilla", iterations=[1] * 4), "iterations"),
        (dict(pipeline_model_parallel_size=3), "pipeline_model_parallel_size"),
        (dict(iteration_checkpointing="some"), "iteration_checkpointing"),
        (dict(iteration_checkpointing="all_passes", recompute_granularity="selective"),
         "iteration_checkpointing"),
        (dict(iteration_checkpointing="all_passes", recompute_granularity="full",
              recompute_method="uniform", recompute_num_layers=1), "iteration_checkpointing"),
        (dict(iteration_checkpointing="all_passes_keep_tail", compile=True),
         "iteration_checkpointing"),
        (dict(history_init="random"), "history_init"),
        (dict(no_such_field=1), "no_such_field"),
    ],
)
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        preset("tiny", **overrides)


def test_layer_recompute_block_composes_with_pass_checkpointing():
    cfg = preset("tiny", iteration_checkpointing="all_passes", recompute_granularity="full",
                 recompute_method="block", recompute_num_layers=2)
    # two layers recomputed whole (4 passes each), two with every pass checkpointed
    f = step_flops(cfg, 1, 16)
    per_layer_forward = (f.forward - 2 * 16 * 64 * 512) / 4
    assert f.hardware - f.model == pytest.approx(4 * per_layer_forward)


def test_keeping_the_tail_recomputes_each_pass_but_fc2():
    plain = preset("tiny", iteration_checkpointing="all_passes")
    kept = plain.replace(iteration_checkpointing="all_passes_keep_tail")
    fc2 = 2 * 16 * kept.ffn_hidden_size * kept.hidden_size  # one pass of 16 tokens
    passes = sum(passes_per_layer(kept))
    f_plain, f_kept = step_flops(plain, 1, 16), step_flops(kept, 1, 16)
    assert f_plain.hardware - f_kept.hardware == pytest.approx(passes * fc2)
    assert f_kept.model == f_plain.model
    # with hidden dropout the mask after FC2 is recomputed, and FC2 with it
    dropped = kept.replace(hidden_dropout=0.1)
    assert step_flops(dropped, 1, 16).hardware == pytest.approx(f_plain.hardware)


def test_passes_per_layer():
    assert passes_per_layer(preset("tiny", architecture="vanilla")) == [1] * 4
    assert passes_per_layer(preset("tiny", architecture="ode_rk4")) == [4] * 4
    assert passes_per_layer(preset("tiny", architecture="pcformer_rk2")) == [3] * 4
    assert passes_per_layer(preset("tiny", architecture="pcformer_rk4")) == [5] * 4
    assert passes_per_layer(preset("tiny")) == [4] * 4
    assert passes_per_layer(preset("tiny", iterations=[3, 0, 1, 2])) == [4, 1, 2, 3]


def test_iiet_layers_cost_passes_times_vanilla():
    logits = 2 * 2 * 32 * 64 * 512
    vanilla = step_flops(preset("tiny", architecture="vanilla"), 2, 32).forward - logits
    iiet = step_flops(preset("tiny"), 2, 32).forward - logits
    assert iiet == pytest.approx(4 * vanilla)


def _spec_table_count(hidden, layers, ffn, tied, vocab=32000):
    per_layer = 4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden  # attn, SwiGLU, 2 RMSNorms
    return vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden


@pytest.mark.slow
def test_preset_parameter_counts_match_spec_table():
    counts = spawn_local(preset_parameter_counts, 1, names=["55m", "340m", "1.3b"])[0]
    table = {"55m": (512, 12, 1408, True), "340m": (1024, 24, 2816, True),
             "1.3b": (2048, 24, 5432, False)}
    for name, dims in table.items():
        expected = _spec_table_count(*dims)
        for arch in ("vanilla", "iiet"):
            got = counts[(name, arch)]
            assert abs(got - expected) <= 0.01 * expected, (name, arch, got, expected)
    assert 54e6 < counts[("55m", "iiet")] < 56e6
    assert 336e6 < counts[("340m", "iiet")] < 344e6


@pytest.mark.parametrize("init", ["uniform", "current"])
def test_history_init_sets_the_rows_of_w_and_wc(init):
    from megatron_iiet.model.history import LayerHistoryParams

    layer = LayerHistoryParams(preset("tiny", history_init=init), layer_number=3)
    expected = [0.25] * 4 if init == "uniform" else [0.0, 0.0, 0.0, 1.0]
    for row in (layer.pop_weight, layer.refine_weight):
        assert row.requires_grad and row.tolist() == pytest.approx(expected)
