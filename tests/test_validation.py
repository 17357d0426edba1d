"""Mistakes in using the wrappers get a clear error, as early as possible.

Settings are checked when the wrapper is built (`lossscale/_checks.py`):
the error names the factory, the argument and the bad value. A wrong state
or tree is refused when `update` is first called or traced.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale as ls
from _helpers import INF, NAN, scale_history

# ---------------------------------------------------------------------------
# Settings, at construction time.


BAD_DYNAMIC = [
  (dict(initial_scale=0.0), "initial_scale"),
  (dict(initial_scale=-2.0), "initial_scale"),
  (dict(initial_scale=INF), "initial_scale"),
  (dict(initial_scale=NAN), "initial_scale"),
  (dict(initial_scale=2.0**30), "initial_scale"),  # above max_scale
  (dict(initial_scale=0.5), "initial_scale"),  # below min_scale
  (dict(min_scale=0.0), "min_scale"),
  (dict(min_scale=-1.0), "min_scale"),
  (dict(min_scale=NAN), "min_scale"),
  (dict(max_scale=INF), "max_scale"),
  (dict(max_scale=1e39), "max_scale"),  # not a finite float32
  (dict(min_scale=8.0, max_scale=4.0, initial_scale=4.0), "min_scale"),
  (dict(growth_interval=0), "growth_interval"),
  (dict(growth_interval=-3), "growth_interval"),
  (dict(growth_interval=2.5), "growth_interval"),
  (dict(growth_interval=True), "growth_interval"),
  (dict(growth_interval=2**31), "growth_interval"),
  (dict(growth_factor=0.5), "growth_factor"),
  (dict(growth_factor=INF), "growth_factor"),
  (dict(backoff_factor=0.0), "backoff_factor"),
  (dict(backoff_factor=1.5), "backoff_factor"),
  (dict(backoff_factor=-0.5), "backoff_factor"),
  (dict(backoff_factor=NAN), "backoff_factor"),
  (dict(hysteresis=0), "hysteresis"),
  (dict(hysteresis=1.0), "hysteresis"),
  (dict(consecutive_hysteresis=1), "consecutive_hysteresis"),
  (dict(consecutive_hysteresis="yes"), "consecutive_hysteresis"),
  (dict(growth_delay=-1), "growth_delay"),
  (dict(growth_delay=1.0), "growth_delay"),
  (dict(growth_delay=True), "growth_delay"),
  (dict(growth_delay=2**31), "growth_delay"),
  (dict(growth_interval=2**31 - 1, growth_delay=1), "growth_interval"),
  (dict(tolerance=-0.1), "tolerance"),
  (dict(tolerance=1.5), "tolerance"),
  (dict(tolerance=NAN), "tolerance"),
  (dict(tolerance="0.25"), "tolerance"),
  (dict(tolerance=0.25, hysteresis=2), "tolerance"),
  (dict(axis_name=[]), "axis_name"),
  (dict(axis_name=()), "axis_name"),
  (dict(axis_name=""), "axis_name"),
  (dict(axis_name=("batch", "")), "axis_name"),
  (dict(axis_name=("batch", "batch")), "axis_name"),
]


@pytest.mark.parametrize("kwargs,name", BAD_DYNAMIC)
def test_invalid_dynamic_configuration(kwargs, name):
  with pytest.raises(ValueError, match=rf"dynamic_loss_scale\({name}="):
    ls.dynamic_loss_scale(optax.sgd(0.1), **kwargs)


def test_initial_scale_above_max_scale_says_to_raise_max_scale():
  # DeepSpeed's and Megatron-LM's class default initial scale is 2**32.
  with pytest.raises(
    ValueError, match=r"Raise max_scale too \(max_scale=4294967296\.0"
  ):
    ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=2.0**32)
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=2.0**32, max_scale=2.0**32)
  assert float(tx.init(jnp.zeros(1)).loss_scale) == 2.0**32


def test_policy_settings_accept_their_edges():
  for kwargs in (
    dict(growth_delay=0),
    dict(growth_delay=np.int32(1)),
    dict(tolerance=0.0),
    dict(tolerance=np.float32(0.999)),
    dict(tolerance=1.0),
    dict(consecutive_hysteresis=np.bool_(True), hysteresis=2),
    dict(growth_interval=2**31 - 2, growth_delay=1),
  ):
    ls.dynamic_loss_scale(optax.sgd(0.1), **kwargs)


def test_invalid_value_is_named_in_the_message():
  with pytest.raises(ValueError, match="got 0"):
    ls.dynamic_loss_scale(optax.sgd(0.1), growth_interval=0)
  with pytest.raises(ValueError, match=r"got 1\.5"):
    ls.dynamic_loss_scale(optax.sgd(0.1), backoff_factor=1.5)


@pytest.mark.parametrize("scale", [0.0, -1.0, INF, NAN, 1e39])
def test_invalid_static_scale(scale):
  with pytest.raises(ValueError, match=r"static_loss_scale\(loss_scale="):
    ls.static_loss_scale(optax.sgd(0.1), scale)


@pytest.mark.parametrize("value", ["2.0", True, None, [1.0]])
def test_non_numeric_setting_is_rejected(value):
  with pytest.raises(ValueError, match=r"initial_scale=\.\.\.\)` must be a real"):
    ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=value)


def test_numpy_and_jax_scalars_are_accepted():
  tx = ls.dynamic_loss_scale(
    optax.sgd(0.1),
    initial_scale=np.float32(4.0),
    growth_interval=np.int64(3),
    max_scale=jnp.float32(8.0),
    min_scale=jnp.bfloat16(2.0),  # ml_dtypes floats are real numbers too
  )
  assert float(tx.init(jnp.ones(1)).loss_scale) == 4.0
  assert (
    float(ls.static_loss_scale(optax.sgd(0.1), np.float16(8.0)).init(0.0).loss_scale)
    == 8.0
  )


@pytest.mark.parametrize("value", [jnp.array(True), np.bool_(False), jnp.ones(2)])
def test_bool_and_array_settings_are_rejected(value):
  with pytest.raises(ValueError, match=r"initial_scale=\.\.\.\)` must be a real"):
    ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=value)


def test_traced_settings_say_what_to_inject_instead():
  # optax.inject_hyperparams around a wrapper traces its numeric settings
  # under jit: the settings are fixed at construction, and the error says so.
  tx = optax.inject_hyperparams(ls.dynamic_loss_scale, static_args=("inner",))(
    optax.sgd(0.1), initial_scale=4.0
  )
  params = {"w": jnp.ones(3)}
  with pytest.raises(
    ValueError, match=r"must be a concrete number.*inject_hyperparams"
  ):
    jax.jit(tx.update)(params, tx.init(params), params)
  with pytest.raises(ValueError, match=r"growth_interval=\.\.\.\)` must be a concrete"):
    jax.jit(lambda n: ls.dynamic_loss_scale(optax.sgd(0.1), growth_interval=n))(3)


def test_jax_integer_scalars_are_accepted_for_integer_settings():
  tx = ls.dynamic_loss_scale(
    optax.sgd(0.1), growth_interval=jnp.int32(2), hysteresis=np.int16(1)
  )
  assert scale_history(tx, [True, True]) == [2.0**15, 2.0**16]
  with pytest.raises(ValueError, match=r"growth_interval=\.\.\.\)` must be a positive"):
    ls.dynamic_loss_scale(optax.sgd(0.1), growth_interval=jnp.float32(2.0))


@pytest.mark.parametrize("value", [1, 0, "yes", None, np.float32(1.0)])
def test_reset_hysteresis_on_backoff_must_be_a_bool(value):
  with pytest.raises(ValueError, match=r"reset_hysteresis_on_backoff=\.\.\.\)"):
    ls.dynamic_loss_scale(optax.sgd(0.1), reset_hysteresis_on_backoff=value)


@pytest.mark.parametrize("value", [0, 1, "no", None])
def test_enabled_must_be_a_bool(value):
  with pytest.raises(ValueError, match=r"dynamic_loss_scale\(enabled=\.\.\.\)"):
    ls.dynamic_loss_scale(optax.sgd(0.1), enabled=value)
  with pytest.raises(ValueError, match=r"static_loss_scale\(enabled=\.\.\.\)"):
    ls.static_loss_scale(optax.sgd(0.1), 2.0, enabled=value)


def test_unhashable_axis_name_is_named():
  class Unhashable:
    __hash__ = None

  with pytest.raises(ValueError, match=r"skip_nonfinite\(axis_name=\.\.\.\)"):
    ls.skip_nonfinite(optax.sgd(0.1), axis_name=Unhashable())
  with pytest.raises(ValueError, match=r"axis_name"):
    ls.dynamic_loss_scale(optax.sgd(0.1), axis_name=("batch", Unhashable()))


# ---------------------------------------------------------------------------
# Scales must be normal float32 numbers: 1 / scale is then finite.


@pytest.mark.parametrize("scale", [1e-39, 2.0**-127, 1e-45])
def test_subnormal_scales_are_rejected(scale):
  with pytest.raises(ValueError, match=r"static_loss_scale\(loss_scale=.*normal"):
    ls.static_loss_scale(optax.sgd(0.1), scale)
  with pytest.raises(ValueError, match=r"dynamic_loss_scale\(min_scale="):
    ls.dynamic_loss_scale(optax.sgd(0.1), min_scale=scale, initial_scale=1.0)
  with pytest.raises(ValueError, match=r"dynamic_loss_scale\(initial_scale="):
    ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=scale)


def test_smallest_normal_scale_is_accepted_and_never_left():
  tiny = 2.0**-126
  tx = ls.dynamic_loss_scale(
    optax.sgd(0.1), initial_scale=tiny * 4, min_scale=tiny, growth_interval=10
  )
  assert scale_history(tx, [False] * 4) == [tiny * 2, tiny, tiny, tiny]
  static = ls.static_loss_scale(optax.sgd(1.0), tiny)
  updates, state = static.update(
    {"w": jnp.full(2, tiny, jnp.float32)}, static.init({"w": jnp.zeros(2, jnp.float32)})
  )
  assert bool(state.last_finite)
  np.testing.assert_array_equal(updates["w"], [-1.0, -1.0])


# ---------------------------------------------------------------------------
# The wrong object in the wrong place.


def test_inner_must_be_a_gradient_transformation():
  with pytest.raises(TypeError, match="inner"):
    ls.dynamic_loss_scale(lambda g: g)


def test_multisteps_object_as_inner_says_what_to_pass():
  with pytest.raises(TypeError, match=r"gradient_transformation\(\)"):
    ls.dynamic_loss_scale(optax.MultiSteps(optax.sgd(0.1), 2))
  with pytest.raises(TypeError, match=r"static_loss_scale\(inner="):
    ls.static_loss_scale(object(), 2.0)


def test_a_plain_optimizer_state_names_loss_scale_state():
  tx = ls.dynamic_loss_scale(optax.sgd(0.1))
  params = {"w": jnp.zeros(2)}
  plain = optax.sgd(0.1).init(params)
  for update in (tx.update, jax.jit(tx.update)):
    with pytest.raises(TypeError, match=r"LossScaleState.*tx\.init\(params\)"):
      update({"w": jnp.ones(2, jnp.float32)}, plain, params)


@pytest.mark.parametrize(
  "inner",
  [
    ls.static_loss_scale(optax.sgd(0.1), 2.0),
    optax.chain(optax.clip(1.0), ls.skip_nonfinite(optax.sgd(0.1))),
  ],
  ids=["direct", "in_chain"],
)
def test_a_wrapper_inside_a_wrapper_is_refused(inner):
  # Unscaled twice, and no single scale for `scale_loss`: refused at init.
  tx = ls.dynamic_loss_scale(inner)
  params = {"w": jnp.ones(2)}
  for init in (tx.init, jax.jit(tx.init)):
    with pytest.raises(
      ValueError, match=r"dynamic_loss_scale\(inner=\.\.\.\)` already"
    ):
      init(params)
