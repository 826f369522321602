"""Time jattn's paths against jax.nn's on an accelerator: cuDNN on a GPU, splash on a TPU.

For each dtype, head dim H, sequence length T (= S) and mask, times the jitted forward
pass and forward+backward (gradients of q, k, v) of each method on the same inputs,
the methods taking turns in every round (``experiments._timing.rounds_ms``), and
reports the median milliseconds, TFLOP/s, that rate as a percentage of the
device's peak, the speedup over jax.nn's XLA path and over jax.nn's best on
the backend (medians of per-round ratios), and the scratch memory XLA plans for
each compiled program (``memory_analysis().temp_size_in_bytes``), which on an
accelerator is the activation memory the method needs beyond its inputs and
outputs, in MiB (2**20 bytes; the rows' ``*_scratch_mb``). Up to ``--check-up-to`` T it
also checks what each timed program computes: the largest absolute error of its output
(``fwd_err``) and of its gradients (``fwd_bwd_err``) against the same call in float32 at
the highest matmul precision (jax.nn's XLA path where jax.nn expresses the case, else
jattn's materialised path), beside jax.nn's own errors on the same inputs.

Masks and score functions (``--masks``), each given to jattn as its own argument and to
jax.nn as the same thing written out densely (what a jax.nn user must do):

    full     no mask
    causal   is_causal=True
    packed   causal within documents: ``--docs`` documents of random lengths
             (seeded) per batch row, as ``segment_ids`` for jattn and as the
             equivalent (B, 1, T, T) boolean mask for jax.nn
    window   causal sliding window of ``--window`` keys back, as
             ``local_window_size=(window, 0)`` for both (jax.nn's cuDNN path takes it
             natively; records before 2026-11-25 gave jax.nn a (1, 1, T, T) mask)
    prefix   prefix-LM: bidirectional inside the first ``--prefix`` · T positions,
             causal after (``masks.prefix_lm``; a (1, 1, T, T) mask for jax.nn)
    alibi    causal with ALiBi (``scores.alibi``, the paper's slopes; a (1, N, T, T)
             bias for jax.nn)
    softcap  causal with ``logits_soft_cap=30`` (jax.nn has no soft cap: jattn only)

Work: forward 4·B·N·T·S·H, forward+backward 3.5 times that, over the query-key pairs
attended: T² without a mask, T²/2 causal (alibi and softcap too), Σ L²/2 over the
documents' lengths L when packed, T²/2 + P²/2 with a prefix of P, and the window's exact
count. Methods, those that cannot run on the backend skipped with a note:

    jax.nn        jax.nn.dot_product_attention(implementation="xla")
    jax.nn/cudnn  jax.nn.dot_product_attention(implementation="cudnn") (GPU, bf16/f16 only)
    xla           jattn, implementation="xla" (materialised, autodiff)
    blockwise     jattn, implementation="blockwise" (tiles, custom_vjp)
    splash        jattn, implementation="splash" (JAX's splash Pallas kernel; TPU only)
    flex          jattn, implementation="flex" (jattn's own Pallas kernel; GPU only)
    flex_hopper   jattn, implementation="flex_hopper" (flex's Mosaic GPU kernels, an opt-in
                  until measured; Hopper only: elsewhere, and for the masks it does not take,
                  its compile error is recorded)
    auto          jattn, implementation=None (what it picks: ``auto_runs``, from jattn.explain)

jax.nn's best, the ``*_vs_best`` reference: jax.nn/cudnn on a GPU where it ran
(bf16/f16), otherwise jax.nn's XLA path (jax.nn has no TPU kernel). Peak
(``PEAK_TFLOPS``): dense TFLOP/s from the vendors' data sheets, matched by
``jax.devices()[0].device_kind``; float32 counts at JAX's default matmul
precision (TF32 tensor cores on A100/H100/H200, one bfloat16 pass on TPU); an
unknown device gets no percentage (None, no column).

    python -m experiments.bench_gpu                      # the grid below, on the default backend
    python -m experiments.bench_gpu --lengths 1024 --dtypes bfloat16 --masks packed --reps 3
    python -m experiments.bench_gpu --methods flex jax.nn/cudnn jax.nn blockwise --dtypes bfloat16
    python -m experiments.bench_gpu --quick              # tiny shapes, any backend (smoke test)
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from experiments import _cli, _timing
from experiments._timing import fmt

METHODS = ("jax.nn", "jax.nn/cudnn", "xla", "blockwise", "splash", "flex", "flex_hopper", "auto")
MASKS = ("full", "causal", "packed", "window", "prefix", "alibi", "softcap")
# Where each runs; the rest run anywhere.
RUNS_ON = {"jax.nn/cudnn": "gpu", "splash": "tpu", "flex": "gpu", "flex_hopper": "gpu"}
MATERIALISING = ("jax.nn", "xla")

# Dense (no sparsity) peak TFLOP/s per chip, by dtype, from the vendors' data sheets; the
# first entry whose key is in the device kind wins (so "TPU v4 lite", v4i, is not a v4).
# float32 is the rate at JAX's default matmul precision: TF32 tensor cores on NVIDIA
# Ampere and Hopper, one bfloat16 pass on TPU (jax.lax.Precision.DEFAULT).
_HOPPER = {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7}  # H100 SXM, H200
_TPU = lambda bf16: {"bfloat16": bf16, "float32": bf16}
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
  ("H100 PCIe", {"bfloat16": 756.0, "float16": 756.0, "float32": 378.0}),
  ("H100", _HOPPER),
  ("H200", _HOPPER),
  ("A100", {"bfloat16": 312.0, "float16": 312.0, "float32": 156.0}),
  ("TPU v4 lite", {}),
  ("TPU v4", _TPU(275.0)),
  ("TPU v5 lite", _TPU(197.0)),
  ("TPU v5e", _TPU(197.0)),
  ("TPU v5", _TPU(459.0)),  # v5p's device kind is "TPU v5" (or "TPU v5p")
  ("TPU v6 lite", _TPU(918.0)),
  ("TPU v6e", _TPU(918.0)),
)


def peak_tflops(device_kind: str, dtype: str) -> float | None:
  """The device's dense peak TFLOP/s for ``dtype`` (see ``PEAK_TFLOPS``), or None."""
  for key, peaks in PEAK_TFLOPS:
    if key.lower() in device_kind.lower():
      return peaks.get(dtype)
  return None


