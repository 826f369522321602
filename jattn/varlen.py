"""Variable-length (THD) input: :func:`varlen_attention`, FlashAttention's varlen call.

Several sequences packed one after another along one token axis, with no padding between
them: query (total_q, N, H), key and value (total_k, K, H|Hv), and the int32 offsets
``cu_seqlens_q`` and ``cu_seqlens_k`` (num_seqs + 1,) where sequence ``i``'s tokens start and
end, ``[cu[i], cu[i + 1])``, as in FlashAttention's ``flash_attn_varlen_func``, PyTorch's
``varlen_attn`` and Transformer Engine's THD layout. Tokens past the last offset are padding:
their outputs and gradients are zeros.

Each query attends to the keys of its own sequence. ``is_causal`` is bottom-right aligned
when a sequence's query and key lengths differ, as FlashAttention's varlen functions are:
query ``i`` of a sequence with ``t`` queries and ``s`` keys sees keys ``j <= i + s - t``
(its last query sees every key; with ``t > s`` the first ``t - s`` queries see none and
return zeros); ``local_window_size`` is aligned the same way. Score functions see the
positions within the sequence (the query's so aligned, ``i + s - t``, the key's ``j``) and
batch row 0: the packed tokens are one row.

The call is the one-device call on the packed tokens as one row, masked by the sequences
(a segment mask: tiles across sequences are EMPTY and skipped by the tiled implementations)
and the aligned causal mask (tiles above each sequence's diagonal skipped too); with the
same offsets for queries and keys (``cu_seqlens_q is cu_seqlens_k``, or equal concrete
arrays) it is the plain causal mask, which splash takes on a TPU. Offsets may be traced:
one compile serves any sequence boundaries.

Shape legend as in :mod:`jattn.attention`; L is the number of sequences.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks, _validate, attention, masks, scores
from jattn._validate.keywords import Varlen, checked

__all__ = ["varlen_attention", "Tokens"]


def varlen_attention(
  query: jax.typing.ArrayLike,
  key: jax.typing.ArrayLike,
  value: jax.typing.ArrayLike,
  cu_seqlens_q: jax.typing.ArrayLike,
  cu_seqlens_k: jax.typing.ArrayLike,
  **keywords: Unpack[Varlen],
) -> Any:  # the output, with the lse and max logit where asked for
  """Attention over sequences packed along one token axis (THD), each to its own keys.

  Args:
    query: (total_q, N, H), the sequences' queries one after another.
    key: (total_k, K, H), N a multiple of K; value: (total_k, K, Hv).
    cu_seqlens_q: int (L + 1,), the offsets of the L sequences' queries: 0, then each
      sequence's end; nondecreasing, at most total_q. Tokens past the last are padding.
      May be traced (one compile for any boundaries).
    cu_seqlens_k: int (L + 1,), the keys' offsets, as ``cu_seqlens_q``.
    **keywords: :func:`jattn.dot_product_attention`'s keywords that apply
      (:class:`~jattn._validate.keywords.Varlen`): ``is_causal`` and
      ``local_window_size`` per sequence, bottom-right aligned (see the module docstring),
      ``scale``, ``score_fn`` (on the positions within the sequence), ``logits_soft_cap``,
      ``sinks``, dropout, ``return_residual``, ``return_max_logit``, the implementation,
      backward rule and tiles.

  Returns:
    The output (total_q, N, Hv), zeros on padding rows and rows that see no key; with
    ``return_residual`` and/or ``return_max_logit``, also the log-sum-exp and/or the max
    logit, (total_q, N), as :func:`jattn.dot_product_attention` orders them.

  Example::

    >>> import jax.numpy as jnp, jattn
    >>> q = jnp.zeros((5, 1, 4))                  # two sequences: 3 tokens, then 2
    >>> cu = jnp.array([0, 3, 5])
    >>> out, lse = jattn.varlen_attention(q, q, q, cu, cu, is_causal=True,
    ...                                   return_residual=True)
    >>> lse[:, 0]                                 # log of how many keys each query sees
    Array([0.       , 0.6931472, 1.0986123, 0.       , 0.6931472], dtype=float32)
  """
  kw = checked("varlen_attention", keywords, Varlen)
  q, k = _checks.as_array("query", query), _checks.as_array("key", key)
  for name, x, rows in (("query", q, "total_q, N"), ("key", k, "total_k, K")):
    if x.ndim != 3:
      raise ValueError(
        f"{name} must have shape ({rows}, H), the tokens of every sequence packed, got {x.shape}"
      )
  same = cu_seqlens_q is cu_seqlens_k
  cu_q = _checks.offsets("cu_seqlens_q", cu_seqlens_q, f"{q.shape[0]} query tokens", q.shape[0])
  cu_k = _checks.offsets("cu_seqlens_k", cu_seqlens_k, f"{k.shape[0]} key tokens", k.shape[0])
  if cu_q.shape != cu_k.shape:
    raise ValueError(
      f"cu_seqlens_q and cu_seqlens_k must have the same length (an offset per sequence, "
      f"then the end), got cu_seqlens_q {cu_q.shape} and cu_seqlens_k {cu_k.shape}"
    )
  if not same and _checks.is_concrete(cu_q) and _checks.is_concrete(cu_k):
    same = bool(np.array_equal(np.asarray(cu_q), np.asarray(cu_k)))
  tokens = Tokens.of(cu_q, cu_k, q.shape[0], k.shape[0])
  causal = _checks.boolean("is_causal", kw.pop("is_causal", False))
  mask = tokens.mask(causal, _validate.window(kw.pop("local_window_size", None)), same)
  if (score_fn := kw.get("score_fn")) is not None:
    kw["score_fn"] = scores.reindex(score_fn, q=tokens.q_local, kv=tokens.k_local)
  q, k, v, spec = _validate.build(q, k, value, None, mask, kw)
  return attention.returned(*attention.attend(q, k, v, spec))


class Tokens(NamedTuple):
  """Where each packed token stands: its sequence (-1 for a query past the last offset, -2
  for such a key: padding matches nothing), and positions. NumPy where the offsets are
  concrete (exact tile classes when the call is traced), else traced."""

  q_seq: Any  # (total_q,)
  k_seq: Any  # (total_k,)
  q_aligned: Any  # (total_q,): each query's place on the key axis, bottom-right aligned
  q_local: Any  # (total_q,): that place within its sequence's keys
  k_local: Any  # (total_k,): each key's place within its sequence

  @classmethod
  def of(cls, cu_q: Any, cu_k: Any, total_q: int, total_k: int) -> Tokens:
    xp = np if isinstance(cu_q, np.ndarray) and isinstance(cu_k, np.ndarray) else jnp

    def sequence(cu: Any, total: int, padding: int) -> Any:
      tokens = xp.arange(total, dtype=np.int32)
      seq = xp.searchsorted(cu, tokens, side="right").astype(np.int32) - 1
      return xp.where(tokens < cu[-1], seq, padding).astype(np.int32), tokens

    q_seq, tq = sequence(cu_q, total_q, -1)
    k_seq, tk = sequence(cu_k, total_k, -2)
    if len(cu_q) == 1:  # no sequence: every token is padding
      zeros = lambda n: xp.zeros((n,), np.int32)
      return cls(q_seq, k_seq, zeros(total_q), zeros(total_q), zeros(total_k))
    # Padding tokens take the last sequence's positions: the segment mask keeps them apart.
    qs, ks = (xp.clip(seq, 0, len(cu_q) - 2) for seq in (q_seq, k_seq))
    q_aligned = (tq + cu_k[qs + 1] - cu_q[qs + 1]).astype(np.int32)
    q_local = (q_aligned - cu_k[qs]).astype(np.int32)
    return cls(q_seq, k_seq, q_aligned, q_local, (tk - cu_k[ks]).astype(np.int32))

  def mask(self, causal: bool, window: tuple[int, int] | None, same: bool) -> masks.Mask:
    """Each query to its own sequence's keys, causal and windowed bottom-right aligned
    (plain causal and windows where every sequence has as many queries as keys)."""
    parts = [masks.segments(self.q_seq[None], self.k_seq[None])]
    aligned = (lambda m: m) if same else (lambda m: masks.reindex(m, q=self.q_aligned))
    if causal:
      parts.append(aligned(masks.causal()))
    if window is not None:
      parts.append(aligned(masks.sliding_window(*window)))
    mask = masks.all_of(*parts)
    assert mask is not None, "the segment mask is always there"
    return mask
