"""A small decoder-only transformer built from :class:`jattn.nnx.MultiHeadAttention`.

Token embedding, positions (RoPE inside every attention layer, or sinusoidal
embeddings added once), ``num_layers`` pre-norm blocks (RMSNorm → causal
attention → residual, RMSNorm → GELU MLP → residual), a final RMSNorm and an
untied LM head.

The backward rule is a property of the attention layers only
(:data:`RULES`): the parameters do not depend on it, so models built with the
same seed and different rules start from identical weights. So is
``sow_max_logit``: layers built with it sow each query row's largest logit,
which :func:`forward` returns beside the logits (what QK-clip reads,
:mod:`experiments.toy.clip`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import jattn
import jattn.nnx
from experiments.toy.config import ModelConfig

# rule -> (implementation, backward) of jattn.dot_product_attention
RULES = {
  "autodiff": ("xla", "autodiff"),  # materialised scores, JAX autodiff
  "custom_vjp": ("xla", "custom_vjp"),  # materialised scores, jattn's explicit rule
  "blockwise": ("blockwise", "custom_vjp"),  # tiles, recompute in the backward pass
}


class Block(nnx.Module):
  """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, cfg: ModelConfig, rule: str, *, rngs: nnx.Rngs, sow_max_logit: bool = False):
    implementation, backward = RULES[rule]
    d = cfg.d_model
    rope = jattn.positional.Rotary(base=cfg.rope_base) if cfg.positions == "rope" else None
    self.attention_norm = nnx.RMSNorm(d, rngs=rngs)
    self.attention = jattn.nnx.MultiHeadAttention(
      cfg.num_heads,
      d,
      num_kv_heads=cfg.num_kv_heads,
      use_bias=False,
      is_causal=True,
      rope=rope,
      implementation=implementation,
      backward=backward,
      block_q=cfg.block_q,
      block_kv=cfg.block_kv,
      sow_max_logit=sow_max_logit,
      rngs=rngs,
    )
    self.mlp_norm = nnx.RMSNorm(d, rngs=rngs)
    self.mlp_in = nnx.Linear(d, cfg.mlp_ratio * d, rngs=rngs)
    self.mlp_out = nnx.Linear(cfg.mlp_ratio * d, d, rngs=rngs)

  def __call__(self, x: jax.Array, *, sow_weights: bool = False) -> jax.Array:
    x = x + self.attention(self.attention_norm(x), sow_weights=sow_weights)
    return x + self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x))))


class Transformer(nnx.Module):
  """tokens (B, T) int → next-token logits (B, T, vocab_size)."""

  def __init__(
    self,
    cfg: ModelConfig,
    vocab_size: int,
    rule: str,
    *,
    rngs: nnx.Rngs,
    sow_max_logit: bool = False,
  ):
    if rule not in RULES:
      raise ValueError(f"unknown rule {rule!r}; choose from {list(RULES)}")
    self.cfg = cfg
    self.embed = nnx.Embed(vocab_size, cfg.d_model, rngs=rngs)
    self.blocks = nnx.List(
      [Block(cfg, rule, rngs=rngs, sow_max_logit=sow_max_logit) for _ in range(cfg.num_layers)]
    )
    self.final_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
    self.head = nnx.Linear(cfg.d_model, vocab_size, use_bias=False, rngs=rngs)

  def __call__(self, tokens: jax.Array, *, sow_weights: bool = False) -> jax.Array:
    x = self.embed(tokens)
    if self.cfg.positions == "sinusoidal":
      x = (
        x
        + jattn.positional.sinusoidal(
          jnp.arange(tokens.shape[-1]), self.cfg.d_model, dtype=x.dtype
        )[None]
      )
    for block in self.blocks:
      x = block(x, sow_weights=sow_weights)
    return self.head(self.final_norm(x))


def build(
  cfg: ModelConfig, vocab_size: int, rule: str, seed: int, *, sow_max_logit: bool = False
) -> Transformer:
  """The model for ``rule``; the same ``seed`` gives the same parameters for every rule,
  with or without ``sow_max_logit``."""
  return Transformer(cfg, vocab_size, rule, rngs=nnx.Rngs(params=seed), sow_max_logit=sow_max_logit)


def forward(model: Transformer, tokens: jax.Array) -> tuple[jax.Array, list[jax.Array] | None]:
  """Logits (B, T, vocab_size) and, if its layers sow them, each layer's max logits
  (B, T, N) from the same forward pass (None otherwise), in layer order."""
  if not model.blocks[0].attention.sow_max_logit:
    return model(tokens), None
  captured: Any = nnx.capture(model, nnx.Intermediate)  # (out, state) on call
  logits, sown = captured(tokens)
  return logits, [
    sown["blocks"][i]["attention"]["max_logit"].get_value()[0] for i in range(len(model.blocks))
  ]


@nnx.jit
def attention_weights(model: Transformer, tokens: jax.Array) -> list[jax.Array]:
  """Each layer's attention probabilities (B, N, T, T) on ``tokens``, in layer order.

  ``model`` must use a materialising rule (``autodiff`` or ``custom_vjp``);
  load other rules' parameters into such a model with ``nnx.update``. Compiled as one
  program (run op by op, each operation would compile on its own).
  """
  captured: Any = nnx.capture(model, nnx.Intermediate)  # (out, state) on call
  _, sown = captured(tokens, sow_weights=True)
  return [
    sown["blocks"][i]["attention"]["attention_weights"].get_value()[0]
    for i in range(len(model.blocks))
  ]
