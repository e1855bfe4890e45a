"""The distillation objective inside a training step (gloo ranks, in process):

- with two teachers (an IIET and a PCformer) of weights a and b, the step's loss is
  CE + a*KL1 + b*KL2, each KL computed separately from the teachers' own logits;
- teachers and student at PP=2 give PP=1's losses, terms and gradients (1e-6);
- the top-k KL of precomputed (offline) logits equals the live teacher's KL restricted to the
  same top-k (1e-6), and with k = V it is the full KL.
"""

import pytest
import torch

from megatron_iiet.distributed import spawn_local

pytestmark = pytest.mark.distributed

STUDENT = ("iiet", "history", [1, 0, 2, 1])
TEACHERS = [(("iiet", "history", None), 0.3, 11), (("pcformer_rk2", "history", None), 0.7, 12)]
TOL = 1e-6


def _objective(positions="labelled"):
    from megatron.core import parallel_state as ps

    from megatron_iiet.iiad.distill import DistillationObjective, LiveTeacher
    from megatron_iiet.model.sharding import init_layout_independent
    from tests.workers import build_tiny

    teachers = []
    for variant, weight, seed in TEACHERS:
        model = build_tiny(variant)
        init_layout_independent(model, seed=seed)  # not the student's weights
        model.eval().requires_grad_(False)
        teachers.append(LiveTeacher(variant[0], weight, model, "-", variant[0]))
    return DistillationObjective(teachers, kl_weight=1.5, temperature=2.0, positions=positions,
                                 pipelined=ps.get_pipeline_model_parallel_world_size() > 1)


def distill_step(separately: bool):
    from megatron.core import parallel_state as ps

    from megatron_iiet.iiad.kl import vocab_parallel_kl
    from megatron_iiet.model.sharding import gather_full, grads_of
    from megatron_iiet.training.step import forward_backward
    from tests.workers import build_tiny, micro_batches

    batches = micro_batches(3)
    batches[1]["loss_mask"][:, :5] = 0  # a masked prefix: the labelled positions differ
    objective = _objective()
    student = build_tiny(STUDENT)
    metrics = forward_backward(student, batches, objective=objective)
    out = {"metrics": metrics, "grads": gather_full(student, grads_of(student)),
           "names": objective.metric_names}
    if separately and ps.get_pipeline_model_parallel_world_size() == 1:
        expected = []
        with torch.no_grad():
            for b in batches:
                logits = student(b["input_ids"])
                lm = student(b["input_ids"], labels=b["labels"])
                mask = b["loss_mask"]
                lm = float((lm * mask).sum() / mask.sum())
                kls = []
                for t in objective.teachers:
                    kl = vocab_parallel_kl(logits, t.model(b["input_ids"]), 2.0)
                    kls.append(4.0 * float((kl * mask).sum() / mask.sum()))
                expected.append({"lm": lm, "kls": kls,
                                 "loss": lm + 1.5 * (0.3 * kls[0] + 0.7 * kls[1])})
        out["expected"] = expected
    return out


@pytest.fixture(scope="module")
def pp1():
    return spawn_local(distill_step, 1, separately=True)[0]


def test_two_weighted_teachers_loss_is_the_sum_of_the_separate_terms(pp1):
    got = pp1
    assert got["names"] == ["loss", "lm", "kl_iiet", "kl_pcformer_rk2"]
    for m, e in zip(got["metrics"], got["expected"]):
        assert m["lm"] == pytest.approx(e["lm"], abs=TOL)
        assert m["kl_iiet"] == pytest.approx(e["kls"][0], abs=TOL)
        assert m["kl_pcformer_rk2"] == pytest.approx(e["kls"][1], abs=TOL)
        assert m["loss"] == pytest.approx(e["loss"], abs=TOL)
        assert min(e["kls"]) > 1e-3  # the teachers really differ from the student


def test_teachers_at_pp2_give_pp1_losses_and_gradients(pp1):
    one = pp1
    two = spawn_local(distill_step, 2, 1, 2, separately=False)
    last = two[1]
    for a, b in zip(one["metrics"], last["metrics"]):
        for k in a:
            assert b[k] == pytest.approx(a[k], abs=TOL), k
    for name, g in one["grads"].items():
        assert torch.allclose(two[0]["grads"][name], g, atol=TOL, rtol=0), name


