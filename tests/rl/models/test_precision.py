"""Activation checkpointing and precision (issue 25 section 2).

* ``model.gradient_checkpointing=true`` recomputes activations in backward: the loss and every
  gradient equal the plain model's (float32 rounding: atol 1e-6).
* ``trainer.precision=bf16-mixed`` (Lightning's autocast, on the CPU as on a GPU) keeps the
  logprobs float32; its loss is within 2% of float32's and its gradient within 5% (relative
  norm of the difference) and a cosine similarity of 0.995 or more.
* ``model.dtype=bfloat16``: bf16 weights, float32 logprobs.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from tq_plugin.config import ConfigError
from tq_plugin.rl.models.protocol import TokenScoring, score_tokens
from tq_plugin.rl.models.tiny import TinyTransformer

V = 29


def build(kind: str, **kw):
    torch.manual_seed(0)
    if kind == "tiny":
        return TinyTransformer(V, d_model=32, n_heads=2, n_layers=2, **kw)
    from tq_plugin.rl.models.hf import HFCausalLM

    return HFCausalLM(V, d_model=32, n_heads=2, n_layers=2, max_seq_len=32, **kw)


def loss_and_grads(model, context=None):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (4, 12), generator=g)
    mask = torch.zeros(4, 12)
    mask[:, 5:] = 1
    adv = torch.randn(4, 1, generator=g)
    model.train()
    with context if context is not None else torch.enable_grad():
        lp, ent = score_tokens(model, ids, TokenScoring(mask=mask > 0, with_entropy=True,
                                                        entropy_grad=True))
        loss = -(lp * adv * mask).sum() / mask.sum() - 0.01 * (ent * mask).sum() / mask.sum()
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    flat = torch.cat([(torch.zeros_like(p) if gr is None else gr).float().reshape(-1)
                      for p, gr in zip(params, grads, strict=True)])
    return loss.detach(), flat


KINDS = ["tiny", pytest.param("hf", marks=pytest.mark.filterwarnings("ignore"))]


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(kind):
    if kind == "hf":
        pytest.importorskip("transformers")
    plain_loss, plain_grad = loss_and_grads(build(kind))
    ckpt = build(kind, gradient_checkpointing=True)
    loss, grad = loss_and_grads(ckpt)
    torch.testing.assert_close(loss, plain_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, plain_grad, atol=1e-6, rtol=1e-5)


def test_tiny_checkpointing_recomputes_each_block_in_backward(monkeypatch):
    from tq_plugin.rl.models import tiny

    model = build("tiny", gradient_checkpointing=True)
    calls = []
    forward = tiny._Block.forward

    def counted(self, *args):
        calls.append(1)
        return forward(self, *args)

    monkeypatch.setattr(tiny._Block, "forward", counted)
    loss_and_grads(model)
    assert len(calls) == 2 * len(model.blocks)  # forward, then the recompute in backward


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_mixed_agrees_with_float32(kind):
    if kind == "hf":
        pytest.importorskip("transformers")
    ref_loss, ref_grad = loss_and_grads(build(kind))
    precision = MixedPrecision("bf16-mixed", "cpu")
    loss, grad = loss_and_grads(build(kind), precision.forward_context())
    assert abs(float(loss - ref_loss)) <= 0.02 * abs(float(ref_loss)) + 1e-3
    assert float((grad - ref_grad).norm() / ref_grad.norm()) <= 0.05
    assert float(torch.nn.functional.cosine_similarity(grad, ref_grad, dim=0)) >= 0.995


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_weights_give_float32_logprobs(kind):
    if kind == "hf":
        pytest.importorskip("transformers")
    model = build(kind, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ref_loss, _ = loss_and_grads(build(kind))
    loss, grad = loss_and_grads(model)
    assert loss.dtype == torch.float32 and torch.isfinite(grad).all()
    assert abs(float(loss - ref_loss)) <= 0.05 * abs(float(ref_loss)) + 1e-2


def test_an_unknown_dtype_names_the_key():
    with pytest.raises(ConfigError, match="model.dtype: must be one of"):
        TinyTransformer(V, dtype="float8")
