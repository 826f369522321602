"""jattn's Flax front ends, behind the public modules :mod:`jattn.nnx` and :mod:`jattn.linen`.

:mod:`jattn.flax.nnx` and :mod:`jattn.flax.linen` hold the modules (supersets of Flax's
``nnx.MultiHeadAttention`` and Linen's ``MultiHeadDotProductAttention``,
``MultiHeadAttention`` and ``SelfAttention``) and the ``attention_fn`` adapters. Beside
them, the parts both share: the settings a module checks at construction (``_config``),
the call into :func:`jattn.dot_product_attention` (``_call``), the KV cache held as
Flax's variables (``_cache``; NNX's in ``_nnx_cache``), the ``attention_fn`` adapter
(``_adapter``) and NNX's Hopfield layer (``_nnx_hopfield``).
"""

__all__: list[str] = []  # the front ends are its modules; jattn.nnx and jattn.linen export them
