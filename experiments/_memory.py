"""Process memory readings shared by the experiments (no JAX import here)."""

from __future__ import annotations

import resource
import sys


def peak_rss_mb() -> float:
  """This process's peak resident memory in MiB (2**20 bytes): VmHWM on Linux (ru_maxrss
  would include the parent's peak, which Linux carries across fork and exec), ru_maxrss
  elsewhere."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (
    1024 if sys.platform != "darwin" else 2**20
  )
