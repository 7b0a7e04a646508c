"""naming: one row per parameter read both ways. A PyTorch ``Linear`` computes ``x @ W.T + b``;
our kernels, laid out by the rows, must compute the same from the converted arrays, and writing
must give back the exact arrays read."""

from __future__ import annotations

import numpy as np
import pytest

from flaxformer_lite.interop import naming
from flaxformer_lite.interop.naming import Tensor

D, H, HD, FF = 6, 2, 4, 10


def test_query_kernel_computes_what_the_linear_does():
    rng = np.random.default_rng(0)
    weight, bias = rng.normal(size=(H * HD, D)), rng.normal(size=(H * HD,))
    x = rng.normal(size=(3, D))
    kernel_row, bias_row = naming.linear("q", "attn/query", (D, H, HD))
    ours = np.einsum("bd,dhk->bhk", x, kernel_row.to_ours(weight)) + bias_row.to_ours(bias)
    np.testing.assert_allclose(ours.reshape(3, H * HD), x @ weight.T + bias, rtol=1e-12)


def test_output_kernel_computes_what_the_linear_does():
    rng = np.random.default_rng(1)
    weight = rng.normal(size=(D, H * HD))
    z = rng.normal(size=(3, H, HD))
    (row,) = naming.linear("o", "attn/out", (H, HD, D), in_axes=2, bias=False)
    ours = np.einsum("bhk,hkd->bd", z, row.to_ours(weight))
    np.testing.assert_allclose(ours, z.reshape(3, H * HD) @ weight.T, rtol=1e-12)


def test_reading_then_writing_gives_back_every_array_bitwise():
    rng = np.random.default_rng(2)
    rows = naming.linear("fc1", "mlp/wi", (D, FF))
    rows += naming.linear("o", "attn/out", (H, HD, D), in_axes=2)
    rows += naming.norm("ln", "norm", D)
    rows.append(Tensor(("bias",), "logits_bias", (FF,), hf_shape=(1, FF)))
    state = {
        name: rng.normal(size=row.expected_hf_shape).astype(np.float32)
        for row in rows
        for name in row.hf
    }
    params = naming.params_from_state(state, rows)
    assert params["mlp"]["wi"]["kernel"].shape == (D, FF)
    assert params["attn"]["out"]["kernel"].shape == (H, HD, D)
    assert params["logits_bias"].shape == (FF,)
    back = naming.state_from_params(params, rows)
    assert set(back) == set(state)
    for name, value in state.items():
        np.testing.assert_array_equal(back[name], value)
        assert back[name].flags["C_CONTIGUOUS"]


def test_a_tied_table_is_read_under_any_of_its_names_and_written_under_the_first():
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    row = Tensor(("shared", "embed_tokens"), "embedding", (4, 3))
    params = naming.params_from_state({"embed_tokens": table}, [row])
    np.testing.assert_array_equal(params["embedding"], table)
    assert list(naming.state_from_params(params, [row])) == ["shared"]


def test_missing_misshapen_and_left_over_tensors_are_named():
    rows = naming.linear("fc1", "mlp/wi", (D, FF), bias=False)
    good = {"fc1.weight": np.zeros((FF, D), np.float32)}
    with pytest.raises(ValueError, match=r"no tensor fc1\.weight \(expected shape \(10, 6\)\)"):
        naming.params_from_state({}, rows)
    with pytest.raises(ValueError, match=r"'fc1\.weight' has shape \(6, 10\).*implies \(10, 6\)"):
        naming.params_from_state({"fc1.weight": np.zeros((D, FF))}, rows)
    with pytest.raises(ValueError, match=r"this T5 mapping does not use: \['extra'\]"):
        naming.params_from_state({**good, "extra": np.zeros(1)}, rows, family="T5")
    naming.params_from_state({**good, "extra": np.zeros(1)}, rows, ignore={"extra"})
    with pytest.raises(ValueError, match=r"params/mlp/wi/kernel has shape \(10, 6\)"):
        naming.state_from_params({"mlp": {"wi": {"kernel": np.zeros((FF, D))}}}, rows)
    with pytest.raises(ValueError, match=r"no params/mlp/wo"):
        naming.state_from_params({"mlp": {}}, naming.linear("fc2", "mlp/wo", (FF, D)))


def test_in_axes_must_split_the_shape():
    with pytest.raises(ValueError, match="in_axes=3 must split shape"):
        Tensor(("w",), "k", (2, 3, 4), in_axes=3)
