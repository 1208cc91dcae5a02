"""How the compiled path lays out linear weights (engine/cpu_linear.py): oneDNN-packed,
BLAS input-major, or as they are."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from pdserve.engine import cpu_linear
from pdserve.engine.cpu_linear import (
    BLAS_CALL_MACS,
    SMALL_GEMM_MACS,
    PackedLinear,
    call_path,
    intel_cpu,
    prepare,
)

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _not_intel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rules below as on a CPU that is not Intel's (the same on every machine); on an
    Intel CPU mid-sized float32 weights are BLAS-only (the test that says so lifts this)."""
    monkeypatch.setattr(cpu_linear, "intel_cpu", lambda cpuinfo="": False)


def _model(dtype: torch.dtype) -> torch.nn.Sequential:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 12, bias=False))
    return m.to(dtype)


def _big(dtype: torch.dtype, bias: bool = False) -> torch.nn.Sequential:
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, SMALL_GEMM_MACS // 256, bias=bias)
    return torch.nn.Sequential(torch.nn.Embedding(10, 256), linear).to(dtype)


needs_onednn = pytest.mark.skipif(
    not cpu_linear.onednn_usable(torch.float32), reason="torch built without oneDNN"
)


def test_without_onednn_float32_linears_become_input_major_and_compute_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDSERVE_CPU_LINEAR", "blas")
    m = _model(torch.float32)
    x = torch.tensor([[1, 2, 3]])
    before = m(x)
    assert prepare(m) == {"onednn": 0, "onednn_tied": 0, "blas_input_major": 1, "as_is": 0}
    w = m[1].weight
    assert w.shape == (12, 8) and w.stride() == (1, 12)  # [in, out] in memory
    torch.testing.assert_close(m(x), before)


def test_weights_off_the_cpu_are_left_alone() -> None:
    """A CUDA model's linears keep their layout (the meta device stands in for CUDA here:
    no GPU on this machine); before, its float32 weights were made input-major."""
    m = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Linear(12, 4)).to("meta")
    assert prepare(m) == {"onednn": 0, "onednn_tied": 0, "blas_input_major": 0, "as_is": 2}
    assert [type(layer) for layer in m] == [torch.nn.Linear, torch.nn.Linear]
    assert m[0].weight.stride() == (8, 1) and m[1].weight.stride() == (12, 1)


@needs_onednn
def test_a_small_float32_weight_keeps_a_blas_copy_for_small_calls() -> None:
    """Under BLAS_CALL_MACS a call goes to BLAS, above to oneDNN; both compute the same."""
    m = _model(torch.float32)
    original = m[1]
    prepare(m)
    layer = m[1]
    assert isinstance(layer, PackedLinear) and layer.blas is not None
    assert layer.blas.stride() == (1, 12)
    few, many = torch.randn(1, 3, 8), torch.randn(1, BLAS_CALL_MACS // 96 + 1, 8)
    assert (call_path(layer, few), call_path(layer, many)) == ("blas", "onednn")
    for x in (few, many):
        torch.testing.assert_close(layer(x), original(x), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_a_decode_batch_on_the_tiny_presets_mlp_goes_to_blas() -> None:
    """16 rows x 128 x 256 (the tiny preset's MLP at the serve bench's decode batch) is
    2^19 multiply-adds: it went to oneDNN, measured 27 us a call against BLAS's 9 on the
    Xeon (engine/cpu_linear.py); 16 rows on the tiny head (128 x 3,072) too, 114 vs 90."""
    for out_features in (256, 3072):
        linear = torch.nn.Linear(128, out_features, bias=False)
        m = torch.nn.Sequential(linear)
        prepare(m)
        layer = m[0]
        assert isinstance(layer, PackedLinear) and layer.blas is not None
        x = torch.randn(1, 16, 128)
        assert call_path(layer, x) == "blas"
        torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)
        big = torch.randn(1, 2048, 128)  # a prompt chunk: oneDNN
        assert call_path(layer, big) == "onednn"


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_large_float32_linears_are_packed_and_compute_the_same(bias: bool) -> None:
    m = _big(torch.float32, bias)
    x = torch.tensor([[1, 2, 3, 4, 5]])
    before = m(x)
    assert prepare(m)["onednn"] == 1
    assert isinstance(m[1], PackedLinear) and not list(m[1].parameters())
    assert m[1].blas is None  # SMALL_GEMM_MACS elements or more: one copy, oneDNN's
    torch.testing.assert_close(m(x), before, rtol=1e-5, atol=1e-4)


needs_onednn_bf16 = pytest.mark.skipif(
    not cpu_linear.onednn_usable(torch.bfloat16), reason="no oneDNN bfloat16 on this CPU"
)


@needs_onednn_bf16
def test_bfloat16_linears_are_packed_whatever_their_size_on_a_cpu_with_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: True)
    m = _model(torch.bfloat16)
    x = torch.tensor([[1, 2, 3]])
    before = m(x).float()
    assert prepare(m)["onednn"] == 1
    assert m[1].packed is not None and m[1].blas is None and not m[1].upcast
    torch.testing.assert_close(m(x).float(), before, rtol=2e-2, atol=2e-2)


