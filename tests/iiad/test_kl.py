"""The distillation KL on vocab-parallel logits (TP=2) equals the KL of the gathered logits:
value and the student's gradient, to 1e-6; two teachers' weighted loss is the weighted sum of
their KLs; the temperature's T^2 scaling; mismatched vocabularies are refused."""

import pytest
import torch
import torch.nn.functional as F

from megatron_iiet.distributed import spawn_local
from megatron_iiet.iiad.kl import distillation_loss, vocab_parallel_kl

SHAPE = (6, 3, 40)  # [s, b, vocab]
TEMPERATURE = 2.0


def full_logits():
    g = torch.Generator().manual_seed(11)
    return (torch.randn(*SHAPE, generator=g, dtype=torch.float64) * 3,
            torch.randn(*SHAPE, generator=g, dtype=torch.float64) * 3,
            torch.randn(*SHAPE, generator=g, dtype=torch.float64) * 3)


def reference_kl(student, teacher, t):
    log_q = F.log_softmax(student / t, dim=-1)
    log_p = F.log_softmax(teacher / t, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def sharded_kl_and_grad():
    from megatron.core import parallel_state as ps

    student, teacher, _ = full_logits()
    rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    width = SHAPE[-1] // tp
    shard = student[..., rank * width:(rank + 1) * width].clone().requires_grad_()
    kl = vocab_parallel_kl(shard, teacher[..., rank * width:(rank + 1) * width], TEMPERATURE)
    (kl * torch.arange(kl.numel(), dtype=kl.dtype).view(kl.shape)).sum().backward()
    return kl.detach(), shard.grad


def test_vocab_parallel_kl_equals_the_gathered_kl():
    student, teacher, _ = full_logits()
    student.requires_grad_()
    want = reference_kl(student, teacher, TEMPERATURE)
    (want * torch.arange(want.numel(), dtype=want.dtype).view(want.shape)).sum().backward()
    ranks = spawn_local(sharded_kl_and_grad, 2, 2, 1)
    for kl, _ in ranks:
        assert torch.allclose(kl, want.detach(), rtol=1e-6, atol=1e-9)
    grad = torch.cat([g for _, g in ranks], dim=-1)
    assert torch.allclose(grad, student.grad, rtol=1e-6, atol=1e-9)


def test_single_process_kl_and_its_gradient():
    student, teacher, _ = full_logits()
    a = student.clone().requires_grad_()
    b = student.clone().requires_grad_()
    vocab_parallel_kl(a, teacher, TEMPERATURE).sum().backward()
    reference_kl(b, teacher, TEMPERATURE).sum().backward()
    assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-9)


def test_two_teachers_weighted_and_temperature_scaled():
    student, teacher1, teacher2 = full_logits()
    mask = torch.ones(SHAPE[:2], dtype=torch.float64)
    mask[0] = 0
    total, terms = distillation_loss(student, [(teacher1, 0.3), (teacher2, 0.7)], TEMPERATURE,
                                     loss_mask=mask)
    kl1 = reference_kl(student, teacher1, TEMPERATURE)[1:].mean() * TEMPERATURE ** 2
    kl2 = reference_kl(student, teacher2, TEMPERATURE)[1:].mean() * TEMPERATURE ** 2
    assert torch.allclose(terms[0], kl1) and torch.allclose(terms[1], kl2)
    assert torch.allclose(total, 0.3 * kl1 + 0.7 * kl2)
    unmasked, _ = distillation_loss(student, [(teacher1, 1.0)], 1.0)  # the release: every position
    assert torch.allclose(unmasked, reference_kl(student, teacher1, 1.0).mean())


def test_a_teacher_with_another_vocabulary_is_refused():
    student, teacher, _ = full_logits()
    with pytest.raises(ValueError, match="another vocabulary"):
        vocab_parallel_kl(student, teacher[..., :-1])
