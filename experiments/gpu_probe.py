"""One GPU probe: flex's kernels against cuDNN and JAX's Mosaic GPU attention, one record.

Made to run once, in a few minutes, on a fresh GPU machine that has only its image's
packages (jax 0.11.x; nothing else is needed: jattn is imported from this checkout), and to
write everything it measured to one JSON record. For bf16, B=1, N=16 heads, it times:

- **baselines**, for head dims 64 and 128, T = S = 4,096 and 16,384, no mask and causal:
  jax.nn's cuDNN kernel (``jax.nn.dot_product_attention(implementation="cudnn")``), jattn's
  ``implementation="flex"`` at its table's tiles, and JAX's Mosaic GPU kernel
  (``jax.experimental.pallas.ops.gpu.attention_mgpu``, Hopper only; q pre-scaled, as it
  takes no scale), each as the forward pass, the backward pass alone (the VJP applied to
  saved residuals) and the forward+backward program (gradients of q, k, v); and flex's
  Hopper kernels (``jattn/impl/flex_hopper/``, methods ``hopper`` and ``hopper_ws``, the
  second with the warp-specialised forward and backward kernels; not yet routed to);
- **flex's candidate tilings**, at T = 16,384, causal, for each head dim: forward tiles
  (forward timed alone) and backward tiles of the dQ and dK/dV kernels (backward timed
  alone), the table's row patched for each (``jattn.impl.flex.TILES``);
- **variants** of the table's row (``--sections variants``), H = 128, causal: its tiles in
  natural order, and dS for dK the other way from the GPU's row of ``flex.SPLIT_DS`` (hi +
  lo, or rounded once), timed beside cuDNN; then the errors of cuDNN, jax.nn's XLA path and
  flex both ways on inputs that round dS hard.

Each configuration's output and gradients are checked against the same call in float32
at the highest matmul precision (jax.nn's XLA path, a few heads at a time), as the largest
absolute error and the relative error ``‖x − ref‖ / ‖ref‖``, beside cuDNN's on the same
inputs. TFLOP/s count 4·B·N·T·S·H for the forward (half that causal) and 2.5 times that for
the backward. Each Mosaic GPU row (``hopper``, ``hopper_ws``, ``mgpu``) also keeps ptxas's
report of its kernels, registers and spill bytes (``ptxas``: what no CPU can compile for,
printed by Mosaic GPU with MOSAIC_GPU_DUMP_PTXAS set and read from the process's output).
A configuration that fails to compile (shared memory, registers) is recorded
with its error and skipped. Past ``--budget`` seconds the remaining sections are skipped
(recorded as such), so a record is always written.

    python -m experiments.gpu_probe --out docs/gpu/probe.json     # on a GPU
    python -m experiments.gpu_probe --quick                       # tiny, interpret mode, CPU
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import math
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn.impl import flex
from jattn.impl import flex_hopper as _hopper

START = time.perf_counter()
Tiles, Passes = flex.Tiles, flex.Passes

# Candidate tilings at T = 16,384, causal, by head dim: (forward tiles), (dQ, dK/dV tiles).
FORWARD_CANDIDATES = {
  128: [
    Tiles(128, 32, 8, 3),
    Tiles(128, 64, 8, 3),
    Tiles(128, 64, 4, 3),
    Tiles(128, 128, 8, 2),
    Tiles(128, 128, 8, 3),
    Tiles(64, 128, 4, 3),
    Tiles(64, 64, 4, 3),
  ],
  64: [
    Tiles(64, 64, 4, 3),
    Tiles(128, 64, 4, 3),
    Tiles(128, 64, 8, 3),
    Tiles(128, 128, 8, 2),
    Tiles(128, 128, 8, 3),
  ],
}
BACKWARD_CANDIDATES = {
  128: [
    (Tiles(128, 32, 8, 3), Tiles(128, 32, 8, 3)),
    (Tiles(128, 64, 8, 2), Tiles(128, 32, 8, 3)),
    (Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 3)),
    (Tiles(128, 32, 8, 3), Tiles(64, 64, 8, 2)),
    (Tiles(64, 64, 4, 3), Tiles(64, 32, 4, 3)),
    (Tiles(128, 64, 8, 3), Tiles(32, 64, 4, 3)),
    (Tiles(64, 32, 4, 3), Tiles(32, 128, 8, 2)),
  ],
  64: [
    (Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 3)),
    (Tiles(128, 64, 8, 2), Tiles(64, 64, 4, 3)),
    (Tiles(128, 32, 8, 3), Tiles(128, 32, 8, 3)),
    (Tiles(64, 64, 4, 3), Tiles(64, 128, 8, 2)),
  ],
}


# A second round near the table's tiles, H = 128 only: the dK/dV kernel in the transposed
# domain (not yet run on a GPU) at the table's 32 x 64 and 4 warps (spills in Triton 3.9),
# at 8 warps (no spills) and at 64 x 64 (no spills).
NEAR = (
  {128: [Tiles(128, 128, 8, 3), Tiles(128, 64, 8, 3)]},
  {
    128: [
      (Tiles(128, 128, 8, 2), Tiles(32, 64, 4, 3)),
      (Tiles(128, 128, 8, 2), Tiles(32, 64, 8, 3)),
      (Tiles(128, 128, 8, 2), Tiles(64, 64, 8, 2)),
      (Tiles(128, 128, 8, 2), Tiles(64, 64, 4, 3)),
      (Tiles(128, 128, 8, 2), Tiles(32, 128, 8, 2)),
    ]
  },
)


@contextlib.contextmanager
def natural_order() -> Iterator[None]:
  """flex's kernels take their tiles in the schedule's order (heaviest first undone)."""
  saved = flex.tiling.heaviest_last
  flex.tiling.heaviest_last = lambda schedule: False
  try:
    yield
  finally:
    flex.tiling.heaviest_last = saved


@contextlib.contextmanager
def ds_parts(split: bool) -> Iterator[None]:
  """flex's dK/dV kernel sums dS as hi + lo (``split``) or rounded once, on every GPU."""
  saved = dict(flex.SPLIT_DS)
  flex.SPLIT_DS.update(dict.fromkeys(saved, split))
  try:
    yield
  finally:
    flex.SPLIT_DS.update(saved)


