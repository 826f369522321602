"""Masks written as functions of indices.

A :class:`Mask` says which query position may attend to which key/value
position: a function of broadcastable int arrays ``(batch, head, q_idx,
kv_idx)`` that returns booleans, True meaning "may attend" (as in
``jax.nn.dot_product_attention``). It is FlexAttention's ``mask_mod`` and
splash attention's mask classes in JAX. Masks combine with ``&``, ``|`` and
``~``, materialise to a dense boolean array, and classify (query tile,
key/value tile) pairs as EMPTY, PARTIAL or FULL so tiled implementations can
skip empty tiles and skip mask arithmetic on full ones.

Shape legend (shared with :mod:`jattn.attention`): B batch, N query heads,
T query length, S key/value length.

The kinds, each built by a function of this package:

* :func:`causal` (with an offset, static or per batch row), :func:`sliding_window`
  (optionally dilated), :func:`chunked`, :func:`prefix_lm`, :func:`segments`
  (document masking), :func:`lengths` (padding), :func:`global_tokens`,
  :func:`strided`, :func:`from_array` (a dense boolean array) and
  :func:`from_fn` (any function of the indices): :mod:`jattn.masks.kinds`;
* :func:`block_sparse` layouts and the :func:`bigbird` and :func:`longformer`
  patterns, :func:`bigbird_layout`: :mod:`jattn.masks.layouts`;
* :func:`reindex`, a mask seen through index maps (ring attention):
  :mod:`jattn.masks.index_maps`.

:mod:`jattn.masks.tiles` holds the tile classification behind
:meth:`Mask.block_view`.

A mask is a pytree: the arrays it holds (segment ids, lengths, a dense array)
are its leaves, and its kind and settings are static, so masks can be passed
through ``jax.jit`` and ``jax.vmap`` and rebuilding an equal mask does not
recompile.

Example::

    >>> from jattn import masks
    >>> m = masks.causal() & masks.sliding_window(2, 0)
    >>> m.materialize(4, 4)[0, 0].astype(int)
    Array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [1, 1, 1, 0],
           [0, 1, 1, 1]], dtype=int32)
"""

from jattn.masks import index_maps as index_maps
from jattn.masks import kinds as kinds
from jattn.masks import layouts as layouts
from jattn.masks import tiles as tiles
from jattn.masks.core import Mask as Mask
from jattn.masks.core import all_of as all_of
from jattn.masks.core import index_grid as index_grid
from jattn.masks.index_maps import reindex as reindex
from jattn.masks.indexing import Extents as Extents
from jattn.masks.kinds import causal as causal
from jattn.masks.kinds import chunked as chunked
from jattn.masks.kinds import from_array as from_array
from jattn.masks.kinds import from_fn as from_fn
from jattn.masks.kinds import global_tokens as global_tokens
from jattn.masks.kinds import lengths as lengths
from jattn.masks.kinds import prefix_lm as prefix_lm
from jattn.masks.kinds import segments as segments
from jattn.masks.kinds import sliding_window as sliding_window
from jattn.masks.kinds import strided as strided
from jattn.masks.layouts import bigbird as bigbird
from jattn.masks.layouts import bigbird_layout as bigbird_layout
from jattn.masks.layouts import block_sparse as block_sparse
from jattn.masks.layouts import longformer as longformer
from jattn.masks.tiles import EMPTY as EMPTY
from jattn.masks.tiles import FULL as FULL
from jattn.masks.tiles import PARTIAL as PARTIAL

__all__ = [
  "index_grid",
  "Mask",
  "all_of",
  "reindex",
  "causal",
  "sliding_window",
  "chunked",
  "prefix_lm",
  "segments",
  "lengths",
  "global_tokens",
  "strided",
  "from_array",
  "from_fn",
  "block_sparse",
  "longformer",
  "bigbird_layout",
  "bigbird",
]
