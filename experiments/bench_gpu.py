"""Time jattn's paths against jax.nn's on an accelerator: cuDNN on a GPU, splash on a TPU.

For each dtype, sequence length T (= S) and mask, times the jitted forward pass
and forward+backward (gradients of q, k, v) of each method on the same inputs,
the methods taking turns in every round (``experiments._timing.rounds_ms``), and
reports the median milliseconds, TFLOP/s, that rate as a percentage of the
device's peak, the speedup over jax.nn's XLA path and over jax.nn's best on
the backend (medians of per-round ratios), and the scratch memory XLA plans for
each compiled program (``memory_analysis().temp_size_in_bytes``), which on an
accelerator is the activation memory the method needs beyond its inputs and
outputs, in MiB (2**20 bytes; the rows' ``*_scratch_mb``).

Masks (``--masks``):

    full     no mask
    causal   is_causal=True
    packed   causal within documents: ``--docs`` documents of random lengths
             (seeded) per batch row, as ``segment_ids`` for jattn and as the
             equivalent (B, 1, T, T) boolean mask for jax.nn

Work: forward 4·B·N·T·S·H, forward+backward 3.5 times that; causal halves it,
and packed counts the causal pairs inside documents, Σ L²/2 over the
documents' lengths L in place of T²/2. Methods, those that cannot run on the
backend skipped with a note:

    jax.nn        jax.nn.dot_product_attention(implementation="xla")
    jax.nn/cudnn  jax.nn.dot_product_attention(implementation="cudnn") (GPU, bf16/f16 only)
    xla           jattn, implementation="xla" (materialised, autodiff)
    blockwise     jattn, implementation="blockwise" (tiles, custom_vjp)
    splash        jattn, implementation="splash" (JAX's splash Pallas kernel; TPU only)
    flex          jattn, implementation="flex" (jattn's own Pallas kernel; GPU only)
    auto          jattn, implementation=None (what it picks: ``auto_runs``, from jattn.explain)

jax.nn's best, the ``*_vs_best`` reference: jax.nn/cudnn on a GPU where it ran
(bf16/f16), otherwise jax.nn's XLA path (jax.nn has no TPU kernel). Peak
(``PEAK_TFLOPS``): dense TFLOP/s from the vendors' data sheets, matched by
``jax.devices()[0].device_kind``; float32 counts at JAX's default matmul
precision (TF32 tensor cores on A100/H100/H200, one bfloat16 pass on TPU); an
unknown device gets no percentage (None, no column).

    python -m experiments.bench_gpu                      # the grid below, on the default backend
    python -m experiments.bench_gpu --lengths 1024 --dtypes bfloat16 --masks packed --reps 3
    python -m experiments.bench_gpu --quick              # tiny shapes, any backend (smoke test)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from experiments import _cli, _timing
from experiments._timing import fmt
from experiments.bench import compiled

METHODS = ("jax.nn", "jax.nn/cudnn", "xla", "blockwise", "splash", "flex", "auto")
MASKS = ("full", "causal", "packed")
RUNS_ON = {"jax.nn/cudnn": "gpu", "splash": "tpu", "flex": "gpu"}  # the rest run anywhere
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


@functools.cache
def compiled_packed(method: str, mode: str):
  """Like ``experiments.bench.compiled``, for the packed case: ``fn(q, k, v, x)`` where x is
  the (B, 1, T, T) mask for jax.nn's methods and the (B, T) segment ids for jattn's."""
  if method.startswith("jax.nn"):
    implementation: Literal["cudnn", "xla"] = "cudnn" if method == "jax.nn/cudnn" else "xla"
    attn = lambda q, k, v, mask: jax.nn.dot_product_attention(
      q, k, v, mask=mask, is_causal=True, implementation=implementation
    )
  else:
    impl = None if method == "auto" else method
    attn = lambda q, k, v, seg: jattn.dot_product_attention(
      q, k, v, is_causal=True, segment_ids=seg, implementation=impl
    )
  if mode == "fwd":
    return jax.jit(attn)
  return jax.jit(
    jax.grad(lambda q, k, v, x: jnp.sum(attn(q, k, v, x).astype(jnp.float32)), (0, 1, 2))
  )


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


def explain(q, k, v, mask: str, seg) -> dict[str, Any]:
  """What implementation=None runs for this call on this backend, per jattn.explain."""
  kw: dict[str, Any] = {"is_causal": mask != "full"}
  if mask == "packed":
    kw["segment_ids"] = seg
  choice = jattn.explain(q, k, v, **kw)
  return dict(implementation=choice.implementation, backward=choice.backward, reason=choice.reason)


def columns(show_peak: bool, show_best: bool) -> list[tuple[str, str, str]]:
  """(header, row key, format) of the printed table; % peak and vs-best only when they say
  something (a known device; a GPU, where jax.nn's best is not its XLA path)."""
  cols = [
    ("dtype", "dtype", "s"),
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
  p.add_argument("--masks", nargs="+", default=list(MASKS), choices=MASKS)
  p.add_argument("--docs", type=int, default=4, help="documents per batch row when packed")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--head-dim", dest="head_dim", type=int, default=128)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
  p.add_argument(
    "--max-scores-gib",
    dest="max_scores_gib",
    type=float,
    default=16.0,
    help="skip materialising methods whose float32 scores exceed this many GiB (2**30 bytes)",
  )
  p.add_argument("--json", help="also write the rows here")
  args = p.parse_args(argv)
  backend, kind = jax.default_backend(), jax.devices()[0].device_kind
  min_seconds = 0.1  # each block of calls lasts about this long
  if args.quick:  # blocks of 3 calls: a smoke test times nothing it reports
    args.lengths, args.heads, args.head_dim, args.reps, args.docs = [32], 2, 8, 2, 3
    min_seconds = 0.001
    args.dtypes = args.dtypes if backend != "cpu" else ["float32"]
  B, N, H = args.batch, args.heads, args.head_dim
  methods_here = runnable(args.methods, backend, args.dtypes)
  peaks = {d: peak_tflops(kind, d) for d in args.dtypes}
  show_best = jax_nn_best(backend) != "jax.nn" and jax_nn_best(backend) in methods_here
  cols = columns(any(x is not None for x in peaks.values()), show_best)
  print(
    f"{kind} ({backend}), jax {jax.__version__}, B={B} N={N} H={H}, "
    f"medians of {args.reps} interleaved rounds; peak TFLOP/s: "
    + ", ".join(f"{d} {fmt(x, '.1f')}" for d, x in peaks.items())
    + "; speedup = jax.nn's time / the method's"
    + ("; vs best = jax.nn's best time (cuDNN where it runs) / the method's" if show_best else "")
    + "\n"
  )
  print("| " + " | ".join(c[0] for c in cols) + " |")
  print("|" + "---|" * len(cols))
  rows, auto = [], []
  for dtype in args.dtypes:
    for T in args.lengths:
      rng = np.random.default_rng(T)
      q, k, v = (
        jnp.asarray(rng.standard_normal((B, T, N, H), np.float32), dtype) for _ in range(3)
      )
      seg = segment_ids(B, T, args.docs, seed=T + 1)
      for mask in args.masks:
        causal = mask != "full"
        methods = [
          m
          for m in methods_here
          if (m != "jax.nn/cudnn" or dtype in ("bfloat16", "float16"))
          and not (m in MATERIALISING and 4 * B * N * T * T > args.max_scores_gib * 2**30)
        ]
        auto_runs = explain(q, k, v, mask, seg)
        auto.append((dtype, T, mask, auto_runs))
        pairs = packed_pairs(seg) if mask == "packed" else B * T * T / (2 if causal else 1)
        group: dict[str, dict[str, Any]] = {
          m: dict(dtype=dtype, T=T, mask=mask, causal=causal, method=m, auto_runs=auto_runs)
          for m in methods
        }
        for r in group.values():  # pct_peak stays None where unknown or the pass fails
          r.update(peak_tflops=peaks[dtype], fwd_pct_peak=None, fwd_bwd_pct_peak=None)
          if mask == "packed":
            r["doc_lengths"] = [np.bincount(row).tolist() for row in seg]
        # method -> (mode -> its jitted function, the arguments)
        calls: dict[str, tuple[Callable, tuple]] = {
          m: (functools.partial(compiled, m, causal), (q, k, v)) for m in methods
        }
        if mask == "packed":  # jax.nn's methods take the (B, 1, T, T) mask, jattn's the ids
          same_doc = jnp.asarray(seg[:, None, :, None] == seg[:, None, None, :])
          calls = {
            m: (
              functools.partial(compiled_packed, m),
              (q, k, v, same_doc if m.startswith("jax.nn") else jnp.asarray(seg)),
            )
            for m in methods
          }
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
            fns[m] = (exe, fargs)
          times = _timing.rounds_ms(fns, args.reps, min_seconds)
          work = 4.0 * N * H * pairs * (3.5 if mode == "fwd_bwd" else 1.0)
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
        for r in group.values():
          print("| " + " | ".join(cell(r, key, spec) for _, key, spec in cols) + " |", flush=True)
          rows.append(r)
  print(f"\nWhat auto (implementation=None) runs on {backend.upper()}, per jattn.explain:\n")
  for dtype, T, mask, a in auto:
    rule = a["backward"] or "its own fused backward"
    print(f"- {dtype}, T={T}, {mask}: {a['implementation']} ({rule}): {a['reason']}")
  if args.json:
    _cli.write_record(args.json, rows)
  return rows


if __name__ == "__main__":
  main()