# flex with one choice undone (the table's row as it is: "table"); of the two dS variants
# the probe runs the one that differs from the GPU's row of flex.SPLIT_DS.
VARIANTS: dict[str, Callable[[], Any]] = {
  "table": contextlib.nullcontext,
  "natural_order": natural_order,
  "one_part_ds": functools.partial(ds_parts, False),
  "two_part_ds": functools.partial(ds_parts, True),
}


def other_ds() -> str:
  """The dS variant that differs from this GPU's row (an interpreter's: Ampere's)."""
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  kind = gpus[0].device_kind if gpus else ""
  return "one_part_ds" if flex.SPLIT_DS.get(flex.generation(kind), True) else "two_part_ds"


# Inputs that round dS hard, as (q and k multiplied by, the call's scale; None: H**-0.5):
# scores of about 4 standard deviations, and experiments/accuracy.py's saturated_x10 and
# scale_1e3 cases (near one-hot rows: their dS is mostly tiny, so read max_abs there too).
STRESS = {"peaked_x2": (2.0, None), "saturated_x10": (10.0, None), "scale_1e3": (1.0, 1e3)}


def jax_nn(implementation: Literal["cudnn", "xla"], causal: bool, scale: float) -> Callable:
  """``(q, k, v) -> out`` of jax.nn's call through ``implementation`` ("cudnn", "xla")."""
  return lambda q, k, v: jax.nn.dot_product_attention(
    q, k, v, is_causal=causal, scale=scale, implementation=implementation
  )


def elapsed() -> float:
  return time.perf_counter() - START


def log(*args: Any) -> None:
  print(f"[{elapsed():6.1f}s]", *args, flush=True)


def time_ms(fn: Callable, args: tuple, min_ms: float, repeats: int) -> tuple[float, list[float]]:
  """The median milliseconds per call of ``fn(*args)``: after an untimed call, ``repeats``
  blocks of back-to-back calls, each block at least ``min_ms`` long, synchronised at its
  end."""
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  one = (time.perf_counter() - t0) * 1e3
  calls = max(1, min(500, math.ceil(min_ms / max(one, 1e-3))))
  samples = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) * 1e3 / calls)
  return float(np.median(samples)), samples


