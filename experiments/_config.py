"""Benchmark configs: YAML files of dataclass fields, shared by the bench scripts."""

from __future__ import annotations

import dataclasses

import yaml


def config_fields(
  config_cls, path: str | None, *, quick: dict | None = None, flags: dict | None = None
) -> dict:
  """Keyword arguments for ``config_cls``: the YAML file at ``path`` (if any), then the
  ``quick`` overrides, then the command-line ``flags`` that were given (not None).

  A key the dataclass lacks is an error that names it, so a typo in a config
  never silently runs the defaults.
  """
  fields: dict = {}
  if path:
    with open(path) as f:
      fields = yaml.safe_load(f) or {}
    unknown = set(fields) - {f.name for f in dataclasses.fields(config_cls)}
    if unknown:
      raise SystemExit(
        f"unknown keys in {path}: {sorted(unknown)}; valid keys are "
        f"{[f.name for f in dataclasses.fields(config_cls)]}"
      )
  fields.update(quick or {})
  fields.update({k: v for k, v in (flags or {}).items() if v is not None})
  return fields