@needs_onednn_bf16
@pytest.mark.parametrize("bias", [False, True])
def test_small_bfloat16_linears_multiply_in_float32_on_a_cpu_without_bf16(
    monkeypatch: pytest.MonkeyPatch, bias: bool
) -> None:
    """No avx512_bf16/AMX: a small bfloat16 weight keeps a float32 copy (no packed one) and
    every call, few rows or many, multiplies by it: bfloat16 in and out, the products and
    sums in float32 as a bfloat16 GEMM does them (2-4x faster than oneDNN's emulation)."""
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: False)
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
    m = torch.nn.Sequential(torch.nn.Embedding(10, 64).to(torch.bfloat16), linear)
    assert prepare(m)["onednn"] == 1
    layer = m[1]
    assert isinstance(layer, PackedLinear) and layer.upcast and layer.packed is None
    assert layer.blas is not None and layer.blas.dtype == torch.float32
    w32 = linear.weight.detach().float()
    b32 = None if linear.bias is None else linear.bias.detach().float()
    for rows in (1, 16, 4096):  # 4,096 x 64 x 96 multiply-adds: past BLAS_CALL_MACS
        x = torch.randn(rows, 64).to(torch.bfloat16)
        assert call_path(layer, x) == "blas"
        got = layer(x)
        assert got.dtype == torch.bfloat16
        want = torch.nn.functional.linear(x.float(), w32, b32).to(torch.bfloat16)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    big = _big(torch.bfloat16)  # SMALL_GEMM_MACS elements: stays packed in bfloat16
    prepare(big)
    assert big[1].packed is not None and big[1].blas is None and not big[1].upcast


def _tied(dtype: torch.dtype) -> torch.nn.Sequential:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(2048, 256), torch.nn.Linear(256, 2048, bias=False))
    m[1].weight = m[0].weight  # tied, as lm_head and embed_tokens are in SmolLM2
    return m.to(dtype)


def test_without_onednn_a_weight_shared_with_an_embedding_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDSERVE_CPU_LINEAR", "blas")
    m = _tied(torch.float32)
    assert prepare(m)["as_is"] == 1
    assert m[1].weight.stride() == (256, 1) and m[1].weight is m[0].weight


