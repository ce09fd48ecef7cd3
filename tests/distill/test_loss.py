"""The chunked distillation loss against a textbook full-softmax computation (float64, no chunking)."""

from __future__ import annotations

import math

import pytest
import torch
from references import one_line_error

from compress.distill.loss import IGNORE_INDEX, distillation_loss


def textbook(student_logits, teacher_logits, labels, tau, alpha):
    """Hinton et al. 2015, written out per token with explicit softmaxes, in float64."""
    total, kl_sum, ce_sum, n = 0.0, 0.0, 0.0, 0
    for s, t, y in zip(student_logits.double(), teacher_logits.double(), labels.tolist()):
        if y == IGNORE_INDEX:
            continue
        p_t = torch.exp(t / tau) / torch.exp(t / tau).sum()
        p_s = torch.exp(s / tau) / torch.exp(s / tau).sum()
        kl_sum += float((p_t * torch.log(p_t / p_s)).sum())
        q = torch.exp(s) / torch.exp(s).sum()
        ce_sum += -math.log(float(q[y]))
        n += 1
    kl, ce = kl_sum / n, ce_sum / n
    total = alpha * tau**2 * kl + (1 - alpha) * ce
    return total, kl, ce


def _data(n=37, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, vocab, generator=g) * 2
    t = torch.randn(n, vocab, generator=g) * 3
    y = torch.randint(0, vocab, (n,), generator=g)
    return s, t, y


@pytest.mark.parametrize(("tau", "alpha", "chunk"), [(1.0, 0.5, 1024), (2.0, 0.5, 5), (4.0, 0.9, 7), (0.5, 0.0, 3), (3.0, 1.0, 1)])
def test_matches_textbook(tau, alpha, chunk):
    s, t, y = _data()
    y[[3, 10]] = IGNORE_INDEX
    got = distillation_loss(s, t, y, tau=tau, alpha=alpha, chunk_tokens=chunk)
    total, kl, ce = textbook(s, t, y, tau, alpha)
    assert got.tokens == 35
    assert got.total.item() == pytest.approx(total, rel=1e-5)
    assert got.kd.item() == pytest.approx(kl, rel=1e-5)
    assert got.ce.item() == pytest.approx(ce, rel=1e-5)


def test_heads_give_the_same_loss_and_gradients_as_logits():
    """Hidden states + LM head (chunked logits, checkpointed) equal logits computed in full."""
    g = torch.Generator().manual_seed(1)
    hs, ht = torch.randn(29, 16, generator=g), torch.randn(29, 24, generator=g)
    ws, wt = torch.randn(50, 16, generator=g), torch.randn(50, 24, generator=g)
    y = torch.randint(0, 50, (29,), generator=g)
    ws1, ws2 = ws.clone().requires_grad_(True), ws.clone().requires_grad_(True)
    full = distillation_loss(hs @ ws1.T, ht @ wt.T, y, tau=2.0, alpha=0.3, chunk_tokens=1000)
    chunked = distillation_loss(hs, ht, y, tau=2.0, alpha=0.3, chunk_tokens=4, student_head=ws2, teacher_head=wt)
    full.total.backward()
    chunked.total.backward()
    assert chunked.total.item() == pytest.approx(full.total.item(), rel=1e-5)
    torch.testing.assert_close(ws2.grad, ws1.grad, rtol=1e-4, atol=1e-6)


def test_gradient_matches_textbook_autograd():
    s, t, y = _data(n=11, vocab=13, seed=2)
    s1 = s.double().clone().requires_grad_(True)
    ref = 0.7 * 4.0 * torch.nn.functional.kl_div(
        torch.log_softmax(s1 / 2, -1), torch.log_softmax(t.double() / 2, -1), log_target=True, reduction="batchmean"
    ) + 0.3 * torch.nn.functional.cross_entropy(s1, y)
    ref.backward()
    s2 = s.clone().requires_grad_(True)
    distillation_loss(s2, t, y, tau=2.0, alpha=0.7, chunk_tokens=3).total.backward()
    torch.testing.assert_close(s2.grad.double(), s1.grad, rtol=1e-4, atol=1e-7)


def test_identical_models_have_zero_kd():
    s, _, y = _data()
    assert distillation_loss(s, s.clone(), y, tau=3.0).kd.item() == pytest.approx(0.0, abs=1e-6)


def test_bad_input_is_one_line_error():
    s, t, y = _data()
    assert "tokenizer" in one_line_error(distillation_loss, s, t[:, :40], y)
    assert "tau" in one_line_error(distillation_loss, s, t, y, tau=0.0)
    assert "alpha" in one_line_error(distillation_loss, s, t, y, alpha=1.5)
    assert "ignore_index" in one_line_error(distillation_loss, s, t, torch.full_like(y, IGNORE_INDEX))


def test_draft_losses_by_hand_and_one_minus_tv_is_the_acceptance():
    from compress.distill.loss import DraftLoss, draft_loss
    from compress.eval.speculative import acceptance

    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]], dtype=torch.float64)
    q = torch.tensor([[0.2, 0.5, 0.3], [0.2, 0.7, 0.1]], dtype=torch.float64)
    student = q.log().float().requires_grad_()
    labels = torch.tensor([0, 1])
    tv = draft_loss(student, p.log().float(), labels, DraftLoss.tv, chunk_tokens=1)
    assert float(tv.total.detach()) == pytest.approx((0.3 + 0.2) / 2)  # ½Σ|p−q| per row: 0.3 and 0.2
    assert 1 - float(tv.total.detach()) == pytest.approx(float(acceptance(p.log(), q.log(), 1.0).mean()))
    kl = draft_loss(student, p.log().float(), labels, DraftLoss.kl)
    assert float(kl.total.detach()) == pytest.approx(float((p * (p / q).log()).sum(-1).mean()), rel=1e-5)
    tv.total.backward()
    assert torch.isfinite(student.grad).all() and student.grad.abs().sum() > 0
    assert float(draft_loss(p.log().float(), p.log().float(), labels, DraftLoss.tv).total) == pytest.approx(0, abs=1e-7)
