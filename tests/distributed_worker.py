"""One process of tests/test_distributed.py: jattn over a mesh that spans two processes.

    python tests/distributed_worker.py --process-id I --num-processes 2 --port P --out DIR

Each process simulates 4 CPU devices and joins the others through
``jax.distributed.initialize`` (the coordinator at 127.0.0.1:P, CPU collectives
over gloo), so ``jax.devices()`` lists 4 × num_processes devices. Every process
builds the same inputs from the same seeds, keeps only its own shards of them
and runs the same jitted programs:

- ring attention over one ring axis of every device (causal, GQA, zig-zag), the
  key/value shards passing from process to process, inputs placed with
  ``jax.make_array_from_callback``;
- ``parallel.context_parallel_attention``'s all-gather strategy over the same ring
  axis, and its Ulysses strategy with the sequence split across the processes
  and the batch within each;
- the default ``jattn.dot_product_attention`` on inputs sharded by batch and
  heads over ("data", "model") = (2 × num_processes, 2), each process passing
  only its rows of the batch (``jax.make_array_from_process_local_data``);

each with a bias (one per head, its gradient taken too) and ALiBi: values and
gradients of a weighted sum of the output. The results, global
arrays, are gathered to every process with ``process_allgather`` and each
process writes them (in natural sequence order) to DIR/process-I.npz, with the
process and device counts it saw.
"""

from __future__ import annotations

import argparse
import os
import pathlib

import numpy as np

LOCAL_DEVICES = 4
B, T, N, K, H = 8, 32, 4, 2, 8  # zig-zag over 8 devices: chunks of 2 rows
LAYOUT = "zigzag"
SLOPES = np.linspace(0.1, 0.4, N)  # ALiBi's, in every program