def topk_against_live(tp_world: int):
    from megatron_iiet.iiad.kl import topk_kl, vocab_parallel_kl, vocab_parallel_topk
    from megatron_iiet.iiad.teacher_logits import OfflineTeacher, shard_bytes
    from tests.workers import build_tiny, micro_batches

    batch = micro_batches(1)[0]
    objective = _objective()
    teacher = objective.teachers[0].model
    student = build_tiny(STUDENT)
    with torch.no_grad():
        t_logits = teacher(batch["input_ids"])
    s_logits = student(batch["input_ids"])
    ids, values = vocab_parallel_topk(t_logits, 16)
    live = topk_kl(s_logits, ids, values, 2.0)
    # the same top-k through the offline format (fp32 storage: exact)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        Path(d, "shard_00000.pt").write_bytes(shard_bytes(
            ids, values, batch["input_ids"].sum(-1), 0))
        offline = OfflineTeacher("t", 1.0, Path(d), {"shard_samples": 8}, "test")
        batch["sample_index"] = torch.tensor([0, 1])
        o_ids, o_values = offline.topk(batch)
    stored = topk_kl(s_logits, o_ids, o_values, 2.0)
    full_ids, full_values = vocab_parallel_topk(t_logits, 512)  # k = V
    everything = topk_kl(s_logits, full_ids, full_values, 2.0)
    full = vocab_parallel_kl(s_logits, t_logits, 2.0)
    grad_live = torch.autograd.grad(live.sum(), s_logits, retain_graph=True)[0]
    grad_stored = torch.autograd.grad(stored.sum(), s_logits)[0]
    return {"live": live.detach(), "stored": stored.detach(), "all": everything.detach(),
            "full": full.detach(), "grad_gap": float((grad_live - grad_stored).abs().max()),
            "ids": ids}


def test_offline_topk_kl_equals_live_topk_kl_at_tp1_and_tp2():
    ref = spawn_local(topk_against_live, 1, tp_world=1)[0]
    for r in [ref, *spawn_local(topk_against_live, 2, 2, 1, tp_world=2)]:
        assert torch.allclose(r["stored"], r["live"], atol=TOL, rtol=0)
        assert r["grad_gap"] <= TOL
        assert torch.allclose(r["all"], r["full"], atol=1e-5, rtol=0)  # k = V: the full KL
        # TP=2's top-k and KL are TP=1's
        assert torch.equal(r["ids"], ref["ids"])
        assert torch.allclose(r["live"], ref["live"], atol=TOL, rtol=0)


def zero3_teacher():
    from megatron_iiet.iiad.distill import LiveTeacher, _zero3_partitioned
    from megatron_iiet.training.engines import init_deepspeed_distributed
    from tests.workers import build_tiny, micro_batches

    init_deepspeed_distributed()
    batch = micro_batches(1)[0]
    plain = build_tiny(("pcformer_rk2", "history", None)).eval().requires_grad_(False)
    whole = LiveTeacher("p", 1.0, plain, "-", "pcformer_rk2")
    with torch.no_grad():
        expected = whole.logits(batch)
    held = build_tiny(("pcformer_rk2", "history", None)).eval().requires_grad_(False)
    partitioned = LiveTeacher("p", 1.0, _zero3_partitioned(held), "-", "pcformer_rk2")
    return {"gap": float((partitioned.logits(batch) - expected).abs().max()),
            "whole_bytes": whole.parameter_bytes(), "held_bytes": partitioned.parameter_bytes()}


def test_zero3_teacher_gives_the_same_logits_from_a_partition():
    """DeepSpeed ZeRO-3 holds the teacher partitioned over DP=2: each rank keeps about half of
    its parameters and gathers them for the forward; the logits are the whole teacher's."""
    for r in spawn_local(zero3_teacher, 2):
        assert r["gap"] <= TOL
        assert r["held_bytes"] <= 0.55 * r["whole_bytes"]
