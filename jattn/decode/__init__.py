"""A functional key/value cache for autoregressive decoding and chunked prefill.

Shape legend as in :mod:`jattn.attention`; here T is the number of new tokens
in one call (written ``t``) and the cache holds up to ``max_length`` key/value
positions per batch row.

A :class:`KVCache` is a pytree of fixed shape: the keys and values written so
far, ``(B, max_length, K, H)`` each, and ``lengths`` ``(B,)``, how many
positions of each row hold tokens. Every call returns a new cache (nothing is
mutated), so a jitted decode step takes the cache as an argument and is traced
once for all steps. Rows are ragged: each has its own length. A prompt batch
right-padded to ``t`` tokens is written with ``num_new`` = the prompt lengths;
the padding is not written and padded query rows return zeros.

:func:`attention` writes the ``t`` new keys and values, then lets query ``i``
of row ``b`` (absolute position ``lengths[b] + i``) attend to cache slots
``j <= lengths[b] + i``, with ``lengths`` taken before the write. So a
prefill, a prefill cut into chunks and one-token decode steps are the same
call and give the same outputs as causal attention over the whole sequence.

Slots past a row's length never reach the result: they are masked and read as
zeros, so garbage there (NaN included) cannot leak into outputs or gradients.

By default attention runs blockwise and reads the cache a key/value tile at a
time, visiting only the tiles some row has reached: a step costs what the rows
hold, not ``max_length``, and the cache is never copied. ``implementation="xla"``
(or ``backward="autodiff"``) instead materialises the scores over the whole
``max_length``, reading a zeroed copy of a contiguous cache.

Overflow: a row cannot hold more than ``max_length`` tokens. When the lengths
and ``num_new`` are concrete (eager calls), writing past ``max_length`` raises
ValueError. Under ``jax.jit`` they are traced and cannot be checked: tokens
past ``max_length`` are dropped and the lengths saturate at ``max_length``; the
dropped tokens' queries return zeros (and get zero gradients), like padded rows.
Check ``cache.lengths`` on the host between steps, or wrap the step with
``jax.experimental.checkify``, if a request may run that long.

Masks and score functions given to :func:`attention` see ``q_idx`` as the
index within the new chunk (0 .. t-1) and ``kv_idx`` as the cache slot, which
is the absolute position. With ``absolute_positions=True`` a
:class:`jattn.masks.Mask` and a score function see ``q_idx`` as the query's
absolute position too, so position-dependent ones (ALiBi, relative biases,
sliding windows) mean chunk by chunk what they mean over the whole sequence
(the Flax modules decode so). Without it, shift the query index by the row's
old length::

    lengths = cache.lengths
    shifted = lambda s, b, h, q, kv: alibi(s, b, h, q + lengths[b], kv)

Positional encodings of the new keys and queries are the caller's: use
:func:`positions` for their absolute positions (e.g. for RoPE).

Paged caches (:func:`init_paged`, a :class:`PagedKVCache`) hold the same rows in a
pool of fixed-size pages instead of one ``(B, max_length)`` slab: each row's page
table names its pages in order, :func:`update` and :func:`attention` take pages
from the pool as rows grow, and :func:`release` gives a finished row's pages back,
so requests of different lengths join and leave a running batch without copying.
Every function here takes either kind of cache, with the same semantics.
Attention over a paged cache runs blockwise, with a key/value tile of
``block_kv`` slots made of whole pages: a tile's pages are gathered only when the
schedule visits it, and tiles past every row's length are never visited, so a
step's work and memory grow with the pages in use, not with
``max_pages_per_seq``. A mask or bias array given to :func:`attention` may be sized
to a max_length that rounds up to the rows' pages (say 10 slots for rows of 3 pages
of 4): it is padded to the rows' length, the slots past it masked, so the same mask
fits a contiguous cache of that max_length and a paged one.

Running out of pages: when the lengths, ``num_new``, page table and pool are
concrete, a write that needs more pages than are free raises ValueError. Under
``jax.jit`` rows get pages in batch order, free pages in ascending order; a row
that finds the pool empty keeps the tokens its pages hold and drops the rest, its
length capped as at overflow; the dropped tokens' queries return zeros, like padded
rows. Check ``cache.free.sum()`` or ``cache.lengths`` on
the host between steps.

Continuous batching: :func:`ragged_attention` is one serving step over a flat batch that
mixes new requests' prefill chunks with running ones' decode tokens: the tokens packed
along one axis, ``cu_seqlens`` saying which belong to which request (cache row), each
request's appended to its row and attending causally over it, with no padding to the
longest request (the step's query rows are tiles of one request each).

Quantized caches: ``dtype=jnp.int8`` or ``jnp.float8_e4m3fn`` in :func:`init` or
:func:`init_paged` stores keys and values quantized on write, with one float32
scale per (token, key/value head) (:mod:`jattn.impl.quant`), and attention
dequantizes them tile by tile. Queries, keys and values are then any one floating
dtype, and the output has the query's. A quantized cache is for inference:
gradients reach the query, not the keys and values stored in it.

Sharding: under ``jax.set_mesh`` with Explicit axes, queries, keys and values sharded
over the batch and the heads (say ``P("data", None, "model", None)``) give outputs of
that sharding, and a contiguous cache takes the sharding of the keys and values written
into it (a cache placed with ``jax.device_put`` keeps its own): each device holds and
reads its own rows and heads, and a step moves nothing between devices. A paged cache's
pool is shared by every row, so its heads are sharded but its pages are not, and each
write gathers the new tokens over the batch.

Example::

    >>> import jax.numpy as jnp
    >>> from jattn import decode
    >>> cache = decode.init(2, 16, 2, 8)  # B=2, max_length=16, K=2, H=8
    >>> q, kv = jnp.ones((2, 5, 4, 8)), jnp.ones((2, 5, 2, 8))  # N=4: GQA
    >>> out, cache = decode.attention(q, kv, kv, cache)  # prefill 5 tokens
    >>> out, cache = decode.attention(q[:, :1], kv[:, :1], kv[:, :1], cache)  # one step
    >>> cache.lengths
    Array([6, 6], dtype=int32)
    >>> paged = decode.init_paged(8, 4, 2, 4, 2, 8)  # 8 pages of 4 slots, 4 pages a row
    >>> out, paged = decode.attention(q, kv, kv, paged)  # 5 tokens: 2 pages a row
    >>> paged.page_table
    Array([[ 0,  1, -1, -1],
           [ 2,  3, -1, -1]], dtype=int32)
    >>> decode.release(paged, jnp.array([True, False])).free.sum()  # row 0's pages back
    Array(6, dtype=int32)
"""

from jattn.decode._attend import attention as attention
from jattn.decode._cache import Cache as Cache
from jattn.decode._cache import KVCache as KVCache
from jattn.decode._cache import PagedKVCache as PagedKVCache
from jattn.decode._cache import init as init
from jattn.decode._cache import init_paged as init_paged
from jattn.decode._ragged import explain_ragged as explain_ragged
from jattn.decode._ragged import ragged_attention as ragged_attention
from jattn.decode._writes import positions as positions
from jattn.decode._writes import release as release
from jattn.decode._writes import update as update

# In the order the API reference lists them. Cache (KVCache | PagedKVCache) is the type of
# either cache, for annotations.
__all__ = [
  "KVCache",
  "PagedKVCache",
  "init",
  "init_paged",
  "release",
  "positions",
  "update",
  "attention",
  "ragged_attention",
  "explain_ragged",
]