def inputs() -> dict[str, np.ndarray]:
  """The global inputs (float32, natural order: q, k, v, a bias broadcast over the batch) and
  the output cotangent w, from fixed seeds."""
  rng = np.random.default_rng(0)
  shapes = {
    "q": (B, T, N, H),
    "k": (B, T, K, H),
    "v": (B, T, K, H),
    "bias": (1, N, T, T),
    "w": (B, T, N, H),
  }
  return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def run(process_id: int, num_processes: int, port: int, out_dir: pathlib.Path) -> None:
  # JAX reads these when it starts its backends: set them before importing it.
  os.environ["JAX_PLATFORMS"] = "cpu"
  # Other flags given (test_distributed.py passes conftest.py's) are kept.
  flags = os.environ.get("XLA_FLAGS", "").split()
  flags = [f for f in flags if "host_platform_device_count" not in f]
  flags.append(f"--xla_force_host_platform_device_count={LOCAL_DEVICES}")
  os.environ["XLA_FLAGS"] = " ".join(flags)
  import jax
  import jax.numpy as jnp
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jattn
  from jattn import parallel, scores

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_numpy_rank_promotion", "raise")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
    coordinator_bind_address=f"127.0.0.1:{port}",
    initialization_timeout=120,
  )
  devices = np.array(jax.devices())  # every process's devices, the same order everywhere
  data = inputs()

  def place(x, mesh, spec):
    """The global array ``x`` as a jax.Array of which this process holds only its shards."""
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  def gather(tree):
    """Global arrays (spanning every process) as NumPy arrays in every process."""
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))

  alibi = scores.alibi(SLOPES)
  names = ("out", "dq", "dk", "dv", "dbias")

  def value_and_grads(attend):
    def loss(q, k, v, bias, w):
      out = attend(q, k, v, bias)
      return jnp.sum(out * w), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))

  results = {}

  # a. Ring attention: the sequence over a ring of every device in every process.
  ring = Mesh(devices, ("sp",))
  size = ring.shape["sp"]
  permute = lambda x, axis=1: parallel.permute(x, LAYOUT, size, axis=axis)
  unpermute = lambda x, axis=1: parallel.unpermute(x, LAYOUT, size, axis=axis)
  args = [place(permute(data[n]), ring, P(None, "sp")) for n in "qkv"]
  args.append(place(permute(permute(data["bias"], 2), 3), ring, P(None, None, "sp")))
  args.append(place(permute(data["w"]), ring, P(None, "sp")))

  def natural(prefix, out, grads):
    """The ring's and all-gather's results, given in the layout's order, in natural order."""
    for name, x in zip(names, (out, *grads)):
      results[f"{prefix}_{name}"] = (
        unpermute(unpermute(x, 2), 3) if name == "dbias" else (unpermute(x))
      )

  step = value_and_grads(
    lambda q, k, v, bias: parallel.ring_attention(
      q, k, v, mesh=ring, axis_name="sp", bias=bias, score_fn=alibi, is_causal=True, layout=LAYOUT
    )
  )
  (loss, out), grads = gather(step(*args))
  results["ring_loss"] = loss
  natural("ring", out, grads)

  # b. context_parallel_attention's all-gather strategy over the ring's mesh, and its Ulysses
  # strategy over a (2, 4) mesh: the sequence split across the two processes ("sp"), the
  # batch within each ("data").
  step = value_and_grads(
    lambda q, k, v, bias: parallel.context_parallel_attention(
      q,
      k,
      v,
      bias,
      mesh=ring,
      axis_name="sp",
      strategy="all_gather",
      score_fn=alibi,
      is_causal=True,
      layout=LAYOUT,
    )
  )
  (loss, out), grads = gather(step(*args))
  results["all_gather_loss"] = loss
  natural("all_gather", out, grads)
  cross = Mesh(devices.reshape(2, -1), ("sp", "data"))  # a row of devices per process
  ulysses_args = [place(data[n], cross, P("data", "sp")) for n in "qkv"]
  ulysses_args += [place(data["bias"], cross, P()), place(data["w"], cross, P("data", "sp"))]
  step = value_and_grads(
    lambda q, k, v, bias: parallel.context_parallel_attention(
      q,
      k,
      v,
      bias,
      mesh=cross,
      axis_name="sp",
      batch_axis="data",
      strategy="ulysses",
      score_fn=alibi,
      is_causal=True,
    )
  )
  (loss, out), grads = gather(step(*ulysses_args))
  results["ulysses_loss"] = loss
  for name, x in zip(names, (out, *grads)):
    results[f"ulysses_{name}"] = x

  # c. The default implementation on batch- and head-sharded inputs, no ring. Each process
  # passes only its rows of the batch (its devices are a block of rows of the mesh).
  grid = Mesh(devices.reshape(-1, 2), ("data", "model"))
  batch = NamedSharding(grid, P("data", None, "model", None))
  per_process = B // jax.process_count()
  rows = slice(jax.process_index() * per_process, (jax.process_index() + 1) * per_process)
  args = [jax.make_array_from_process_local_data(batch, data[n][rows]) for n in "qkv"]
  args.append(place(data["bias"], grid, P(None, "model")))
  args.append(jax.make_array_from_process_local_data(batch, data["w"][rows]))
  step = value_and_grads(
    lambda q, k, v, bias: jattn.dot_product_attention(q, k, v, bias, score_fn=alibi, is_causal=True)
  )
  (loss, out), grads = gather(step(*args))
  results["batch_loss"] = loss
  for name, x in zip(names, (out, *grads)):
    results[f"batch_{name}"] = x

  # What the process saw: the checks that it really ran across processes.
  results["process_count"] = np.int32(jax.process_count())
  results["device_count"] = np.int32(jax.device_count())
  results["local_device_count"] = np.int32(jax.local_device_count())
  results["local_shards"] = np.int32(len(args[0].addressable_shards))
  np.savez(out_dir / f"process-{process_id}.npz", **results)
  jax.distributed.shutdown()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--out", type=pathlib.Path, required=True)
  args = parser.parse_args()
  run(args.process_id, args.num_processes, args.port, args.out)


if __name__ == "__main__":
  main()
