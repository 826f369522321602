"""Flax NNX attention modules computed by :func:`jattn.dot_product_attention`.

The public path of :mod:`jattn.flax.nnx`, where they are defined: ``MultiHeadAttention``
(a superset of Flax's ``nnx.MultiHeadAttention``: same arguments, parameters, cache
variables and checkpoints), the ``attention_fn`` adapter and ``HopfieldLayer``.
"""

from jattn.flax.nnx import HopfieldLayer as HopfieldLayer
from jattn.flax.nnx import MultiHeadAttention as MultiHeadAttention
from jattn.flax.nnx import attention_fn as attention_fn

__all__ = ["MultiHeadAttention", "attention_fn", "HopfieldLayer"]