def jax_nn_best(backend: str) -> str:
  """jax.nn's fastest implementation on ``backend`` (where it runs for the dtype)."""
  return "jax.nn/cudnn" if backend == "gpu" else "jax.nn"


def segment_ids(B: int, T: int, docs: int, seed: int) -> np.ndarray:
  """(B, T) int32 document ids: per row, ``min(docs, T)`` documents whose lengths are set
  by cut points drawn without replacement from 1 .. T-1."""
  rng = np.random.default_rng(seed)
  n = max(1, min(docs, T))
  ids = [
    np.searchsorted(
      np.sort(rng.choice(np.arange(1, T), n - 1, replace=False)), np.arange(T), "right"
    )
    for _ in range(B)
  ]
  return np.asarray(ids, np.int32)


def packed_pairs(seg: np.ndarray) -> float:
  """Σ over rows and documents of L²/2: the packed case's query-key pairs, counted as the
  causal case counts T²/2."""
  return float(sum((np.bincount(row).astype(np.float64) ** 2).sum() / 2 for row in seg))


class Case(NamedTuple):
  """One mask (or score function) as each side takes it: keyword arguments split into the
  arrays a jitted call takes (``*_arrays``) and the settings it closes over (``*_static``);
  ``jax_nn`` None where jax.nn cannot express it. ``pairs``: the query-key pairs attended
  (the work's count)."""

  jattn_static: tuple[tuple[str, Any], ...]
  jattn_arrays: dict[str, Any]
  jax_nn_static: tuple[tuple[str, Any], ...] | None
  jax_nn_arrays: dict[str, Any] | None
  pairs: float


def alibi_slopes(N: int) -> np.ndarray:
  """ALiBi's slopes (Press et al.): 2^(-8 i / N) for heads i = 1 .. N."""
  return 2.0 ** (-8.0 * np.arange(1, N + 1) / N)