def flops(B: int, N: int, T: int, H: int, causal: bool) -> float:
  """The forward's matmul FLOPs over the attended pairs (the backward does 2.5 times these)."""
  return 4.0 * B * N * T * T * H * (0.5 if causal else 1.0)


@contextlib.contextmanager
def patched_tiles(H: int, passes: flex.Passes | None) -> Iterator[None]:
  """flex's table row for this GPU, head dim and bf16 replaced by ``passes`` (None: as is).
  JAX's caches are cleared on the way in and out: jattn's jitted core is cached by the
  call's settings, which do not hold the table's tiles."""
  key = (flex.generation(jax.devices()[0].device_kind), max(64, H), 2)
  old = flex.TILES.get(key)
  if passes is not None:
    flex.TILES[key] = passes
  jax.clear_caches()
  try:
    yield
  finally:
    if old is not None:
      flex.TILES[key] = old
    jax.clear_caches()


def method(name: str, causal: bool, scale: float) -> Callable:
  """``(q, k, v) -> out`` of one method (q, k, v: (B, T, N, H))."""
  if name == "cudnn":
    return jax_nn("cudnn", causal, scale)
  if name in ("hopper", "hopper_ws"):  # flex's Hopper kernels (jattn/impl/flex_hopper/),
    # not yet routed to (implementation="flex_hopper" opts in); _ws: warp-specialised kernels
    specialized, interpret = name == "hopper_ws", jattn.testing.interpreting()
    return lambda q, k, v: _hopper.attention(
      q, k, v, scale=scale, is_causal=causal, specialized=specialized, interpret=interpret
    )[0]
  if name == "mgpu":  # takes no scale: q is scaled before it (outside the timed program)
    from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu

    config = mgpu.TuningConfig(
      block_q=64,
      block_kv=128,
      max_concurrent_steps=2,
      causal=causal,
      block_q_dkv=64,
      block_kv_dkv=64,
      block_q_dq=64,
      block_kv_dq=64,
    )
    return lambda q, k, v: mgpu.attention(q, k, v, config)
  return lambda q, k, v: jattn.dot_product_attention(
    q, k, v, is_causal=causal, scale=scale, implementation=name
  )


# ptxas's report of a kernel (``ptxas -v``), as Mosaic GPU prints it with MOSAIC_GPU_DUMP_PTXAS
PTXAS_FUNCTION = re.compile(r"(?:Compiling entry function|Function properties for) '?([\w$.]+)'?")
PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")


def ptxas_report(text: str) -> list[dict[str, Any]]:
  """Each function ptxas reports in ``text``: its registers and spill bytes."""
  rows: list[dict[str, Any]] = []
  for line in text.splitlines():
    if m := PTXAS_FUNCTION.search(line):
      if not rows or rows[-1]["function"] != m.group(1):
        rows.append({"function": m.group(1)})
    elif rows and (m := PTXAS_SPILLS.search(line)):
      rows[-1]["spill_stores"], rows[-1]["spill_loads"] = int(m.group(1)), int(m.group(2))
    elif rows and (m := PTXAS_REGISTERS.search(line)):
      rows[-1]["registers"] = int(m.group(1))
  return rows


@contextlib.contextmanager
def mosaic_ptxas(row: dict[str, Any]) -> Iterator[None]:
  """Around a Mosaic GPU method's compiles: ptxas's report of each kernel (registers,
  spills: what no CPU can compile for), which Mosaic GPU prints to the process's own output
  with MOSAIC_GPU_DUMP_PTXAS set, captured there (and echoed after) into ``row["ptxas"]``.
  Whatever fails here costs the report only, never the row."""
  try:
    capture = _Captured()
  except Exception as e:  # noqa: BLE001 -- no report then, the row goes on
    row["ptxas"] = f"not captured: {type(e).__name__}: {e}"
    yield
    return
  try:
    yield
  finally:
    text = capture.close()
    row["ptxas"] = ptxas_report(text) or "no ptxas report in the output"


