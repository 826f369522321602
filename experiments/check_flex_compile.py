"""Check that flex's kernels compile for Ampere and Hopper at the tile table's settings.

For each GPU generation (an A100 for sm_80, an H100 for sm_90), head dim H and dtype, lowers
a causal ``implementation="flex"`` call with segment ids, forward and backward (gradients
of q, k, v), for CUDA from this machine (no GPU needed: ``jattn.testing.lowering_for("gpu",
device_kind)``, so the kernels take that generation's row of ``TILES``), takes each of the
three Triton kernels (forward, dQ, dK/dV) out of the program as Triton IR, compiles it with
the standalone ``triton`` package for that GPU, and reads from ``ptxas -v`` the registers
per thread and the bytes spilled to local memory, with the shared memory the kernel asks
for. From the machine code (``cuobjdump -sass``, which Triton's package also carries) it
counts the matrix instructions, warpgroup ``HGMMA`` (wgmma) and warp-level ``HMMA``
(mma.sync), and, in the kernel's first loop that holds matrix instructions (the loop over
FULL tiles, no mask arithmetic), the other instructions per column it steps over (key
columns in the forward and dQ kernels, query rows in dK/dV): the softmax, rescaling and
address arithmetic each column of scores costs beside the matmuls. It prints one row per
kernel and exits with status 1 if any kernel spills, asks for more shared memory than the
GPU has, or fails to compile.

Needs the ``gpu`` extra (``pip install -e ".[gpu]"``: the ``triton`` package, which brings
its own ``ptxas``). XLA compiles the same Triton IR with the Triton it is built with;
register counts from another release's passes are close, not identical.

    python -m experiments.check_flex_compile                 # sm_80 and sm_90, H 64/128/256
    python -m experiments.check_flex_compile --json runs/flex_compile.json
    python -m experiments.check_flex_compile --quick         # sm_90, H=64, bf16 only
"""

from __future__ import annotations

import itertools
import math
import re
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir as jax_mlir

import jattn
from experiments import _cli
from experiments._timing import fmt
from jattn.impl import flex

GPUS = {"sm_80": ("NVIDIA A100-SXM4-80GB", 80), "sm_90": ("NVIDIA H100 80GB HBM3", 90)}
SHARED_BYTES = {80: 163 * 1024, 90: 227 * 1024}  # the most one block may ask for (opt-in)
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


HEADS = 4  # query and key/value heads of the lowered call (batch 1)


def kernels(device_kind: str, head_dim: int, dtype: Any, length: int) -> list[dict[str, Any]]:
  """Each Triton kernel of a causal flex call's forward and backward, lowered for
  ``device_kind``: its name, Triton IR (text), warps, stages and tiles (``block_q`` from the
  table's row for the kernel's pass)."""
  jax.clear_caches()  # jattn's jitted core is cached by the call's settings, not the GPU's
  rng = np.random.default_rng(0)
  shape = (1, length, HEADS, head_dim)
  q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in "qkv")
  ids = jnp.asarray(np.repeat(np.arange(4), length // 4)[None], jnp.int32)

  def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    out = jattn.dot_product_attention(
      q, k, v, is_causal=True, segment_ids=ids, implementation="flex"
    )
    return jnp.sum(out.astype(jnp.float32))

  with jattn.testing.lowering_for("gpu", device_kind), warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Pallas' Triton lowering warns of deprecation
    lowered = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, k, v).lower(lowering_platforms=("cuda",))
  found = [_triton_kernel(op) for op in _triton_calls(lowered.compiler_ir("stablehlo").operation)]
  # Each pass's own tiles (forward, dQ, dK/dV: the kernels' order in the program), from the
  # table the lowering read for this GPU.
  passes = flex.tiles_for(head_dim, jnp.dtype(dtype).itemsize, device_kind)
  for x, row in zip(found, passes):
    x.update(block_q=row.block_q, block_kv=row.block_kv)
  return found


def _triton_calls(op: Any) -> list[Any]:
  """The program's Triton custom calls, in order."""
  found = []
  for region in op.regions:
    for block in region.blocks:
      for inner in block.operations:
        target = (
          inner.attributes["call_target_name"] if "call_target_name" in inner.attributes else ""
        )
        if inner.name == "stablehlo.custom_call" and "triton" in str(target):
          found.append(inner)
        found += _triton_calls(inner.operation)
  return found


def _triton_kernel(op: Any) -> dict[str, Any]:
  """A Triton custom call's kernel: the IR it carries (MLIR bytecode) printed as text."""
  from jaxlib.mlir import ir
  from jaxlib.triton import dialect as triton_dialect

  config = op.attributes["mhlo.backend_config"]
  context = jax_mlir.make_ir_context()
  triton_dialect.register_dialect(context)
  context.load_all_available_dialects()
  module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes, context=context)
  return dict(
    kernel=ir.StringAttr(config["name"]).value,
    ttir=module.operation.get_asm(enable_debug_info=False),
    num_warps=ir.IntegerAttr(config["num_warps"]).value,
    num_stages=ir.IntegerAttr(config["num_stages"]).value,
    programs=math.prod(ir.IntegerAttr(config[f"grid_{a}"]).value for a in "xyz"),
  )


