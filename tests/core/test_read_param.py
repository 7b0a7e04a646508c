"""Reading parameters (``core.logical_params.read_param`` and ``nn.flax_layers``): applying a
model reads every parameter without tracing its initializer, which linen's ``Module.param``
does under ``jax.eval_shape`` at every read, and a parameter of the wrong shape is still
refused with flax's error naming it and both shapes."""

from __future__ import annotations

import ast
import inspect
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import errors, traverse_util
from flax.core import scope

from flaxformer_lite import EncoderDecoder, TransformerConfig
from flaxformer_lite.models import DecoderOnly, EncoderClassifier

SMALL = dict(vocab_size=40, d_model=16, num_heads=2, d_ff=24, max_len=16)
# Between them every place that makes a parameter: attention projections (separate and fused,
# biased or not, int8 kernels and scales), feed-forward blocks (dense, gated, experts and their
# router), LayerNorm and RMSNorm, the token embedding, learned and relative position tables,
# the untied logits and their bias, the classifier's pooling query and head, a scanned stack.
CASES = {
    "paper": (EncoderDecoder, dict(norm_position="post")),
    "rotary_swiglu_rms_untied": (
        EncoderDecoder,
        dict(
            position="rotary",
            activation="swiglu",
            norm_type="rmsnorm",
            use_bias=False,
            tie_output_embedding=False,
            logits_bias=True,
        ),
    ),
    "learned_moe_fused": (
        EncoderDecoder,
        dict(position="learned", num_experts=4, moe_every=2, fused_qkv=True),
    ),
    "relative_scanned": (EncoderDecoder, dict(position="relative", scan_layers=True)),
    "int8": (EncoderDecoder, dict(quantization="int8")),
    "lm": (DecoderOnly, dict(position="learned")),
    "classifier": (EncoderClassifier, dict(pooling="attention", num_classes=3)),
}


def model_and_inputs(case):
    cls, fields = CASES[case]
    layers = dict(num_decoder_layers=2) if cls is DecoderOnly else {}
    if cls is EncoderDecoder:
        layers = dict(num_encoder_layers=2, num_decoder_layers=2)
    elif cls is EncoderClassifier:
        layers = dict(num_encoder_layers=2)
    model = cls(TransformerConfig(**SMALL, **layers, **fields))
    tokens = jnp.array([[5, 6, 7, 2, 0], [8, 9, 2, 0, 0]], jnp.int32)
    inputs = (tokens, tokens) if cls is EncoderDecoder else (tokens,)
    return model, inputs


@pytest.fixture(scope="module", params=sorted(CASES))
def initialised(request):
    model, inputs = model_and_inputs(request.param)
    # Shapes only (jax.ShapeDtypeStruct leaves): what is tested is what tracing does.
    variables = jax.eval_shape(lambda: nn.meta.unbox(model.init(jax.random.key(0), *inputs)))
    return model, inputs, variables


def test_apply_traces_no_initializer(initialised, monkeypatch):
    """Linen's ``Scope.param`` runs a parameter's initializer under ``jax.eval_shape`` at
    every read: applying the model (traced, as a jitted step would) never does. (Flax's own
    once-per-module ``eval_shape`` of a ``setup`` under ``nn.scan`` is let through.)"""
    model, inputs, variables = initialised
    eval_shape = jax.eval_shape

    def refuse_from_scope_param(fn, *args, **kwargs):
        if inspect.currentframe().f_back.f_code is scope.Scope.param.__code__:
            raise AssertionError("an initializer traced to read a parameter")
        return eval_shape(fn, *args, **kwargs)

    monkeypatch.setattr(jax, "eval_shape", refuse_from_scope_param)
    logits = eval_shape(model.apply, variables, *inputs)
    assert logits.shape[0] == inputs[0].shape[0]


def test_a_parameter_of_the_wrong_shape_is_refused_naming_it(initialised):
    """Each kind of parameter in turn, its last axis longer by one: the apply fails with
    flax's ``ScopeParamShapeError`` naming that parameter, the shape it found and the one
    expected."""
    model, inputs, variables = initialised
    flat = traverse_util.flatten_dict(variables["params"])
    assert len(flat) > 10
    # one parameter per (module name, parameter name): the query kernel of the first layer
    # stands for every layer's (the same call made it)
    first = {}
    for path, leaf in flat.items():
        first.setdefault((path[-2:] if len(path) > 1 else path), (path, leaf))
    assert len(first) >= 10
    for path, leaf in first.values():
        shape = leaf.shape
        wrong = (*shape[:-1], shape[-1] + 1)
        params = traverse_util.unflatten_dict(
            {**flat, path: jax.ShapeDtypeStruct(wrong, leaf.dtype)}
        )
        with pytest.raises(errors.ScopeParamShapeError) as info:
            jax.eval_shape(model.apply, {**variables, "params": params}, *inputs)
        message = str(info.value)
        assert f'For parameter "{path[-1]}" in "' in message, (path, message)
        module = f"/{path[-2]}" if len(path) > 1 else '"/"'  # scanned: .../scan(layers)/...
        assert module in message, (path, message)
        found = re.search(r"generate shape (\(.*?\)), but .* has shape (\(.*?\))", message)
        assert found, message
        # a scanned stack's parameters carry the layers axis first; the check sees one layer
        expected_shape, given_shape = (ast.literal_eval(g) for g in found.groups())
        assert given_shape[-1] == wrong[-1] and expected_shape[-1] == shape[-1], (path, message)