class _Captured:
  """The process's output (file descriptors 1 and 2, C's stdio included) into a temporary
  file, with MOSAIC_GPU_DUMP_PTXAS set, until :meth:`close` restores both and returns what
  was written (echoing it)."""

  def __init__(self) -> None:
    self.libc = ctypes.CDLL(None)
    self.before = os.environ.get("MOSAIC_GPU_DUMP_PTXAS")
    self.file = tempfile.TemporaryFile()
    self.flush()
    self.saved = os.dup(1), os.dup(2)
    os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
    os.dup2(self.file.fileno(), 1)
    os.dup2(self.file.fileno(), 2)

  def flush(self) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    self.libc.fflush(None)

  def close(self) -> str:
    self.flush()
    for fd, copy in zip((1, 2), self.saved):
      os.dup2(copy, fd)
      os.close(copy)
    if self.before is None:
      os.environ.pop("MOSAIC_GPU_DUMP_PTXAS", None)
    else:
      os.environ["MOSAIC_GPU_DUMP_PTXAS"] = self.before
    self.file.seek(0)
    text = self.file.read().decode(errors="replace")
    self.file.close()
    sys.stdout.write(text)
    return text


def reference(q: Any, k: Any, v: Any, do: Any, causal: bool, scale: float, chunk: int) -> Any:
  """``(out, (dq, dk, dv))`` in float32 at the highest precision, ``chunk`` heads at a time
  (jax.nn's XLA path materialises (T, S) per head)."""

  outs, grads = [], []
  N = q.shape[2]
  with jax.default_matmul_precision("highest"):
    for n in range(0, N, chunk):
      part = [x[:, :, n : n + chunk].astype(jnp.float32) for x in (q, k, v, do)]
      out, g = _reference_heads(*part, causal=causal, scale=scale)
      outs.append(np.asarray(out))
      grads.append([np.asarray(x) for x in g])
  return np.concatenate(outs, 2), tuple(np.concatenate([g[i] for g in grads], 2) for i in range(3))


@functools.partial(jax.jit, static_argnames=("causal", "scale"))
def _reference_heads(q: Any, k: Any, v: Any, do: Any, *, causal: bool, scale: float) -> Any:
  out, vjp = jax.vjp(jax_nn("xla", causal, scale), q, k, v)
  return out, vjp(do)


def errors(got: Any, want: np.ndarray) -> dict[str, float]:
  got = np.asarray(jnp.asarray(got, jnp.float32))
  diff = got - want
  return dict(
    max_abs=float(np.abs(diff).max()),
    rel=float(np.linalg.norm(diff)) / max(float(np.linalg.norm(want)), 1e-30),
    finite=bool(np.isfinite(got).all()),
  )