def compile_for(kernel: dict[str, Any], capability: int) -> dict[str, Any]:
  """``kernel`` compiled for compute capability ``capability`` by triton, then ptxas:
  registers per thread, spill bytes (stores, loads), shared memory bytes."""
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.backends.nvidia.compiler import get_ptxas

  with tempfile.TemporaryDirectory() as tmp:
    src = Path(tmp) / f"{kernel['kernel']}.ttir"
    src.write_text(kernel["ttir"])
    options = dict(num_warps=kernel["num_warps"], num_stages=kernel["num_stages"])
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # triton's own notices about its defaults
      compiled = triton.compile(str(src), target=GPUTarget("cuda", capability, 32), options=options)
    ptx = Path(tmp) / "kernel.ptx"
    ptx.write_text(compiled.asm["ptx"])
    cubin = Path(tmp) / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    cuobjdump = Path(get_ptxas(capability).path).with_name("cuobjdump")
    sass = subprocess.run(
      [str(cuobjdump), "-sass", str(cubin)], check=True, capture_output=True, text=True
    ).stdout
    arch = f"sm_{capability}" + ("a" if capability >= 90 else "")
    log = subprocess.run(
      [
        get_ptxas(capability).path,
        "-v",
        f"--gpu-name={arch}",
        str(ptx),
        "-o",
        str(Path(tmp) / "k"),
      ],
      check=True,
      capture_output=True,
      text=True,
    ).stderr
  registers = re.search(r"Used (\d+) registers", log)
  spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
  assert registers and spills, log
  return dict(
    registers=int(registers.group(1)),
    spill_stores=int(spills.group(1)),
    spill_loads=int(spills.group(2)),
    shared_bytes=int(compiled.metadata.shared),
    **sass_counts(sass),
  )


_MATMUL = ("HGMMA", "HMMA")


def sass_counts(sass: str) -> dict[str, int]:
  """From ``cuobjdump -sass`` text: the kernel's ``HGMMA`` and ``HMMA`` instructions, and in
  its first loop (a backward branch) that holds any, the matrix and other instructions."""
  code = []  # (address, opcode)
  for line in sass.splitlines():
    found = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
    if found:
      text = re.sub(r"^@!?U?P\w+\s+", "", found.group(2).strip())  # the predicate
      code.append((int(found.group(1), 16), text))
  op = lambda text: text.split()[0] if text else ""
  counts = dict(
    wgmma=sum(op(t).startswith("HGMMA") for _, t in code),
    mma_sync=sum(op(t).startswith("HMMA") for _, t in code),
    loop_matmul=0,
    loop_other=0,
  )
  for address, text in code:
    branch = re.search(r"\bBRA\s+(0x[0-9a-f]+)", text)
    if branch and int(branch.group(1), 16) < address:  # a loop: [target, address]
      body = [op(t) for a, t in code if int(branch.group(1), 16) <= a <= address]
      matmul = sum(o.startswith(_MATMUL) for o in body)
      if matmul:
        counts.update(loop_matmul=matmul, loop_other=len(body) - matmul)
        break
  return counts


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  p = _cli.parser(
    "check_flex_compile", __doc__, config=False, quick="sm_90, H=64, bf16 only", out_dir=None
  )
  p.add_argument("--generations", nargs="+", default=list(GPUS), choices=list(GPUS))
  p.add_argument("--head-dims", dest="head_dims", type=int, nargs="+", default=[64, 128, 256])
  p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
  p.add_argument("--length", type=int, default=1024)
  p.add_argument("--json", help="also write the rows here")
  args = p.parse_args(argv)
  try:
    import triton
  except ImportError:
    p.error('needs the standalone triton package: pip install -e ".[gpu]"')
  if args.quick:
    args.generations, args.head_dims, args.dtypes, args.length = ["sm_90"], [64], ["bfloat16"], 256
  print(
    f"jax {jax.__version__}, triton {triton.__version__}; causal + segment ids, T={args.length}"
  )
  cols = ["generation", "dtype", "H", "kernel", "block_q x block_kv", "warps", "stages"]
  cols += ["registers", "spill stores", "spill loads", "shared KiB", "wgmma", "mma.sync"]
  cols += ["loop other / column", ""]
  print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
  rows, bad = [], 0
  for gen, dtype, H in itertools.product(args.generations, args.dtypes, args.head_dims):
    device_kind, capability = GPUS[gen]
    for kernel in kernels(device_kind, H, DTYPES[dtype], args.length):
      row = dict(generation=gen, device_kind=device_kind, dtype=dtype, H=H)
      row |= dict(kernel=kernel["kernel"], block_q=kernel["block_q"], block_kv=kernel["block_kv"])
      row |= dict(num_warps=kernel["num_warps"], num_stages=kernel["num_stages"])
      try:
        row |= compile_for(kernel, capability)
        # The loop's step: key columns (forward, dQ) or query rows (dK/dV).
        step = row["block_q"] if row["kernel"] == "jattn_flex_dkv" else row["block_kv"]
        row["loop_other_per_column"] = row["loop_other"] / step
        problems = [
          "spills" if row["spill_stores"] or row["spill_loads"] else "",
          "shared memory" if row["shared_bytes"] > SHARED_BYTES[capability] else "",
        ]
        row["problem"] = ", ".join(x for x in problems if x)
      except Exception as e:  # noqa: BLE001 -- reported, and counted as a failure
        row["problem"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
      bad += bool(row["problem"])
      rows.append(row)
      cells = [gen, dtype, H, row["kernel"], f"{row['block_q']} x {row['block_kv']}"]
      cells += [row["num_warps"], row["num_stages"]]
      cells += [row.get(key, "—") for key in ("registers", "spill_stores", "spill_loads")]
      shared = row.get("shared_bytes")
      cells += [fmt(shared / 1024, ".0f") if shared is not None else "—"]
      cells += [row.get("wgmma", "—"), row.get("mma_sync", "—")]
      cells += [fmt(row.get("loop_other_per_column"), ".1f"), row["problem"]]
      print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)
  print(f"\n{len(rows) - bad} of {len(rows)} kernels compile without spills within shared memory")
  if args.json:
    _cli.write_record(args.json, rows)
  if bad:
    raise SystemExit(1)
  return rows


if __name__ == "__main__":
  main()
