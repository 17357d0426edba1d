"""One `lax.cond` over a whole optimizer step, compiled as several small ones.

XLA's `copy-insertion` and `layout-assignment` passes take time that grows
faster than linearly with the number of values a conditional carries, while
a step is mostly independent per leaf (docs/performance.md, "How cost
grows", and the speed-layer table, rows `split`), so `cond` splits it:

1. Both branches are traced once, to jaxprs (calls in them with several
   outputs or much work are inlined).
2. Scalars computed from the operands by cheap elementwise work and
   reductions, and drawn from or used by several groups of outputs (a step
   count, a learning-rate schedule, a global gradient norm), are
   *hoisted*: computed once, before the conditionals, and passed to them.
   A skipped step computes them too and throws them away. A scalar of one
   group's own (LAMB's trust ratio of one leaf) stays in its conditional.
3. What is left falls apart into groups of outputs that share no work (one
   leaf's parameter and moments, say; an optimizer that couples leaves,
   such as `optax.flatten`, gives one big group). Groups are packed into
   conditionals of at most `_OUTPUTS` outputs, and each conditional computes
   only what its outputs need. Array values never cross from one
   conditional to another, so no step materializes anything it did not
   before.

4. Each conditional is built from the traced equations (re-pointed at
   fresh variables) and bound as one `cond` primitive, not traced again
   by `lax.cond` (trace time, at thousands of leaves).

The result is the single `lax.cond`'s, output for output: each conditional
takes the same predicate and runs the same operations on the same values.
A step with effects (`jax.debug.print`, callbacks), whose order this would
change, runs as one `lax.cond`, and so does a step of at most `_OUTPUTS`
outputs, or one traced under `jax.debug_nans` (a skipped step's hoisted
scalars are computed too, from its gradients: a norm of inf, or of the
zeros a batched step feeds, divided by, makes a NaN).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from lossscale import _jax_internals

# Outputs per conditional: small enough that XLA's passes stay linear,
# large enough that a step of a few leaves is one conditional; it costs no
# step time (docs/performance.md, the speed-layer table, rows `split`).
_OUTPUTS = 96

# Primitives cheap enough to recompute: elementwise arithmetic, reductions
# and reshapes, which XLA fuses into the kernels that read them.
_CHEAP = frozenset(
  {
    "abs",
    "acos",
    "acosh",
    "add",
    "and",
    "asin",
    "asinh",
    "atan",
    "atan2",
    "atanh",
    "broadcast_in_dim",
    "cbrt",
    "ceil",
    "clamp",
    "convert_element_type",
    "copy",
    "copy_p",
    "cos",
    "cosh",
    "digamma",
    "div",
    "eq",
    "erf",
    "erf_inv",
    "erfc",
    "exp",
    "exp2",
    "expand_dims",
    "expm1",
    "floor",
    "ge",
    "gt",
    "imag",
    "integer_pow",
    "iota",
    "is_finite",
    "le",
    "lgamma",
    "log",
    "log1p",
    "logistic",
    "lt",
    "max",
    "min",
    "mul",
    "ne",
    "neg",
    "nextafter",
    "not",
    "or",
    "optimization_barrier",
    "pow",
    "real",
    "reduce_and",
    "reduce_max",
    "reduce_min",
    "reduce_or",
    "reduce_precision",
    "reduce_prod",
    "reduce_sum",
    "rem",
    "reshape",
    "round",
    "rsqrt",
    "select_n",
    "sign",
    "sin",
    "sinh",
    "sqrt",
    "square",
    "squeeze",
    "stop_gradient",
    "sub",
    "tan",
    "tanh",
    "xor",
  }
)
_CALLS = frozenset({"pjit", "jit"})


class _Graph:
  """A branch's jaxpr, calls inlined, as numbered nodes and values.

  Values are ints. `const[v]` holds the value of a value that no node
  computes (a closed-over array, a literal); `producer[v]` the node that
  computes it. Nodes are in an order in which they can be evaluated.
  """

  def __init__(self, closed: Any):
    self.nodes: list[tuple[Any, list[int], list[int]]] = []  # (eqn, ins, outs)
    self.const: dict[int, Any] = {}
    self.producer: dict[int, int] = {}
    self.aval: dict[int, Any] = {}
    self.literal: dict[int, Any] = {}  # the values that are jaxpr Literals
    self.outs = self._add(closed, [])

  def _value(self, aval: Any = None) -> int:
    v = len(self.aval)
    self.aval[v] = aval
    return v

  def _add(self, closed: Any, args: list[int]) -> list[int]:
    jaxpr = _jax_internals.open_jaxpr(closed)
    env: dict[Any, int] = {}
    for var, c in zip(jaxpr.constvars, closed.consts, strict=True):
      env[var] = v = self._value(var.aval)
      self.const[v] = c
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(var: Any) -> int:
      if _jax_internals.is_literal(var):
        v = self._value(var.aval)
        self.const[v] = var.val
        self.literal[v] = var
        return v
      return env[var]

    for eqn in jaxpr.eqns:
      ins = [read(x) for x in eqn.invars]
      if eqn.primitive.name in _CALLS and _is_large(eqn):
        outs = self._add(eqn.params["jaxpr"], ins)
        env.update(zip(eqn.outvars, outs, strict=True))
        continue
      outs = [self._value(x.aval) for x in eqn.outvars]
      for x, v in zip(eqn.outvars, outs, strict=True):
        env[x] = v
        self.producer[v] = len(self.nodes)
      self.nodes.append((eqn, ins, outs))
    return [read(x) for x in jaxpr.outvars]

  def is_scalar(self, v: int) -> bool:
    return getattr(self.aval[v], "shape", None) == ()

  def slice(self, outs: list[int], stop: set[int]) -> list[int]:
    """The nodes `outs` need, in evaluation order, up to values in `stop`."""
    seen: set[int] = set()
    todo = [self.producer[v] for v in outs if v in self.producer and v not in stop]
    while todo:
      n = todo.pop()
      if n in seen:
        continue
      seen.add(n)
      for v in self.nodes[n][1]:
        if v in self.producer and v not in stop:
          todo.append(self.producer[v])
    return sorted(seen)

  def evaluate(self, nodes: list[int], env: dict[int, Any]) -> None:
    """Binds `nodes` in the current trace, reading and writing `env`."""
    for n in nodes:
      eqn, ins, outs = self.nodes[n]
      args = [env[v] if v in env else self.const[v] for v in ins]
      env.update(zip(outs, _jax_internals.bind_eqn(eqn, args), strict=True))


class _Operands:
  """The operands of one conditional, shared by both branches: each value
  (a closed-over tracer or array, a hoisted scalar) once."""

  def __init__(self) -> None:
    self.values: list[Any] = []
    self.avals: list[Any] = []
    self._index: dict[int, int] = {}

  def index(self, value: Any, aval: Any) -> int:
    i = self._index.get(id(value))
    if i is None:
      i = self._index[id(value)] = len(self.values)
      self.values.append(value)
      self.avals.append(aval)
    return i


def _branch(
  graph: _Graph, nodes: list[int], outs: list[int], env: dict, operands: _Operands
) -> tuple[dict[int, Any], list[Any], list[Any]]:
  """The equations of `nodes` as a branch of a conditional on `operands`:
  `(its variable for each operand it reads, its equations, its outputs)`.

  The equations are the graph's own, re-pointed at fresh variables (an
  inlined call's equations read its caller's values), never traced again.
  """
  var_of: dict[int, Any] = {}
  by_operand: dict[int, Any] = {}

  def read(v: int) -> Any:
    x = var_of.get(v)
    if x is None:
      x = graph.literal.get(v)
      if x is not None:
        return x
      value = env[v] if v in env else graph.const[v]
      i = operands.index(value, graph.aval[v])
      x = by_operand.get(i)
      if x is None:
        x = by_operand[i] = _jax_internals.new_var(operands.avals[i])
      var_of[v] = x
    return x

  eqns = []
  for n in nodes:
    eqn, ins, outs_n = graph.nodes[n]
    invars = [read(v) for v in ins]
    outvars = []
    for v in outs_n:
      var_of[v] = x = _jax_internals.new_var(graph.aval[v])
      outvars.append(x)
    eqns.append(_jax_internals.repoint_eqn(eqn, invars, outvars))
  return by_operand, eqns, [read(v) for v in outs]


def _types(atoms: list[Any]) -> list[tuple]:
  return [(a.aval.shape, a.aval.dtype) for a in atoms]


_Branch = tuple[_Graph, list[int], list[int], dict[int, Any]]


def _built_cond(
  pred: Any, true: _Branch, false: _Branch, debug_info: Any
) -> list[Any] | None:
  """A conditional on jaxprs built from `_Graph` equations: `true` and
  `false` are `(graph, nodes, outs, env)`. None when the branches' output
  types differ (then `lax.cond` must reconcile them), or when this JAX
  builds or binds jaxprs in a way this does not know (the same step, traced
  again by `lax.cond`: slower, never different; the test suite checks that
  the supported releases take this path)."""
  try:
    return _bind_built_cond(pred, true, false, debug_info)
  except Exception:
    return None


def _bind_built_cond(
  pred: Any, true: _Branch, false: _Branch, debug_info: Any
) -> list[Any] | None:
  operands = _Operands()
  t_vars, t_eqns, t_outs = _branch(*true, operands)
  f_vars, f_eqns, f_outs = _branch(*false, operands)
  if _types(t_outs) != _types(f_outs):
    return None

  def closed(by_operand: dict[int, Any], eqns: list[Any], outvars: list[Any]) -> Any:
    invars = [
      by_operand[i] if i in by_operand else _jax_internals.new_var(aval)
      for i, aval in enumerate(operands.avals)
    ]
    return _jax_internals.closed_jaxpr(invars, outvars, eqns, debug_info)

  index = jax.lax.convert_element_type(pred, jax.numpy.int32)
  branches = (closed(f_vars, f_eqns, f_outs), closed(t_vars, t_eqns, t_outs))
  return _jax_internals.bind_cond(index, operands.values, branches)


def _is_large(eqn: Any) -> bool:
  """A call worth inlining: one with several outputs or much work."""
  return len(eqn.outvars) > 1 or len(eqn.params["jaxpr"].eqns) > 16


def _is_cheap(eqn: Any) -> bool:
  name = eqn.primitive.name
  if name in _CALLS:
    return all(_is_cheap(e) for e in eqn.params["jaxpr"].eqns)
  return name in _CHEAP


def _union_find(
  graph: _Graph, boundary: set[int], skip: set[int]
) -> Callable[[int], int]:
  """`find(node)`: one root per set of nodes that share work, linking each
  node (not in `skip`) to the nodes computing its inputs, but not through
  values in `boundary`."""
  parent = list(range(len(graph.nodes)))

  def find(n: int) -> int:
    while parent[n] != n:
      parent[n] = parent[parent[n]]
      n = parent[n]
    return n

  for n, (_, ins, _) in enumerate(graph.nodes):
    if n in skip:
      continue
    for v in ins:
      if v in graph.producer and v not in boundary:
        parent[find(n)] = find(graph.producer[v])
  return find


def _hoisted(graph: _Graph) -> tuple[list[int], set[int]]:
  """The nodes to compute before the conditionals, in evaluation order, and
  the scalars they pass to them.

  Candidates are nodes computing scalars from the operands by cheap work
  only. Of those, the ones that draw on the work of several groups of
  outputs (a global norm) or are used by several (a step count, a
  schedule) are hoisted, with the work they need; a scalar of one group's
  own (LAMB's trust ratio of one leaf) stays in that group's conditional,
  so a skipped step does not compute it.
  """
  cheap_from_operands = [False] * len(graph.nodes)
  candidates: list[int] = []
  for n, (eqn, ins, outs) in enumerate(graph.nodes):
    cheap_from_operands[n] = _is_cheap(eqn) and all(
      cheap_from_operands[graph.producer[v]] for v in ins if v in graph.producer
    )
    if cheap_from_operands[n] and all(graph.is_scalar(v) for v in outs):
      candidates.append(n)
  is_candidate = set(candidates)
  scalars = {v for n in candidates for v in graph.nodes[n][2]}
  find = _union_find(graph, scalars, is_candidate)
  # Groups are the sets of nodes that compute outputs; work that only
  # candidates read (a norm of the parameters) belongs to no group.
  groups = {
    find(graph.producer[v])
    for v in graph.outs
    if graph.producer.get(v) is not None and graph.producer[v] not in is_candidate
  }

  def group_of(n: int) -> set[int]:
    root = find(n)
    return {root} if root in groups else set()

  # Which groups each candidate draws on, and which use it (two are enough).
  draws_on: dict[int, set[int]] = {}
  for n in candidates:  # in evaluation order
    drawn: set[int] = set()
    for v in graph.nodes[n][1]:
      p = graph.producer.get(v)
      if p is not None and len(drawn) < 2:
        drawn |= draws_on[p] if p in is_candidate else group_of(p)
    draws_on[n] = drawn
  used_by: dict[int, set[int]] = {n: set() for n in candidates}
  for i, v in enumerate(graph.outs):
    if graph.producer.get(v) in is_candidate:
      used_by[graph.producer[v]].add(-1 - i)  # an output of its own
  for m in reversed(range(len(graph.nodes))):
    users = used_by[m] if m in is_candidate else group_of(m)
    for v in graph.nodes[m][1]:
      p = graph.producer.get(v)
      if p in is_candidate and len(used_by[p]) < 2:
        used_by[p] |= users
  hoisted = [n for n in candidates if len(draws_on[n]) > 1 or len(used_by[n]) > 1]
  boundary = {v for n in hoisted for v in graph.nodes[n][2]}
  return graph.slice(sorted(boundary), set()), boundary


def _groups(graph: _Graph, boundary: set[int], hoisted: set[int]) -> list[int]:
  """For each output, a label shared by the outputs whose work overlaps."""
  find = _union_find(graph, boundary, hoisted)
  labels = []
  for i, v in enumerate(graph.outs):
    if v in graph.producer and v not in boundary:
      labels.append(find(graph.producer[v]))
    else:  # an operand or a hoisted scalar, passed through: no work
      labels.append(-1 - i)
  return labels


def _chunks(labels: list[int]) -> list[list[int]]:
  """Output indices, grouped by label, packed into chunks of `_OUTPUTS`."""
  by_label: dict[int, list[int]] = {}
  for i, label in enumerate(labels):
    by_label.setdefault(label, []).append(i)
  chunks: list[list[int]] = []
  for group in by_label.values():
    if chunks and len(chunks[-1]) + len(group) <= _OUTPUTS:
      chunks[-1].extend(group)
    else:
      chunks.append(list(group))
  return chunks


def cond(
  pred: Any,
  true_fn: Callable[[], Any],
  false_fn: Callable[[], Any],
  one_cond: Callable[[Any, Callable[[], Any], Callable[[], Any]], Any] | None = None,
) -> Any:
  """`one_cond(pred, true_fn, false_fn)`, as several conditionals when the
  branches have many outputs (see the module docstring).

  `one_cond` is a variant of `jax.lax.cond` with its signature, called once
  per conditional; None is `jax.lax.cond`, whose conditionals are then
  built from the traced equations directly rather than traced again. The
  branches take no arguments (they close over their operands).
  """
  build = one_cond is None
  one_cond = one_cond or jax.lax.cond
  true_closed, out_shape = jax.make_jaxpr(true_fn, return_shape=True)()
  false_closed = jax.make_jaxpr(false_fn)()
  leaves, tree = jax.tree_util.tree_flatten(out_shape)
  if (
    true_closed.effects
    or false_closed.effects
    or len(leaves) <= _OUTPUTS
    # Hoisted scalars are computed on a skipped step too, from its
    # gradients (a norm of inf or 0, divided by): no NaN for
    # `jax.debug_nans`.
    or jax.debug_nans.value
  ):
    # One conditional, on the jaxprs just traced (no second Python trace);
    # calls, the inner optimizer's among them, stay calls.
    whole = lambda closed: lambda: _jax_internals.jaxpr_as_fun(closed)()
    return jax.tree_util.tree_unflatten(
      tree, one_cond(pred, whole(true_closed), whole(false_closed))
    )

  t, f = _Graph(true_closed), _Graph(false_closed)
  debug_info = _jax_internals.nameless_debug_info(true_closed) if build else None

  def run(graph: _Graph, nodes: list[int], outs: list[int], env: dict) -> list:
    env = dict(env)
    graph.evaluate(nodes, env)
    return [env[v] if v in env else graph.const[v] for v in outs]

  hoisted, boundary = _hoisted(t)
  env: dict[int, Any] = {}
  t.evaluate(hoisted, env)
  # Only the hoisted scalars cross into the conditionals; what else they
  # needed is recomputed there where needed.
  env = {v: env[v] for v in boundary}
  flat: list[Any] = [None] * len(t.outs)
  for chunk in _chunks(_groups(t, boundary, set(hoisted))):
    t_outs = [t.outs[i] for i in chunk]
    f_outs = [f.outs[i] for i in chunk]
    t_nodes = t.slice(t_outs, boundary)
    f_nodes = f.slice(f_outs, set())
    results = None
    if build:
      results = _built_cond(
        pred, (t, t_nodes, t_outs, env), (f, f_nodes, f_outs, {}), debug_info
      )
    if results is None:
      results = one_cond(
        pred,
        functools.partial(run, t, t_nodes, t_outs, env),
        functools.partial(run, f, f_nodes, f_outs, {}),
      )
    for i, x in zip(chunk, results, strict=True):
      flat[i] = x
  return jax.tree_util.tree_unflatten(tree, flat)
