"""The public boundary: one validated description of an attention call, and its one validator.

:func:`build` checks every argument of a call at the public boundary and returns the
normalised query, key and value with a :class:`CallSpec`: the legend sizes, the one
combined :class:`jattn.masks.Mask`, the one score function, the bias, dropout, the
scale, the tiles, the chosen implementation and backward rule. Every entry point
(:func:`jattn.dot_product_attention`, :func:`jattn.attention_weights`, :func:`jattn.explain`,
:func:`jattn.decode.attention`, :func:`jattn.parallel.context_parallel_attention`, and
through them the Flax modules) builds one, and the implementations read their settings
from it; nothing downstream re-validates. The front ends hand over their arrays and their
keywords as one mapping of the names listed once in :mod:`jattn._validate.keywords`, so
adding a keyword touches that list, its check here, :class:`CallSpec` and the
implementations that read it.

The masks, score functions and bias are checked and combined in ``_masking``, the arrays
and scalar settings in ``_call`` (generic checks in :mod:`jattn._checks`), the
implementation, backward and tiles in :class:`jattn.Options` (``options``), against the
selection table (:mod:`jattn.impl.select`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
from jax.typing import DTypeLike

from jattn import _checks, _compat, testing
from jattn._validate import _call, _masking
from jattn._validate._call import qkv as qkv
from jattn._validate._call import window as window
from jattn._validate._masking import segments as segments
from jattn._validate.keywords import DEFAULTS, options_of
from jattn.impl import common, select, sharded
from jattn.impl.contract import CallSpec


def build(
  query: Any,
  key: Any,
  value: Any,
  bias: Any,
  mask: Any,
  keywords: Mapping[str, Any],
  *,
  backend: str | None = None,
  explain: bool = False,
  shapes_only: bool = False,
) -> Any:  # (query, key, value or None, CallSpec); with explain=True a select.Choice
  """Every argument of a call checked; raises before anything is traced.

  ``keywords`` are the call's keywords by name (:class:`~jattn._validate.keywords.Keywords`:
  a name left out takes its default, the front end has refused names it does not take);
  ``value=None`` describes a call that forms only the weights (:func:`jattn.attention_weights`).
  Returns ``(query, key, value, spec)``, the arrays as jax or NumPy arrays of one dtype;
  the implementation is chosen for ``backend`` (default: JAX's default backend) by
  :func:`jattn.impl.select.choose`. With ``explain=True``, returns that
  :class:`jattn.impl.select.Choice` instead. ``implementation``, ``backward``,
  ``block_q`` and ``block_kv`` come one by one or as ``options``.
  ``shapes_only``: key and value are ``jax.ShapeDtypeStruct`` values, for a caller that
  reads them from elsewhere (:mod:`jattn.decode`'s cache, tile by tile).
  """
  kw: dict[str, Any] = {**DEFAULTS, **keywords}
  options = options_of(kw)
  # Options checked the names when it was made; here only the default rule is filled in.
  impl = options.implementation
  bwd = select.default_backward(impl, options.backward)
  blocks = (options.block_q, options.block_kv)
  q, k, v = _call.qkv(query, key, key if value is None else value, shapes_only=shapes_only)
  unbatched = q.ndim == 3
  B, T, N, H = (1,) * unbatched + tuple(q.shape)
  S, K = k.shape[-3], k.shape[-2]
  scale = _call.scale(kw.get("scale"), H)
  bias = _masking.checked_bias(bias, (B, N, T, S), q.dtype)
  _checks.flags(
    is_causal=kw["is_causal"],
    return_residual=kw["return_residual"],
    return_max_logit=kw["return_max_logit"],
    broadcast_dropout=kw["broadcast_dropout"],
  )
  window = _call.window(kw.get("local_window_size"))
  lengths = tuple(
    _call.seq_lengths(name, kw.get(name), B)
    for name in ("query_seq_lengths", "key_value_seq_lengths")
  )
  dropout_rng = kw.get("dropout_rng")
  dropout_rate = _call.dropout(kw["dropout_rate"], dropout_rng)
  sinks = _call.sinks(kw.get("sinks"), N)
  spec = CallSpec(
    B=B,
    T=T,
    S=S,
    N=N,
    K=K,
    H=H,
    Hv=H if value is None else v.shape[-1],
    unbatched=unbatched,
    bias=bias,
    mask=_masking.combined_mask(
      mask, kw["is_causal"], window, lengths, kw.get("segment_ids"), unbatched, (B, N, T, S)
    ),
    score_fn=_masking.score_function(
      kw.get("score_fn"), kw.get("logits_soft_cap"), q.dtype, (B, N, T, S)
    ),
    dropout_rng=dropout_rng if dropout_rate else None,
    scale=scale,
    dropout_rate=dropout_rate,
    broadcast_dropout=bool(kw["broadcast_dropout"]),
    implementation="",  # chosen below, from the checked settings
    backward=bwd,
    block_q=blocks[0],  # type: ignore[arg-type]  # None until resolved below
    block_kv=blocks[1],  # type: ignore[arg-type]
    return_residual=bool(kw["return_residual"]),
    return_max_logit=bool(kw["return_max_logit"]),
    interpret=testing.interpreting(),
    sinks=sinks,
  )
  target = backend or testing.target_backend() or select.default_backend()
  choice = _choose(
    spec,
    q.dtype,
    target,
    impl,
    backward_named=options.backward is not None,
    blocks=blocks,
    fused=not (backend is None and testing.portable()),
    detail=explain,
    sequence_sharded=sharded.sequence_axes(q, k) or (),
    varying=tuple(sorted(set().union(*(_compat.varying_axes(x) for x in (q, k, v))))),
  )
  if explain:
    return choice
  spec = _for_choice(spec, choice, blocks, q.dtype, target)
  return q, k, (None if value is None else v), spec


def for_shard(
  spec: CallSpec,
  *,
  dtype: DTypeLike,
  implementation: str | None,
  backward: str | None,
  blocks: tuple[int | None, int | None],
) -> tuple[CallSpec, select.Choice]:
  """A checked call's spec, its shapes and arrays already cut to one device's part of a
  sequence-parallel call (:mod:`jattn.parallel.context`), with the implementation chosen
  for that part by the selection table as :func:`build` chooses (nothing re-checked), and
  the table's :class:`~jattn.impl.select.Choice`."""
  backend = testing.target_backend() or select.default_backend()
  spec = dataclasses.replace(
    spec,
    implementation="",
    backward=select.default_backward(implementation, backward),
    block_q=blocks[0],  # type: ignore[arg-type]  # None until resolved below
    block_kv=blocks[1],  # type: ignore[arg-type]
  )
  choice = _choose(
    spec,
    dtype,
    backend,
    implementation,
    backward_named=backward is not None,
    blocks=blocks,
    fused=not testing.portable(),
    detail=True,
  )
  return _for_choice(spec, choice, blocks, dtype, backend), choice


def _choose(
  spec: CallSpec,
  dtype: DTypeLike,
  backend: str,
  implementation: str | None,
  *,
  backward_named: bool,
  blocks: tuple[int | None, int | None],
  fused: bool,
  detail: bool,
  sequence_sharded: tuple[str, ...] = (),
  varying: tuple[str, ...] = (),
) -> select.Choice:
  """The table's choice for a checked ``spec`` (its backward rule already defaulted) on
  ``backend``: what :func:`build` and :func:`for_shard` both ask."""
  call = select.Call(
    spec=spec,
    dtype=np.dtype(dtype),
    backend=backend,
    backward_named=backward_named,
    blocks_named=blocks != (None, None),
    sequence_sharded=sequence_sharded,
    varying=varying,
  )
  return select.choose(
    call, implementation, spec.backward, interpret=spec.interpret, detail=detail, fused=fused
  )


def _for_choice(
  spec: CallSpec,
  choice: select.Choice,
  blocks: tuple[int | None, int | None],
  dtype: DTypeLike,
  backend: str,
) -> CallSpec:
  """``spec`` completed for ``choice`` on ``backend`` by its row's ``prepare`` (tiles,
  splash's mask split), with the compute dtype."""
  spec = select.TABLE[choice.implementation].prepare(spec, blocks, backend)
  return dataclasses.replace(
    spec,
    implementation=choice.implementation,
    backward=choice.backward,
    compute_dtype=common.compute_dtype(dtype, backend),
  )
