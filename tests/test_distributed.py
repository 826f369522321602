"""jattn on many hosts: two processes on localhost, 4 CPU devices each, one 8-device mesh.

tests/distributed_worker.py is started twice; the processes meet through
``jax.distributed.initialize`` and run ring attention and the all-gather strategy over
all 8 devices, the Ulysses strategy with the sequence across the processes, and a
batch-sharded default ``dot_product_attention``, each with a bias and ALiBi, values and
gradients, and each writes what it gathered. Here those results are compared with the float64
formula (values) and with autodiff of it through jnp (gradients), on this one
process.
"""

import os
import pathlib
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from distributed_worker import LOCAL_DEVICES, SLOPES, inputs
from reference import assert_close, attention_jnp, attention_np, causal_np

# Exhaustive: two more processes start JAX and compile the ring and the sharded call again (13
# CPU-seconds); the default run checks both on the 8 simulated devices of one process
# (test_parallel.py, test_sharding_explicit.py).
pytestmark = [
  pytest.mark.skipif(
    sys.platform == "win32", reason="jaxlib has no CPU collectives (gloo) on Windows"
  ),
  pytest.mark.exhaustive,
]

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "distributed_worker.py"
PROCESSES = 2
TIMEOUT_S = 240


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _tail(path: pathlib.Path, lines: int = 30) -> str:
  """The last lines of a log, without gloo's connection notices."""
  text = [line for line in path.read_text().splitlines() if not line.startswith("[Gloo]")]
  return "\n".join(text[-lines:])


def _start_workers(out: pathlib.Path) -> list[dict]:
  """Run the worker processes to the end (or kill them all at the deadline); their results."""
  port = _free_port()
  env = dict(os.environ)
  # XLA_FLAGS passes through: the workers compile as this process does (conftest.py's flags),
  # each replacing the device count with its own LOCAL_DEVICES.
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
  procs, logs = [], []
  for i in range(PROCESSES):
    log = out / f"process-{i}.log"
    command = [sys.executable, str(WORKER), "--process-id", str(i)]
    command += ["--num-processes", str(PROCESSES), "--port", str(port), "--out", str(out)]
    with open(log, "w") as output:
      procs.append(
        subprocess.Popen(command, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)
      )
    logs.append(log)
  deadline = time.monotonic() + TIMEOUT_S
  try:
    # One failed process leaves the others waiting for it: stop at the first failure.
    while time.monotonic() < deadline:
      codes = [p.poll() for p in procs]
      if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  codes = [p.returncode for p in procs]
  if codes != [0] * PROCESSES:
    timed_out = f" (timed out after {TIMEOUT_S} s)" if time.monotonic() >= deadline else ""
    report = "\n".join(f"--- process {i} output ---\n{_tail(log)}" for i, log in enumerate(logs))
    pytest.fail(f"workers exited with {codes}{timed_out}\n{report}")
  return [dict(np.load(out / f"process-{i}.npz")) for i in range(PROCESSES)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  return _start_workers(tmp_path_factory.mktemp("distributed"))


@pytest.fixture(scope="module")
def expected():
  """Values, loss and gradients (bias's too) of causal attention with a bias and ALiBi, from
  the float64 formula."""
  data = inputs()
  q, k, v, bias, w = (data[n].astype(np.float64) for n in ("q", "k", "v", "bias", "w"))
  allowed = causal_np(q.shape[1], k.shape[1])
  alibi = lambda s, b, h, q, kv: s + SLOPES[h] * (kv - q)  # scores.alibi's formula
  alibi_jnp = lambda s, b, h, q, kv: s + jnp.asarray(SLOPES)[h] * (kv - q)
  out, _ = attention_np(q, k, v, bias=bias, allowed=allowed, score=alibi)

  def loss(q, k, v, bias):
    return jnp.sum(attention_jnp(q, k, v, bias, allowed=allowed, score=alibi_jnp)[0] * w)

  with jax.enable_x64(True):
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    grads = [np.asarray(g) for g in grads]
  return {"loss": np.sum(out * w), "out": out, **dict(zip(("dq", "dk", "dv", "dbias"), grads))}


def test_every_process_saw_the_global_mesh(results):
  for i, got in enumerate(results):
    assert got["process_count"] == PROCESSES, i
    assert got["device_count"] == PROCESSES * LOCAL_DEVICES, i
    assert got["local_device_count"] == LOCAL_DEVICES, i
    assert got["local_shards"] == LOCAL_DEVICES, i  # each process held only its own shards


def test_every_process_gathered_the_same_results(results):
  first, *others = results
  for i, got in enumerate(others, start=1):
    assert got.keys() == first.keys()
    for name in first:
      np.testing.assert_array_equal(got[name], first[name], err_msg=f"process {i}: {name}")


@pytest.mark.parametrize("program", ["ring", "all_gather", "ulysses", "batch"])
def test_values_and_gradients_match_one_process(results, expected, program):
  got = results[0]
  for name in ("out", "dq", "dk", "dv", "dbias"):
    assert got[f"{program}_{name}"].dtype == np.float32
    assert_close(got[f"{program}_{name}"], expected[name], np.float32, err_msg=name)
  assert_close(got[f"{program}_loss"], expected["loss"], np.float32)