class Probe:
  def __init__(self, args: argparse.Namespace) -> None:
    self.args = args
    self.records: list[dict[str, Any]] = []
    self.skipped: list[str] = []

  def over_budget(self, what: str) -> bool:
    if elapsed() > self.args.budget:
      self.skipped.append(what)
      log("over budget, skipped:", what)
      return True
    return False

  def inputs(self, H: int, T: int, seed: int) -> tuple[Any, ...]:
    rng = np.random.default_rng(seed)
    shape = (self.args.batch, T, self.args.heads, H)
    return tuple(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(4))

  def run(
    self,
    row: dict[str, Any],
    fn: Callable,
    q: Any,
    k: Any,
    v: Any,
    do: Any,
    ref: Any,
    parts: tuple[str, ...],
  ) -> dict[str, Any]:
    """Times ``parts`` of ``fn`` ("fwd", "bwd", "fwd_bwd") and checks its values."""
    a = self.args
    B, T, N, H = q.shape
    work = flops(B, N, T, H, row["causal"])
    try:
      if "fwd" in parts:
        fwd = jax.jit(fn)
        row["fwd_ms"], row["fwd_samples"] = time_ms(fwd, (q, k, v), a.min_ms, a.repeats)
        row["fwd_tflops"] = work / row["fwd_ms"] / 1e9
        if ref is not None:
          row["err_out"] = errors(fwd(q, k, v), ref[0])
      if "bwd" in parts:
        _, vjp = jax.vjp(jax.jit(fn), q, k, v)
        bwd = jax.jit(lambda vjp, do: vjp(do))
        row["bwd_ms"], row["bwd_samples"] = time_ms(bwd, (vjp, do), a.min_ms, a.repeats)
        row["bwd_tflops"] = 2.5 * work / row["bwd_ms"] / 1e9
        if ref is not None:
          grads = bwd(vjp, do)
          for name, g, w in zip(("dq", "dk", "dv"), grads, ref[1]):
            row[f"err_{name}"] = errors(g, w)
      if "check" in parts and ref is not None:  # values only, nothing timed
        out, vjp = jax.vjp(jax.jit(fn), q, k, v)
        row["err_out"] = errors(out, ref[0])
        grads = jax.jit(lambda vjp, do: vjp(do))(vjp, do)
        for name, g, w in zip(("dq", "dk", "dv"), grads, ref[1]):
          row[f"err_{name}"] = errors(g, w)
      if "fwd_bwd" in parts:
        loss = lambda q, k, v, do: jnp.sum(fn(q, k, v).astype(jnp.float32) * do)
        step = jax.jit(jax.grad(loss, (0, 1, 2)))
        row["fwd_bwd_ms"], _ = time_ms(step, (q, k, v, do), a.min_ms, a.repeats)
        row["fwd_bwd_tflops"] = 3.5 * work / row["fwd_bwd_ms"] / 1e9
    except Exception as e:  # noqa: BLE001 -- a configuration the GPU refuses is a result
      row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      log("  failed:", row["error"].splitlines()[0][:160])
      if a.quick:
        traceback.print_exc()
    self.records.append(row)
    shown = {k: round(v, 3) for k, v in row.items() if k.endswith(("_ms", "_tflops"))}
    log(" ", row.get("method"), row.get("tiles", ""), shown)
    return row

  def baselines(self, H: int, T: int, causal: bool) -> None:
    a = self.args
    if self.over_budget(f"baselines H={H} T={T} causal={causal}"):
      return
    q, k, v, do = self.inputs(H, T, seed=H + T + causal)
    scale = H**-0.5
    ref = None
    if T <= a.check_up_to:
      ref = reference(q, k, v, do, causal, scale, a.ref_chunk)
    for name in a.methods:
      base = dict(section="baseline", method=name, H=H, T=T, causal=causal)
      if name == "mgpu":  # float16: its kernel in jax 0.11 takes no bfloat16
        base["dtype"] = "float16"
        qs, ks, vs, dos = (x.astype(jnp.float16) for x in (q * scale, k, v, do))
        mref = None if ref is None else reference(qs, ks, vs, dos, causal, 1.0, a.ref_chunk)
        with self.reported(base):
          row = self.run(base, method(name, causal, scale), qs, ks, vs, dos, mref, a.parts)
        if "err_dq" in row:  # the gradient of the unscaled q
          dq = row.pop("err_dq")
          row["err_dq_of_scaled_q"] = dq
        continue
      passes = flex.tiles_for(H, 2) if name == "flex" else None
      if passes is not None:
        base["tiles"] = [list(x) for x in passes]
      with patched_tiles(H, None), self.reported(base):
        self.run(base, method(name, causal, scale), q, k, v, do, ref, a.parts)

  def reported(self, row: dict[str, Any]) -> Any:
    """ptxas's report of a Mosaic GPU method's kernels into ``row`` (:func:`mosaic_ptxas`),
    on a GPU (the interpreter compiles none)."""
    mosaic = row["method"] in ("hopper", "hopper_ws", "mgpu")
    return mosaic_ptxas(row) if mosaic and not self.args.quick else contextlib.nullcontext()

  def variants(self, H: int, T: int) -> None:
    """flex at its table's tiles with one choice undone, beside cuDNN in the same run (causal):
    its tiles in natural order (not heaviest first) and dK summed from dS rounded once (not
    hi + lo), timed at ``T``; then the errors of cuDNN, jax.nn's XLA path and flex with and
    without the split on the inputs that round dS hardest (``STRESS``), at ``--stress-length``."""
    a = self.args
    if self.over_budget(f"variants H={H} T={T}"):
      return
    q, k, v, do = self.inputs(H, T, seed=11 * H + T)
    scale = H**-0.5
    ref = reference(q, k, v, do, True, scale, a.ref_chunk) if T <= a.check_up_to else None
    parts = ("fwd", "bwd", "fwd_bwd")
    base = dict(section="variant", H=H, T=T, causal=True)
    if "cudnn" in a.methods:
      self.run(dict(base, method="cudnn"), method("cudnn", True, scale), q, k, v, do, ref, parts)
    for name in ("table", "natural_order", other_ds()):
      with VARIANTS[name](), patched_tiles(H, None):
        row = dict(base, method="flex", variant=name, tiles=[list(x) for x in flex.tiles_for(H, 2)])
        self.run(row, method("flex", True, scale), q, k, v, do, ref, parts)
    T = a.stress_length
    for case, (input_scale, scale) in STRESS.items():
      if self.over_budget(f"stress {case} H={H}"):
        return
      q, k, v, do = self.inputs(H, T, seed=13 * H + T)
      q, k = (jnp.asarray(x.astype(jnp.float32) * input_scale, jnp.bfloat16) for x in (q, k))
      scale = H**-0.5 if scale is None else scale
      ref = reference(q, k, v, do, True, scale, a.ref_chunk)
      base = dict(section="stress", case=case, H=H, T=T, causal=True)
      peers: tuple[Literal["cudnn", "xla"], ...] = ("cudnn", "xla")
      for name in peers if "cudnn" in a.methods else peers[1:]:
        fn = jax_nn(name, True, scale)
        self.run(dict(base, method=f"jax.nn/{name}"), fn, q, k, v, do, ref, ("check",))
      for name in ("table", other_ds()):  # the order changes no value
        with VARIANTS[name](), patched_tiles(H, None):
          row = dict(base, method="flex", variant=name)
          self.run(row, method("flex", True, scale), q, k, v, do, ref, ("check",))

  def candidates(self, H: int, T: int) -> None:
    a = self.args
    q, k, v, do = self.inputs(H, T, seed=7 * H + T)
    scale = H**-0.5
    ref = None
    if T <= a.check_up_to_candidates:
      ref = reference(q, k, v, do, True, scale, a.ref_chunk)
    table = flex.tiles_for(H, 2)
    for fwd in a.forward_candidates.get(H, []):
      if self.over_budget(f"forward {fwd} H={H}"):
        return
      passes = table._replace(forward=fwd)
      row = dict(section="forward", method="flex", H=H, T=T, causal=True, tiles=list(fwd))
      with patched_tiles(H, passes):
        self.run(row, method("flex", True, scale), q, k, v, do, ref, ("fwd",))
    for dq, dkv in a.backward_candidates.get(H, []):
      if self.over_budget(f"backward {dq} {dkv} H={H}"):
        return
      passes = table._replace(dq=dq, dkv=dkv)
      row = dict(section="backward", method="flex", H=H, T=T, causal=True)
      row["tiles"] = [list(dq), list(dkv)]
      with patched_tiles(H, passes):
        self.run(row, method("flex", True, scale), q, k, v, do, ref, ("bwd",))


