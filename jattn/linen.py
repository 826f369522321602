"""Flax Linen attention modules computed by :func:`jattn.dot_product_attention`.

The public path of :mod:`jattn.flax.linen`, where they are defined:
``MultiHeadDotProductAttention``, ``MultiHeadAttention`` and ``SelfAttention`` under Flax's
class names (so auto-named submodules and checkpoints match Flax's), ``release_cache`` and
the ``attention_fn`` adapter.
"""

from jattn.flax.linen import CACHE_NAMES as CACHE_NAMES
from jattn.flax.linen import MultiHeadAttention as MultiHeadAttention
from jattn.flax.linen import MultiHeadDotProductAttention as MultiHeadDotProductAttention
from jattn.flax.linen import SelfAttention as SelfAttention
from jattn.flax.linen import attention_fn as attention_fn
from jattn.flax.linen import release_cache as release_cache

__all__ = [
  "MultiHeadDotProductAttention",
  "MultiHeadAttention",
  "SelfAttention",
  "release_cache",
  "attention_fn",
]
