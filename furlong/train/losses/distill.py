"""On-policy distillation: the student samples, a teacher scores each sampled token.

The per-token reverse KL KL(student || teacher) estimated on student samples is
k1_t = log pi_s(y_t) - log pi_T(y_t). Two ways to minimise it:

- advantage shaping (`distill_mode="advantage"`): A_t += coef * (log pi_T(y_t) - log pi_s_old(y_t)),
  detached, then the ordinary (clipped, importance-weighted) policy loss. This is Thinking
  Machines' "On-Policy Distillation" (Lu & Thinking Machines Lab, 2025): per-token reward
  = negative reverse KL, discount 0. It mixes freely with task rewards and every correction.
- reverse-KL loss (`distill_mode="reverse_kl"`): L_t = coef * 1/2 (log pi_s(y_t) - log pi_T(y_t))^2,
  differentiated directly. Its gradient (log pi_s - log pi_T) grad log pi_s is the same
  score-function gradient as above at ratio 1, without clipping: a plain loss, like the
  k2 KL loss (slime `apply_opd_kl_to_advantages` is the advantage form).
"""

from __future__ import annotations

from torch import Tensor


def distill_advantages(teacher_logprobs: Tensor, student_logprobs: Tensor, mask: Tensor, coef: float = 1.0) -> Tensor:
    """A_t = coef * (log pi_T(y_t) - log pi_s(y_t)) * m_t, detached (student = the sampling/old log-probs)."""
    return coef * (teacher_logprobs - student_logprobs).detach() * mask


def reverse_kl_loss(logprobs: Tensor, teacher_logprobs: Tensor) -> Tensor:
    """l_t = 1/2 (log pi_s(y_t) - log pi_T(y_t))^2 per token (unmasked); grad = k1_t * grad log pi_s(y_t)."""
    d = logprobs - teacher_logprobs.detach()
    return 0.5 * d * d