def main(argv: list[str] | None = None) -> dict[str, Any]:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_probe.json"))
  p.add_argument("--quick", action="store_true", help="tiny shapes, interpret mode (CPU)")
  p.add_argument("--head-dims", dest="head_dims", type=int, nargs="+", default=[128, 64])
  p.add_argument("--lengths", type=int, nargs="+", default=[16384, 4096])
  p.add_argument("--candidate-length", dest="candidate_length", type=int, default=16384)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--budget", type=float, default=360.0, help="seconds before skipping the rest")
  p.add_argument("--min-ms", dest="min_ms", type=float, default=30.0)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--methods", nargs="+", default=["cudnn", "flex", "hopper", "hopper_ws", "mgpu"])
  p.add_argument(
    "--sections",
    nargs="+",
    default=["candidates", "variants", "baselines"],
    choices=["candidates", "variants", "baselines"],
  )
  p.add_argument("--near", action="store_true", help="the second round's candidates (NEAR)")
  p.add_argument("--stress-length", dest="stress_length", type=int, default=4096)
  a = p.parse_args(argv)
  a.parts = ("fwd", "bwd", "fwd_bwd")
  a.check_up_to, a.check_up_to_candidates, a.ref_chunk = 16384, 16384, 2
  a.forward_candidates, a.backward_candidates = (
    NEAR
    if a.near
    else (
      FORWARD_CANDIDATES,
      BACKWARD_CANDIDATES,
    )
  )
  backend = jax.default_backend()
  interpret: Any = contextlib.nullcontext()
  if a.quick:  # a smoke test of the probe itself: it times nothing worth reporting
    a.head_dims, a.lengths, a.candidate_length, a.heads = [16], [32], 32, 2
    a.min_ms, a.repeats, a.methods, a.stress_length = 0.0, 1, ["flex"], 32
    a.forward_candidates = {16: [Tiles(16, 16, 4, 2), Tiles(32, 16, 4, 2)]}
    a.backward_candidates = {16: [(Tiles(16, 32, 4, 2), Tiles(32, 16, 4, 2))]}
    interpret = jattn.testing.interpret_kernels()
  elif backend != "gpu":
    p.error("the probe times GPU kernels; on another backend only --quick runs (interpreted)")
  kind = jax.devices()[0].device_kind
  for hopper_only in ("hopper", "hopper_ws", "mgpu"):  # the Mosaic GPU kernels, jattn's, JAX's
    if hopper_only in a.methods and flex.generation(kind) != "sm_90":
      a.methods.remove(hopper_only)
  log(f"{kind} ({backend}), jax {jax.__version__}, B={a.batch} N={a.heads}, bf16")
  probe = Probe(a)
  with interpret:
    for H in a.head_dims if "candidates" in a.sections else ():
      log(f"candidates H={H} T={a.candidate_length}")
      probe.candidates(H, a.candidate_length)
    for H in a.head_dims if "variants" in a.sections else ():
      log(f"variants H={H} T={a.candidate_length}")
      probe.variants(H, a.candidate_length)
    for T in a.lengths if "baselines" in a.sections else ():
      for H in a.head_dims:
        for causal in (True, False):
          log(f"baselines H={H} T={T} causal={causal}")
          probe.baselines(H, T, causal)
    if a.quick and "baselines" in a.sections and _hopper.has_interpreter():
      # The Hopper kernels in Mosaic GPU's interpreter (jax >= 0.11.2), at the smallest shapes
      # they take (H = 64, two 128-row blocks): the probe's own path for its hopper rows.
      a.methods = ["hopper", "hopper_ws"]
      log("baselines (interpreted Hopper kernels) H=64 T=256 causal=True")
      probe.baselines(64, 256, True)
  record = dict(
    device=kind,
    backend=backend,
    jax=jax.__version__,
    dtype="bfloat16",
    batch=a.batch,
    heads=a.heads,
    table={f"{g}/{h}/{b}": [list(x) for x in v] for (g, h, b), v in flex.TILES.items()},
    split_ds=dict(flex.SPLIT_DS),
    seconds=round(elapsed(), 1),
    skipped=probe.skipped,
    rows=probe.records,
  )
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out, "w") as f:
    json.dump(record, f, indent=1)
  summary(probe.records)
  log(f"wrote {a.out}")
  return record


def summary(rows: list[dict[str, Any]]) -> None:
  """A short table: each row's times, TFLOP/s and relative errors."""
  print("| section | method | H | T | causal | tiles | fwd ms | bwd ms | fwd+bwd ms | fwd TF/s |"
        " bwd TF/s | fwd+bwd TF/s | err out | err dq | err dk | error |")  # fmt: skip
  print("|" + "---|" * 16)
  g = lambda r, key: f"{r[key]:.3f}" if key in r else ""
  e = lambda r, key: f"{r[key]['rel']:.1e}" if key in r else ""
  for r in rows:
    tiles = r.get("tiles", "")
    which = "/".join(str(r[x]) for x in ("case", "variant") if x in r)
    cells = [r["section"], r["method"] + (f" {which}" if which else ""), r["H"], r["T"]]
    cells += [r["causal"], tiles]
    cells += [g(r, "fwd_ms"), g(r, "bwd_ms"), g(r, "fwd_bwd_ms")]
    cells += [g(r, "fwd_tflops"), g(r, "bwd_tflops"), g(r, "fwd_bwd_tflops")]
    cells += [e(r, "err_out"), e(r, "err_dq"), e(r, "err_dk"), r.get("error", "")[:60]]
    print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
  main()
