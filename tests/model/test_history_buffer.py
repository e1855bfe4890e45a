"""The history over a state buffer with per-layer partial sums (model/history.py) computes what
the direct form computes: every pass's pop and every refine recombining all states so far.

The direct form is kept here as the reference (the project's code before the buffer): a list of
states, each pop/refine a chain of scalar-times-state products. At 6 layers, for IIET r=3, an
E-IIET plan and both PCformers, the buffered model at TP=1, TP=2 and PP=2 (PP with megatron
freeing what it sends) gives the reference's loss and every gradient, the history's own W/Wc
rows included, and its logits (at PP=2, where the schedule returns no logits, the loss stands
in). No dropout.

The comparison is made in float64, where the two forms agree to ~1e-14: the algebra is the
same. In float32 the summation order differs (one matmul over the states vs a chain of
products), which shows at ~1e-7 in logits and gradients and up to ~6e-5 in the W/Wc rows'
gradients (inner products over whole hidden states with heavy cancellation: which of the two
float32 results is closer to float64 is a coin toss); that is checked too, at those tolerances.
"""

import pytest
import torch

from megatron_iiet.distributed import spawn_local
from tests.workers import micro_batches, variant_id

pytestmark = pytest.mark.distributed

LAYERS = 6
VARIANTS = [
    ("iiet", "history", None),
    ("iiet", "history", [3, 1, 0, 2, 3, 0]),
    ("pcformer_rk2", "history", None),
    ("pcformer_rk4", "history", None),
]
RTOL = {"float64": 1e-10, "float32": 1e-5}
MIXING_SCALAR_RTOL = {"float64": 1e-10, "float32": 2e-4}
# megatron's vocab-parallel cross entropy casts the logits to float32; at TP=2 the logits'
# float64 all-reduce order then flips float32 roundings in the loss's gradient (~3e-9).
LAYOUT_RTOL = 1e-7


# ---- the reference: the direct form --------------------------------------------------------
def _combine(weights, states):
    out = weights[0] * states[0]
    for k in range(1, len(states)):
        out = out + weights[k] * states[k]
    return out


def _direct_layer(layer, x, states, shared, block_kwargs):
    from megatron_iiet.model.architectures import StepInputs, _pcformer_predictor
    from megatron_iiet.model.ode_step import PassRunner

    run = PassRunner(layer.block, block_kwargs, [False] * layer.passes)
    h = layer.history
    if layer.architecture.name.startswith("pcformer"):
        s = StepInputs(x=x, history=None, run=run, layer=layer, shared=shared, iterations=0)
        states = states + [h.predictor_norm(_pcformer_predictor(s))]
        states[-1] = run(_combine(h.pop_weight, states), norm=h.corrector_norm)
    else:
        states = states + [run(x, norm=h.predictor_norm)]
        for _ in range(layer.iterations):
            states[-1] = run(_combine(h.pop_weight, states), norm=h.corrector_norm)
    run.finish()
    return _combine(h.refine_weight, states), states


def _direct_decoder_forward(stack, hidden_states, attention_mask=None, rotary_pos_emb=None):
    assert stack.pre_process and stack.post_process, "the reference runs at PP=1"
    block_kwargs = {"attention_mask": attention_mask, "rotary_pos_emb": rotary_pos_emb}
    x, states = hidden_states, [hidden_states]
    for layer in stack.layers:
        x, states = _direct_layer(layer, x, states, stack.shared, block_kwargs)
    return stack.final_norm(x)


# ---- spawned ranks ---------------------------------------------------------------------------
def run_variants(direct: bool, dtypes=("float64",), **overrides):
    """Per dtype and variant: logits of one batch (PP=1), the step's losses and full grads."""
    return {dtype: _run_variants(direct, params_dtype=getattr(torch, dtype), **overrides)
            for dtype in dtypes}


def _run_variants(direct: bool, **overrides):
    import types

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_iiet.distributed import seed_everything
    from megatron_iiet.model.sharding import gather_full, grads_of
    from megatron_iiet.training.step import forward_backward
    from tests.workers import build_tiny

    results = {}
    for variant in VARIANTS:
        seed_everything(99)
        model = build_tiny(variant, num_layers=LAYERS, **overrides)
        if direct:
            model.decoder.forward = types.MethodType(_direct_decoder_forward, model.decoder)
        batches = micro_batches()
        seed_everything(5)
        losses = [m["loss"] for m in forward_backward(model, batches)]
        grads = gather_full(model, grads_of(model))
        model.zero_grad(set_to_none=True)
        logits = None
        if ps.get_pipeline_model_parallel_world_size() == 1:  # (at PP=2: the loss stands in)
            with torch.no_grad():
                logits = gather_from_tensor_model_parallel_region(model(batches[0]["input_ids"]))
        results[variant_id(variant)] = {
            "losses": losses if ps.is_pipeline_last_stage() else None,
            "grads": grads, "logits": logits,
        }
    return results


@pytest.fixture(scope="module")
def single_process():
    """The direct form and the buffered one, same weights, one rank."""
    dtypes = ("float64", "float32")
    return (spawn_local(run_variants, 1, direct=True, dtypes=dtypes)[0],
            spawn_local(run_variants, 1, direct=False, dtypes=dtypes)[0])


def _assert_matches(reference, got, what, dtype="float64", rtol=None):
    reference, got = reference[dtype], got[dtype]
    rtol, mixing_rtol = rtol or RTOL[dtype], rtol or MIXING_SCALAR_RTOL[dtype]
    for variant in map(variant_id, VARIANTS):
        ref, new = reference[variant], got[variant]
        for a, b in zip(ref["losses"], new["losses"]):
            assert abs(a - b) <= rtol * abs(a), (what, variant, a, b)
        if ref["logits"] is not None and new["logits"] is not None:
            rel = ((new["logits"] - ref["logits"]).norm() / ref["logits"].norm()).item()
            assert rel <= rtol, f"{what} {variant} logits: {rel:.2e}"
        assert set(ref["grads"]) == set(new["grads"]), variant
        for name, g in ref["grads"].items():
            rel = ((new["grads"][name] - g).norm() / g.norm().clamp(min=1e-30)).item()
            mixing = name.endswith(("pop_weight", "refine_weight", "shared.alpha"))
            assert rel <= (mixing_rtol if mixing else rtol), \
                f"{what} {variant} {name}: relative gradient difference {rel:.2e}"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_buffered_history_matches_the_direct_form(single_process, dtype):
    direct, buffered = single_process
    _assert_matches(direct, buffered, "tp1", dtype)


@pytest.mark.parametrize("tp,pp,overrides", [
    (2, 1, {}),
    (1, 2, {"deallocate_pipeline_outputs": True}),
], ids=["tp2", "pp2"])
def test_buffered_history_matches_the_direct_form_at_layout(single_process, tp, pp, overrides):
    direct, _ = single_process
    ranks = spawn_local(run_variants, tp * pp, tp, pp, timeout_s=900, direct=False, **overrides)
    last_stage = ranks[-1]  # the last rank is on the last pipeline stage
    got = {"float64": {k: dict(v, losses=last_stage["float64"][k]["losses"])
                       for k, v in ranks[0]["float64"].items()}}
    _assert_matches(direct, got, f"tp{tp} pp{pp}", rtol=LAYOUT_RTOL)
