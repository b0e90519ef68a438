"""Each GGML quantization type, read from a GGUF, holds exactly (or within the stated float16
bound of) what gguf-py's reference dequantization gives for the same bytes; and the load says
what each type became."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants

from kiln.worker.loading.gguf_read import read_gguf

from .tiny_gguf import k_blocks

# type -> (what it becomes, bits of the mlx layout or None for dense)
EXPECTED = {
    "Q4_0": ("affine 4-bit g32", 4), "Q4_1": ("affine 4-bit g32", 4), "Q5_0": ("affine 5-bit g32", 5),
    "Q5_1": ("affine 5-bit g32", 5), "Q8_0": ("affine 8-bit g32", 8), "Q4_K": ("affine 4-bit g32", 4),
    "Q5_K": ("affine 5-bit g32", 5), "Q6_K": ("float16", None), "Q3_K": ("float16", None),
    "Q2_K": ("float16", None), "IQ4_NL": ("float16", None), "IQ4_XS": ("float16", None), "BF16": ("bfloat16", None),
}  # fmt: skip
K_ROUNDED = {"Q4_K", "Q5_K"}  # scale d * sc and bias -dmin * m rounded to float16
SHAPES = [(6, 512), (2, 3, 256)]  # a matrix and a stacked-experts tensor


def _stored(rng: np.random.Generator, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    qtype = Q[type_name]
    if type_name.endswith("_K") or type_name.startswith("IQ4"):
        return k_blocks(rng, shape, qtype)
    w = (0.05 * rng.standard_normal(shape)).astype(np.float32)
    w.reshape(-1)[::97] *= 40  # outliers: wide blocks
    return quants.quantize(w, qtype)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One GGUF with every type in both shapes, and the reference dequantization of each tensor."""
    rng = np.random.default_rng(7)
    path = tmp_path_factory.mktemp("quants") / "types.gguf"
    writer = GGUFWriter(str(path), "llama")
    reference: dict[str, np.ndarray] = {}
    for type_name in EXPECTED:
        for k, shape in enumerate(SHAPES):
            name = f"{type_name.lower()}_{k}.weight"
            stored = _stored(rng, type_name, shape)
            writer.add_tensor(name, stored, raw_dtype=Q[type_name])
            reference[name] = quants.dequantize(stored, Q[type_name]).astype(np.float32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return read_gguf(path), reference


def _values(contents, name: str, bits: int | None) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    if bits is None:
        return np.array(contents.tensors[name].astype(mx.float32)), None, None
    base = name[: -len(".weight")]
    weight, scales, biases = (contents.tensors[f"{base}.{p}"] for p in ("weight", "scales", "biases"))
    assert scales.dtype == biases.dtype == mx.float16  # mlx's usual layout
    # float32 scales: the stored values themselves (dequantizing in float16 would round the sums).
    scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    dense = mx.dequantize(weight, scales, biases, group_size=32, bits=bits)
    return np.array(dense), np.array(scales), np.array(biases)


@pytest.mark.parametrize("type_name", list(EXPECTED))
def test_type_holds_the_reference_values(written, type_name):
    contents, reference = written
    became, bits = EXPECTED[type_name]
    for k, shape in enumerate(SHAPES):
        name = f"{type_name.lower()}_{k}.weight"
        ref = reference[name]
        got, scales, biases = _values(contents, name, bits)
        assert got.shape == ref.shape == shape
        if type_name in K_ROUNDED:
            # Stated bound: each of scale and bias within float16 rounding (2^-11 relative,
            # 2^-25 absolute below float16's normal range) of its float32 product.
            q_max = 2**bits - 1
            per_group = q_max * np.abs(scales) + np.abs(biases)
            bound = np.repeat(per_group, 32, axis=-1) * 2.0**-11 + (q_max + 1) * 2.0**-25
            assert np.all(np.abs(got - ref) <= bound), float(np.max(np.abs(got - ref) - bound))
            assert not np.array_equal(got, ref)  # random scales: some products did round
        elif bits is None and type_name != "BF16":
            np.testing.assert_array_equal(got, ref.astype(np.float16).astype(np.float32))
        else:
            np.testing.assert_array_equal(got, ref)  # bit-exact
    if type_name == "BF16":  # dense types are no conversion: kept in their own dtype
        assert type_name not in contents.conversions and contents.tensors[name].dtype == mx.bfloat16
    else:
        assert contents.conversions[type_name] == became


def test_load_line_names_each_type(written):
    contents, _ = written
    line = contents.describe()
    assert "Q4_K x 2 -> affine 4-bit g32 (scales and mins rounded to float16)" in line
    assert "Q6_K x 2 -> float16 (dequantized: mlx has no 16-weight groups)" in line
    assert line.endswith("Q8_0 x 2 -> affine 8-bit g32")
    assert "BF16 x 2," in line and "BF16 x 2 ->" not in line


def test_repack_matches_mx_load_on_its_own_types(tmp_path):
    """Q4_0/Q4_1/Q8_0-only files go through mx.load; the numpy repack gives the same arrays."""
    from kiln.worker.loading import gguf_quants
    from kiln.worker.loading.gguf_header import read_header

    rng = np.random.default_rng(3)
    path = tmp_path / "native.gguf"
    writer = GGUFWriter(str(path), "llama")
    for type_name in ("Q4_0", "Q4_1", "Q8_0"):
        writer.add_tensor(f"{type_name.lower()}.weight", _stored(rng, type_name, (4, 256)), raw_dtype=Q[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    loaded = read_gguf(path).tensors  # the mx.load path
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    for info in read_header(path).tensors:
        type_name = info.name.split(".")[0].upper()
        data = mapped[info.offset : info.offset + 4 * (256 // 32) * {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[type_name]]
        ours = gguf_quants.repack(data.reshape(4, -1), type_name)
        for part in ("weight", "scales", "biases"):
            assert mx.array_equal(ours[part], loaded[f"{type_name.lower()}.{part}"]), (type_name, part)
