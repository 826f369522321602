"""A small immutable pytree node for score functions (masks are dataclasses, see jattn.masks).

A node is a static ``rule`` (module-level functions that say what the node
computes), static ``params`` (hashable settings such as a window size) and
dynamic ``children`` (arrays, or other nodes). As a pytree the children are
leaves and ``(rule, params)`` is the treedef, so a node built anew with equal
settings hits jit's cache, and its arrays are traced arguments rather than
constants baked into a compiled program.
"""

from __future__ import annotations

from typing import Any


class Node:
  __slots__ = ("rule", "params", "children")
  rule: Any
  params: tuple
  children: tuple

  def __init__(self, rule: Any, params: tuple = (), children: tuple = ()):
    object.__setattr__(self, "rule", rule)
    object.__setattr__(self, "params", tuple(params))
    object.__setattr__(self, "children", tuple(children))

  def __setattr__(self, name, value):
    raise AttributeError(f"{type(self).__name__} is immutable")

  def tree_flatten(self):
    return self.children, (self.rule, self.params)

  @classmethod
  def tree_unflatten(cls, aux, children):
    rule, params = aux
    node = object.__new__(cls)
    Node.__init__(node, rule, params, children)
    return node

  def __repr__(self) -> str:
    return self.rule.describe(self.params, self.children)