def case(mask: str, B: int, N: int, T: int, seg: np.ndarray, window: int, prefix: int, dtype):
  """The :class:`Case` of ``mask`` (see the module docstring) for (B, T, N, ·) inputs."""
  pos = np.arange(T)
  below = pos[None, :] <= pos[:, None]  # kv <= q
  if mask == "full":
    return Case((("is_causal", False),), {}, (("is_causal", False),), {}, B * T * T)
  if mask in ("causal", "softcap"):
    jattn_static: tuple = (("is_causal", True),)
    if mask == "softcap":
      jattn_static += (("logits_soft_cap", 30.0),)
    nn_static = None if mask == "softcap" else (("is_causal", True),)
    return Case(jattn_static, {}, nn_static, None if nn_static is None else {}, B * T * T / 2)
  if mask == "packed":
    same_doc = jnp.asarray(seg[:, None, :, None] == seg[:, None, None, :])
    return Case(
      (("is_causal", True),),
      {"segment_ids": jnp.asarray(seg)},
      (("is_causal", True),),
      {"mask": same_doc},
      packed_pairs(seg),
    )
  if mask == "window":
    allowed = below & (pos[None, :] >= pos[:, None] - window)
    static = (("is_causal", True), ("local_window_size", (window, 0)))
    return Case(static, {}, static, {}, B * float(allowed.sum()))
  if mask == "prefix":
    allowed = below | (pos[None, :] < prefix)
    return Case(
      (),
      {"mask": jattn.masks.prefix_lm(prefix)},
      (),
      {"mask": jnp.asarray(allowed[None, None])},
      B * (T * T + prefix * prefix) / 2,
    )
  if mask == "alibi":
    slopes = alibi_slopes(N).astype(np.float32)
    bias = slopes[:, None, None] * (pos[None, None, :] - pos[None, :, None])
    return Case(
      (("is_causal", True),),
      {"score_fn": jattn.scores.alibi(slopes)},
      (("is_causal", True),),
      {"bias": jnp.asarray(bias[None], dtype)},
      B * T * T / 2,
    )
  raise ValueError(f"mask={mask!r}: one of {', '.join(MASKS)}")


@functools.cache
def compiled_case(method: str, mode: str, static: tuple[tuple[str, Any], ...]):
  """``fn(q, k, v, arrays)`` of one method, jitted: its case's arrays (a dict of keyword
  arguments) as arguments, its static settings closed over. One per process and settings,
  so each shape compiles once."""
  if method.startswith("jax.nn"):
    implementation: Literal["cudnn", "xla"] = "cudnn" if method == "jax.nn/cudnn" else "xla"
    attn = lambda q, k, v, arrays: jax.nn.dot_product_attention(
      q, k, v, **arrays, **dict(static), implementation=implementation
    )
  else:
    impl = None if method == "auto" else method
    attn = lambda q, k, v, arrays: jattn.dot_product_attention(
      q, k, v, **arrays, **dict(static), implementation=impl
    )
  if mode == "fwd":
    return jax.jit(attn)
  return jax.jit(
    jax.grad(lambda q, k, v, x: jnp.sum(attn(q, k, v, x).astype(jnp.float32)), (0, 1, 2))
  )


def errors(compiled: dict[tuple[str, str], tuple[Any, tuple]], c: Case, q, k, v) -> dict:
  """Per method, the largest absolute error of its output (``fwd_err``) and of its gradients
  of q, k and v (``fwd_bwd_err``) against the same call in float32 at the highest matmul
  precision: jax.nn's XLA path where jax.nn expresses the case, else jattn's (materialised,
  autodiff). What each timed program computes, checked at the timed shapes."""
  if c.jax_nn_static is not None:
    ref_method, static, arrays = "jax.nn", c.jax_nn_static, c.jax_nn_arrays
  else:
    ref_method, static, arrays = "xla", c.jattn_static, c.jattn_arrays
  f32 = lambda tree: jax.tree.map(
    lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
  )
  ref_args = (*f32((q, k, v)), f32(arrays))
  out: dict[str, dict] = {m: {} for m, _ in compiled}
  for mode in ("fwd", "fwd_bwd"):
    with jax.default_matmul_precision("highest"):
      want = jax.device_get(compiled_case(ref_method, mode, static)(*ref_args))
    for (m, m_mode), (exe, fargs) in compiled.items():
      if m_mode != mode:
        continue
      got = jax.device_get(exe(*fargs))
      diffs = jax.tree.map(
        lambda g, w: float(np.max(np.abs(np.asarray(g, np.float64) - w))), got, want
      )
      out[m][f"{mode}_err"] = max(jax.tree.leaves(diffs))
  return out


def runnable(methods, backend: str, dtypes) -> list[str]:
  """The methods that can run here, printing a note for each one skipped."""
  kept = []
  for m in methods:
    if m in RUNS_ON and RUNS_ON[m] != backend:
      print(f"note: skipping {m}: it runs on {RUNS_ON[m].upper()} only (backend: {backend})")
      continue
    kept.append(m)
  if "jax.nn/cudnn" in kept and (other := [d for d in dtypes if d not in ("bfloat16", "float16")]):
    print(f"note: skipping jax.nn/cudnn for {', '.join(other)}: cuDNN runs bf16/f16 only")
  return kept