@needs_onednn
def test_a_head_tied_to_the_embedding_is_packed_and_few_rows_use_the_shared_tensor() -> None:
    """The embedding keeps its tensor (lookups want rows); the head gets a packed copy for
    calls of more than SHARED_ROWS rows and multiplies by the shared tensor below."""
    m = _tied(torch.float32)
    embedding = m[0].weight
    head = torch.nn.Linear(256, 2048, bias=False)
    head.weight = embedding
    ids = torch.tensor([[1, 2, 3]])
    before = m(ids)
    assert prepare(m) == {"onednn": 0, "onednn_tied": 1, "blas_input_major": 0, "as_is": 0}
    assert m[0].weight is embedding and embedding.stride() == (256, 1)
    layer = m[1]
    assert isinstance(layer, PackedLinear) and layer.shared is not None
    assert layer.shared.data_ptr() == embedding.data_ptr() and layer.blas is None
    torch.testing.assert_close(m(ids), before, rtol=1e-5, atol=1e-4)
    for rows in (1, cpu_linear.SHARED_ROWS, cpu_linear.SHARED_ROWS + 1, 17):
        x = torch.randn(rows, 256)
        torch.testing.assert_close(layer(x), head(x), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_the_environment_chooses_blas_or_onednn_for_every_weight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDSERVE_CPU_LINEAR", "blas")
    m = _big(torch.float32)
    assert prepare(m)["onednn"] == 0 and isinstance(m[1], torch.nn.Linear)
    monkeypatch.setenv("PDSERVE_CPU_LINEAR", "onednn")
    m = _model(torch.float32)
    assert prepare(m)["onednn"] == 1 and m[1].blas is None
    monkeypatch.setenv("PDSERVE_CPU_LINEAR", "fast")
    with pytest.raises(ValueError, match=r"PDSERVE_CPU_LINEAR='fast'.*auto, blas, onednn"):
        prepare(_model(torch.float32))


@needs_onednn
def test_packed_linear_compiles_with_dynamic_rows() -> None:
    m = _big(torch.float32)
    original = m[1]  # prepare() swaps the module in m and leaves this one as it was
    prepare(m)
    compiled = torch.compile(lambda x: torch.relu(m[1](x)) + 1, dynamic=True)
    for t in (3, 1, 17):
        x = torch.randn(1, t, 256)
        want = torch.relu(original(x)) + 1
        torch.testing.assert_close(compiled(x), want, rtol=1e-5, atol=1e-4)


@needs_onednn
def test_a_dropped_model_frees_its_packed_weights() -> None:
    m = _big(torch.float32)
    prepare(m)
    handle = m[1].handle
    assert handle in cpu_linear._layers
    del m
    gc.collect()
    assert handle not in cpu_linear._layers


@needs_onednn
def test_a_model_takes_the_handles_a_dropped_model_freed() -> None:
    """A model's handles (constants in its graphs, so in inductor's cache keys) do not
    depend on the models made before it: a dropped one, even one only a collection frees
    (a cycle), leaves its handles to the next; a live one keeps its own, and each model's
    calls find its own weights."""
    first = _big(torch.float32, bias=True)
    prepare(first)
    first.cycle = [first]  # type: ignore[assignment]  # freed by a collection only
    handles = [m.handle for m in first.modules() if isinstance(m, cpu_linear.PackedLinear)]
    del first
    second = _big(torch.float32, bias=True)
    torch.nn.init.normal_(second[1].weight)  # other weights than the first's
    expected = second(torch.tensor([[1, 2, 3]]))
    prepare(second)
    assert [second[1].handle] == handles
    assert torch.allclose(second(torch.tensor([[1, 2, 3]])), expected, atol=1e-5)
    third = _big(torch.float32)
    prepare(third)  # beside a live model: a handle of its own
    assert third[1].handle not in handles


def test_rows_are_bucketed_so_onednn_builds_few_primitives() -> None:
    assert [cpu_linear.rows_bucket(n) for n in (1, 7, 16)] == [1, 7, 16]  # decode batches
    assert [cpu_linear.rows_bucket(n) for n in (17, 300, 304, 305)] == [24, 304, 304, 320]
    assert all(cpu_linear.rows_bucket(n) - n < 8 for n in range(1, 64))  # decode batches
    assert [cpu_linear.rows_bucket(n) for n in (1024, 1025, 2048)] == [1024, 1088, 2048]
    buckets = {cpu_linear.rows_bucket(n) for n in range(1, 2049)}
    assert len(buckets) < 100  # prompt chunks of every length: under a hundred shapes
    assert all(cpu_linear.rows_bucket(n) - n < 16 for n in range(1, 1025))
    assert all(cpu_linear.rows_bucket(n) <= n * 1.065 for n in range(256, 2049))


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_padded_rows_compute_the_same_and_keep_the_shape(bias: bool) -> None:
    m = _big(torch.float32, bias)
    linear = m[1]
    want = {n: linear(torch.ones(1, n, 256) * 0.01 * n) for n in (17, 300, 513)}
    prepare(m)
    for n, expected in want.items():  # 3-d input, rows not on a bucket edge
        got = m[1](torch.ones(1, n, 256) * 0.01 * n)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


class _Router(torch.nn.Linear):
    """Like PhiMoE's router: an ``nn.Linear`` whose own forward returns more."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        logits = super().forward(x)
        return logits, logits.argmax(-1)


@pytest.mark.parametrize("env_mode", ["blas", "onednn"])
def test_a_linear_subclass_with_its_own_forward_is_left_alone(
    env_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PhiMoE compiled raised on every step (its router replaced by a PackedLinear that
    returns the logits only): such a subclass keeps its module and its forward."""
    monkeypatch.setenv("PDSERVE_CPU_LINEAR", env_mode)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(10, 256), _Router(256, SMALL_GEMM_MACS // 256))
    assert prepare(m)["as_is"] == 1
    assert type(m[1]) is _Router
    logits, experts = m[1](torch.ones(3, 256))
    assert logits.shape == (3, SMALL_GEMM_MACS // 256) and experts.shape == (3,)


def test_native_bf16_reads_the_cpu_flags(tmp_path: Path) -> None:
    """bfloat16 GEMMs in hardware need avx512_bf16 or AMX; plain AVX-512 emulates them."""
    info = tmp_path / "cpuinfo"
    info.write_text("flags\t\t: fpu avx2 avx512f avx512bw avx512_vnni\n")
    assert cpu_linear.native_bf16(str(info)) is False
    info.write_text("flags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert cpu_linear.native_bf16(str(info)) is True
    info.write_text("flags\t\t: fpu amx_tile amx_bf16\n")
    assert cpu_linear.native_bf16(str(info)) is True
    assert cpu_linear.native_bf16(str(tmp_path / "absent")) is None


def test_bfloat16_packing_warns_on_a_cpu_without_bf16_instructions(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if not cpu_linear.onednn_usable(torch.bfloat16):
        pytest.skip("no oneDNN bfloat16 on this torch")
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: False)
    with caplog.at_level("WARNING", logger=cpu_linear.__name__):
        prepare(_model(torch.bfloat16))  # small: multiplied in float32, nothing emulated
    assert "faster here" not in caplog.text
    with caplog.at_level("WARNING", logger=cpu_linear.__name__):
        prepare(_big(torch.bfloat16))
    assert "--dtype float32 is faster here" in caplog.text
    caplog.clear()
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: True)
    with caplog.at_level("WARNING", logger=cpu_linear.__name__):
        prepare(_model(torch.bfloat16))
        prepare(_model(torch.float32))
    assert "faster here" not in caplog.text


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_on_an_intel_cpu_mid_sized_float32_weights_are_blas_only(
    monkeypatch: pytest.MonkeyPatch, bias: bool
) -> None:
    """SmolLM2's MLP (576 x 1,536) on the Xeon: MKL's GEMM on the input-major weight took
    148 / 293 / 810 / 25,977 us at 1 / 16 / 64 / 2,048 rows against oneDNN's packed 193 /
    329 / 962 / 26,445 (engine/cpu_linear.py, "Intel"): one input-major copy, no packed
    one, every row count BLAS. Larger weights (a head) stay packed; other CPUs unchanged."""
    monkeypatch.setattr(cpu_linear, "intel_cpu", lambda cpuinfo="": True)
    m = _big(torch.float32, bias)  # SMALL_GEMM_MACS elements
    original = m[1]
    assert prepare(m) == {"onednn": 0, "onednn_tied": 0, "blas_input_major": 1, "as_is": 0}
    layer = m[1]
    assert isinstance(layer, PackedLinear) and layer.packed is None and layer.blas is not None
    assert layer.blas.stride() == (1, 2048)  # input-major: [in, out] in memory
    for rows in (1, 16, BLAS_CALL_MACS // (256 * 2048) + 1, 300):
        x = torch.randn(1, rows, 256)
        assert call_path(layer, x) == "blas"
        torch.testing.assert_close(layer(x), original(x), rtol=1e-5, atol=1e-4)
    big = torch.nn.Sequential(torch.nn.Linear(512, cpu_linear.BLAS_ONLY_ELEMENTS // 512 + 1))
    assert prepare(big)["onednn"] == 1 and big[0].packed is not None  # a head's size: packed
    bf16 = _big(torch.bfloat16)  # the bfloat16 rules are their own
    assert not cpu_linear.blas_only(bf16[1].weight, "auto")
    monkeypatch.setenv("PDSERVE_CPU_LINEAR", "onednn")
    m = _big(torch.float32)
    assert prepare(m)["onednn"] == 1 and m[1].packed is not None


def test_intel_cpu_reads_the_vendor(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: avx512f\n")
    assert intel_cpu(str(cpuinfo))  # the module's own (the fixture patches the attribute)
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\n")
    assert not intel_cpu(str(cpuinfo))
    assert not intel_cpu(str(tmp_path / "missing"))