def explain(q, k, v, c: Case) -> dict[str, Any]:
  """What implementation=None runs for this call on this backend, per jattn.explain."""
  choice = jattn.explain(q, k, v, **c.jattn_arrays, **dict(c.jattn_static))
  return dict(implementation=choice.implementation, backward=choice.backward, reason=choice.reason)


def columns(show_peak: bool, show_best: bool) -> list[tuple[str, str, str]]:
  """(header, row key, format) of the printed table; % peak and vs-best only when they say
  something (a known device; a GPU, where jax.nn's best is not its XLA path)."""
  cols = [
    ("dtype", "dtype", "s"),
    ("H", "H", "d"),
    ("T", "T", "d"),
    ("mask", "mask", "s"),
    ("method", "method", "s"),
  ]
  for mode, name in (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd")):
    cols += [(f"{name} ms", f"{mode}_ms", ".2f"), (f"{name} TFLOP/s", f"{mode}_tflops", ".0f")]
    cols += [(f"{name} % peak", f"{mode}_pct_peak", ".1f")] if show_peak else []
    cols += [(f"{name} speedup", f"{mode}_speedup", ".2f")]
    cols += [(f"{name} vs best", f"{mode}_vs_best", ".2f")] if show_best else []
    cols += [(f"{name} scratch MiB", f"{mode}_scratch_mb", ".0f")]
    cols += [(f"{name} max err", f"{mode}_err", ".1e")]
  return cols


def cell(row: dict, key: str, spec: str) -> str:
  """A table cell; a missing one shows why: its pass's error, if any."""
  if key in row:
    return fmt(row[key], spec)
  return row.get(key.rsplit("_", 1)[0] + "_error", "—")


def main(argv=None) -> list[dict]:
  p = _cli.parser(
    "bench_gpu", __doc__, config=False, quick="tiny shapes, any backend (smoke test)", out_dir=None
  )
  p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
  p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
  p.add_argument("--masks", nargs="+", default=None, choices=MASKS, help="default: all")
  p.add_argument("--docs", type=int, default=4, help="documents per batch row when packed")
  p.add_argument("--window", type=int, default=512, help="keys back of the sliding window")
  p.add_argument("--prefix", type=float, default=0.25, help="prefix-LM's prefix, a share of T")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--head-dims", dest="head_dims", type=int, nargs="+", default=[64, 128])
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
  p.add_argument(
    "--max-scores-gib",
    dest="max_scores_gib",
    type=float,
    default=16.0,
    help="skip materialising methods whose float32 scores exceed this many GiB (2**30 bytes)",
  )
  p.add_argument(
    "--check-up-to",
    dest="check_up_to",
    type=int,
    default=4096,
    help="check each method's output and gradients against a float32 reference up to this T",
  )
  p.add_argument("--json", help="also write the rows here")
  args = p.parse_args(argv)
  backend, kind = jax.default_backend(), jax.devices()[0].device_kind
  min_seconds = 0.1  # each block of calls lasts about this long
  if args.quick:  # blocks of 3 calls: a smoke test times nothing it reports
    args.lengths, args.heads, args.head_dims, args.reps, args.docs = [32], 2, [8], 2, 3
    args.window, min_seconds = 8, 0.001
    args.dtypes = args.dtypes if backend != "cpu" else ["float32"]
    args.masks = args.masks or ["full", "causal", "packed"]
  args.masks = args.masks or list(MASKS)
  B, N = args.batch, args.heads
  methods_here = runnable(args.methods, backend, args.dtypes)
  peaks = {d: peak_tflops(kind, d) for d in args.dtypes}
  show_best = jax_nn_best(backend) != "jax.nn" and jax_nn_best(backend) in methods_here
  cols = columns(any(x is not None for x in peaks.values()), show_best)
  print(
    f"{kind} ({backend}), jax {jax.__version__}, B={B} N={N}, "
    f"medians of {args.reps} interleaved rounds; peak TFLOP/s: "
    + ", ".join(f"{d} {fmt(x, '.1f')}" for d, x in peaks.items())
    + "; speedup = jax.nn's time / the method's"
    + ("; vs best = jax.nn's best time (cuDNN where it runs) / the method's" if show_best else "")
    + "\n"
  )
  print("| " + " | ".join(c[0] for c in cols) + " |")
  print("|" + "---|" * len(cols))
  rows, auto = [], []
  for dtype, H, T in itertools.product(args.dtypes, args.head_dims, args.lengths):
    rng = np.random.default_rng(T)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, N, H), np.float32), dtype) for _ in "qkv")
    seg = segment_ids(B, T, args.docs, seed=T + 1)
    for mask in args.masks:
      c = case(mask, B, N, T, seg, args.window, int(args.prefix * T), dtype)
      methods = [
        m
        for m in methods_here
        if (m != "jax.nn/cudnn" or dtype in ("bfloat16", "float16"))
        and not (m in MATERIALISING and 4 * B * N * T * T > args.max_scores_gib * 2**30)
        and not (m.startswith("jax.nn") and c.jax_nn_static is None)
      ]
      auto_runs = explain(q, k, v, c)
      auto.append((dtype, H, T, mask, auto_runs))
      group: dict[str, dict[str, Any]] = {
        m: dict(device=kind, jax=jax.__version__, dtype=dtype, H=H, T=T, mask=mask)
        | dict(causal=mask != "full", method=m)
        | dict(auto_runs=auto_runs)
        for m in methods
      }
      for r in group.values():  # pct_peak stays None where unknown or the pass fails
        r.update(peak_tflops=peaks[dtype], fwd_pct_peak=None, fwd_bwd_pct_peak=None)
        if mask == "packed":
          r["doc_lengths"] = [np.bincount(row).tolist() for row in seg]
      # method -> (mode -> its jitted function, the arguments)
      calls: dict[str, tuple[Callable, tuple]] = {}
      for m in methods:
        nn = m.startswith("jax.nn")
        static = c.jax_nn_static if nn else c.jattn_static
        arrays = c.jax_nn_arrays if nn else c.jattn_arrays
        calls[m] = (functools.partial(compiled_case, m, static=static), (q, k, v, arrays))
      compiled: dict[tuple[str, str], tuple[Any, tuple]] = {}
      for mode in ("fwd", "fwd_bwd"):
        fns = {}
        for m in methods:
          fn, fargs = calls[m][0](mode), calls[m][1]
          try:  # compiled once: the program whose memory is read is the one timed
            exe = fn.lower(*fargs).compile()
          except Exception as e:  # noqa: BLE001 -- a method the backend cannot run
            group[m][f"{mode}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
            continue
          group[m][f"{mode}_scratch_mb"] = exe.memory_analysis().temp_size_in_bytes / 2**20
          fns[m] = compiled[m, mode] = (exe, fargs)
        times = _timing.rounds_ms(fns, args.reps, min_seconds)
        work = 4.0 * N * H * c.pairs * (3.5 if mode == "fwd_bwd" else 1.0)
        best = jax_nn_best(backend) if jax_nn_best(backend) in times else "jax.nn"
        for m, ms in times.items():
          tflops = work / float(np.median(ms)) / 1e9
          group[m][f"{mode}_ms"] = float(np.median(ms))
          group[m][f"{mode}_tflops"] = tflops
          group[m][f"{mode}_pct_peak"] = (
            None if peaks[dtype] is None else 100 * tflops / peaks[dtype]
          )
          if "jax.nn" in times:
            group[m][f"{mode}_speedup"] = _timing.median_ratio(times["jax.nn"], ms)
          if best in times:
            group[m][f"{mode}_vs_best"] = _timing.median_ratio(times[best], ms)
            group[m]["jax_nn_best"] = best
      if T <= args.check_up_to:
        for m, errs in errors(compiled, c, q, k, v).items():
          group[m].update(errs)
      for r in group.values():
        print("| " + " | ".join(cell(r, key, spec) for _, key, spec in cols) + " |", flush=True)
        rows.append(r)
      if args.json:  # after every group: a run cut short keeps what it measured
        _cli.write_record(args.json, rows, quiet=True)
  print(f"\nWhat auto (implementation=None) runs on {backend.upper()}, per jattn.explain:\n")
  for dtype, H, T, mask, a in auto:
    rule = a["backward"] or "its own fused backward"
    print(f"- {dtype}, H={H}, T={T}, {mask}: {a['implementation']} ({rule}): {a['reason']}")
  if args.json:
    _cli.write_record(args.json, rows)
  return rows


if __name__ == "__main__":
  main()
