"""The update_weights_from_tensor codec: bit-exact round trips, SGLang-built payloads, and the allow-list."""

from __future__ import annotations

import base64
import dataclasses
import io
import os
import pickle
import pickletools
import sys
import types
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_sync.wire import payload as tp
from miles_sync.wire.bucket import layout_from_metadata, pack_bucket
from miles_sync.wire.dtypes import SUPPORTED_DTYPES, dtype_name
from miles_sync.wire.payload import FlattenedTensorMetadata, PayloadError, decode_payload

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.bool,
]


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _make(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def _assert_same(expected: list[tuple[str, torch.Tensor]], got: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in got] == [n for n, _ in expected]
    for (name, a), (_, b) in zip(expected, got):
        assert (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)), name
        assert _bits(a) == _bits(b), name


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _flattened_metadata(bucket) -> list[FlattenedTensorMetadata]:
    return [
        FlattenedTensorMetadata(
            name=e.name, shape=e.shape, dtype=e.dtype, start_idx=e.start, end_idx=e.end, numel=e.num_bytes
        )
        for e in bucket.entries
    ]


# ---- round trips ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_named_tensors_round_trip_bit_exact(dtype):
    base = _make((6, 8), dtype, seed=1)
    named = [
        ("w", base),
        ("scalar", _make((), dtype, seed=2)),
        ("empty", _make((0, 3), dtype, seed=3)),
        ("column", base[:, 3]),  # non-contiguous view: the whole storage travels, the view is rebuilt
        ("transposed", base.t()),
    ]
    got = decode_payload(tp.encode_named_tensors(named), load_format=None)
    _assert_same(named, got)
    assert decode_payload(tp.encode_named_tensors(named), load_format="direct")[3][1].stride() == base[:, 3].stride()


@settings(max_examples=25, deadline=None)
@given(
    specs=st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=3), st.sampled_from(DTYPES)), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_flattened_bucket_round_trip_bit_exact(specs, seed):
    named = [(f"t{i}", _make(tuple(shape), dtype, seed + i)) for i, (shape, dtype) in enumerate(specs)]
    bucket = pack_bucket(named)
    payload = tp.encode_flattened_bucket(buffer=bucket.buffer, metadata=_flattened_metadata(bucket))
    got = dict(decode_payload(payload, load_format="flattened_bucket"))
    _assert_same(named, [(n, got[n]) for n, _ in named])


def test_flattened_metadata_travels_under_sglang_class_name():
    bucket = pack_bucket([("a", torch.ones(4))])
    raw = base64.b64decode(tp.encode_flattened_bucket(buffer=bucket.buffer, metadata=_flattened_metadata(bucket)))
    strings = [arg for _, arg, _ in pickletools.genops(raw) if isinstance(arg, str)]
    assert "sglang.srt.weight_sync.tensor_bucket" in strings and "FlattenedTensorMetadata" in strings
    assert not any(s.startswith("miles_sync") for s in strings)


def test_payload_built_like_an_sglang_client_decodes_without_sglang(monkeypatch):
    """Pickled by torch's stock ForkingPickler with SGLang's own (stand-in) dataclass, as Miles does."""

    @dataclasses.dataclass
    class SGLangFlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    module_path = "sglang.srt.weight_sync.tensor_bucket"
    SGLangFlattenedTensorMetadata.__module__ = module_path
    SGLangFlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    module = types.ModuleType(module_path)
    module.FlattenedTensorMetadata = SGLangFlattenedTensorMetadata
    for parent in ("sglang", "sglang.srt", "sglang.srt.weight_sync"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, module_path, module)
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")  # what a CPU client must use: no fd passing over HTTP
    try:
        tensors = [("w", _make((4, 4), torch.bfloat16, 7)), ("b", _make((3,), torch.float32, 8))]
        flats = [t.reshape(-1).view(torch.uint8) for _, t in tensors]
        metadata, offset = [], 0
        for (name, t), flat in zip(tensors, flats):
            size = flat.numel()
            metadata.append(SGLangFlattenedTensorMetadata(name, t.shape, t.dtype, offset, offset + size, size))
            offset += size
        buf = io.BytesIO()
        ForkingPickler(buf).dump({"flattened_tensor": torch.cat(flats), "metadata": metadata})
        pairs = io.BytesIO()
        ForkingPickler(pairs).dump(tensors)
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    _assert_same(tensors, decode_payload(_b64(buf.getvalue()), load_format="flattened_bucket"))
    _assert_same(tensors, decode_payload(_b64(pairs.getvalue()), load_format=None))


# ---- refusals ---------------------------------------------------------------------------------------------------


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


class _Evals:
    def __reduce__(self):
        return (eval, ("1+1",))


@pytest.mark.parametrize(
    "obj, needle",
    [
        ([("a", _RunsCode())], "posix.system"),
        ([("a", _Evals())], "builtins.eval"),
        (torch.load, "torch.serialization.load"),
        (types.SimpleNamespace(), "types.SimpleNamespace"),
    ],
    ids=["os.system", "eval", "torch-function", "other-class"],
)
def test_globals_outside_the_allow_list_are_refused(obj, needle):
    with pytest.raises(PayloadError, match="outside the allow-list") as info:
        decode_payload(_b64(pickle.dumps(obj)), load_format=None)
    assert needle in str(info.value)


def test_allow_listed_classes_cannot_be_called():
    # GLOBAL torch.Tensor, then REDUCE with (5,): would allocate a tensor if the class itself were returned.
    raw = b"\x80\x04ctorch\nTensor\n(K\x05tR."
    with pytest.raises(PayloadError, match="not callable"):
        decode_payload(_b64(raw), load_format=None)


@pytest.mark.parametrize(
    "data, needle",
    [
        ("not base64 !!", "not valid base64"),
        (b"bytes", "base64 str"),
        (_b64(b"\x80\x04K\x01"), "does not unpickle"),
        (_b64(pickle.dumps({"a": 1})), "list of (name, tensor) pairs"),
        (_b64(pickle.dumps([("a", 1)])), "not a (name, tensor) pair"),
    ],
    ids=["bad-base64", "not-str", "truncated", "dict", "not-a-tensor"],
)
def test_malformed_payloads_are_refused(data, needle):
    with pytest.raises(PayloadError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        decode_payload(data, load_format=None)


def test_unknown_load_format_and_duplicate_names_are_refused():
    with pytest.raises(PayloadError, match="unknown load_format"):
        decode_payload(tp.encode_named_tensors([("a", torch.ones(1))]), load_format="safetensors")
    with pytest.raises(PayloadError, match=r"more than once: \['a'\]"):
        decode_payload(tp.encode_named_tensors([("a", torch.ones(1)), ("a", torch.zeros(1))]), load_format=None)


def _flattened(buffer: torch.Tensor, metadata: list) -> str:
    """A flattened payload with arbitrary metadata (bypassing the encoder's own checks)."""
    buf = io.BytesIO()
    tp._PayloadPickler(buf, protocol=4).dump({"flattened_tensor": buffer, "metadata": metadata})
    return _b64(buf.getvalue())


def _meta(**fields) -> FlattenedTensorMetadata:
    base = dict(name="w", shape=(2,), dtype=torch.float32, start_idx=0, end_idx=8, numel=8)
    return FlattenedTensorMetadata(**{**base, **fields})


@pytest.mark.parametrize(
    "metadata, needle",
    [
        ([_meta(numel=4)], "is 8 bytes, but metadata says numel=4"),
        ([_meta(start_idx=8, end_idx=16)], "past the buffer's 12 bytes"),
        ([_meta(start_idx=2, end_idx=10)], "Unaligned received tensor 'w'"),
        ([_meta(shape=(3,))], "is 12 bytes"),
        ([_meta(), _meta()], "more than once"),
    ],
    ids=["numel", "out-of-bounds", "unaligned", "shape", "duplicate"],
)
def test_flattened_metadata_that_does_not_describe_the_buffer_is_refused(metadata, needle):
    with pytest.raises(PayloadError, match=needle):
        decode_payload(_flattened(torch.zeros(12, dtype=torch.uint8), metadata), load_format="flattened_bucket")


def test_flattened_structure_is_checked():
    with pytest.raises(PayloadError, match="'flattened_tensor' and 'metadata'"):
        decode_payload(tp.encode_named_tensors([("a", torch.ones(1))]), load_format="flattened_bucket")
    with pytest.raises(PayloadError, match="1-D uint8"):
        decode_payload(_flattened(torch.zeros(3), [_meta()]), load_format="flattened_bucket")


def test_metadata_state_is_validated_when_unpickled():
    meta = _meta()
    state = meta.__getstate__()
    for bad_state in ({"name": "w"}, {**state, "start_idx": -1}, {**state, "shape": [2, -1]}, {**state, "dtype": 3}):
        record = FlattenedTensorMetadata.__new__(FlattenedTensorMetadata)
        with pytest.raises(PayloadError):
            record.__setstate__(bad_state)


def test_forged_shared_memory_handles_are_refused():
    storage = torch.ones(4).untyped_storage()
    manager, handle, size = storage._share_filename_cpu_()

    class Forged:
        def __init__(self, *args):
            self.args = args

        def __reduce__(self):
            return (torch.multiprocessing.reductions.rebuild_storage_filename, self.args)

    for args, needle in [
        ((torch.UntypedStorage, manager, b"/etc_passwd", size), "not a torch shared-memory handle"),
        ((torch.UntypedStorage, b"/tmp/not-a-manager", handle + b"9", size), "not a torch shared-memory manager"),
        ((torch.UntypedStorage, manager, b"/torch_1_1_999999", size), "cannot be opened"),
    ]:
        with pytest.raises(PayloadError, match=needle):
            decode_payload(_b64(pickle.dumps([("a", Forged(*args))])), load_format=None)


# ---- one dtype table --------------------------------------------------------------------------------------------


def _bytes_as(dtype: torch.dtype, numel: int) -> torch.Tensor:
    """`numel` elements of `dtype` from 0/1 bytes (valid bits for every dtype, bool included)."""
    raw = torch.arange(numel * dtype.itemsize, dtype=torch.uint8) % 2
    return raw.view(dtype).reshape(numel)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_colocated_codec_accepts_every_dtype_the_bucket_layout_accepts(dtype):
    # The distributed path (bucket layout from wire names) and the colocated path (payload codec) accept the same
    # dtypes: a bucket packed for one decodes on the other.
    named = [("wide", _bytes_as(torch.int64, 3)), ("t", _bytes_as(dtype, 5))]
    bucket = pack_bucket(named)
    names = [dtype_name(e.dtype) for e in bucket.entries]
    assert layout_from_metadata(names=bucket.names, dtypes=names, shapes=[e.shape for e in bucket.entries]) == (
        bucket.entries
    )
    payload = tp.encode_flattened_bucket(buffer=bucket.buffer, metadata=_flattened_metadata(bucket))
    _assert_same(named, decode_payload(payload, load_format="flattened_bucket"))
    _assert_same(named, decode_payload(tp.encode_named_tensors(named), load_format="direct"))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_both_paths_refuse_dtypes_outside_the_table(dtype):
    with pytest.raises(ValueError, match="Unsupported dtype"):
        pack_bucket([("t", torch.zeros(2, dtype=dtype))])
    buffer = torch.zeros(dtype.itemsize, dtype=torch.uint8)
    metadata = [_meta(dtype=dtype, shape=(1,), start_idx=0, end_idx=dtype.itemsize, numel=dtype.itemsize)]
    with pytest.raises(PayloadError, match="unsupported dtype"):
        tp.encode_flattened_bucket(buffer=buffer, metadata=metadata)
    # A forged payload cannot even name the dtype: it is not an allow-listed global.
    with pytest.raises(PayloadError, match=f"torch.{str(dtype).removeprefix('torch.')}, which is outside"):
        decode_payload(_flattened(buffer, metadata), load_format="flattened_bucket")


@pytest.mark.parametrize("strategy", sorted(torch.multiprocessing.get_all_sharing_strategies()))
def test_the_encoder_never_emits_file_descriptor_handles_whatever_the_process_strategy(strategy):
    """A handle pickled with torch's `file_descriptor` strategy kills a real SGLang server (its scheduler cannot
    receive the fd over HTTP: AuthenticationError). The encoder pickles shared-memory file names under every
    process-wide strategy, the default `file_descriptor` included."""
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy(strategy)
    try:
        tensor = _make((8, 4), torch.float32, 3)
        buffer = tensor.reshape(-1).view(torch.uint8)
        metadata = [
            FlattenedTensorMetadata(name="w", shape=(8, 4), dtype=torch.float32, start_idx=0, end_idx=128, numel=128)
        ]
        payloads = [
            tp.encode_named_tensors([("w", tensor)]),
            tp.encode_named_tensor_dict([("w", tensor)]),
            tp.encode_flattened_bucket(buffer=buffer, metadata=metadata),
        ]
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    for payload in payloads:
        globals_named = {
            str(arg)
            for op, arg, _ in pickletools.genops(base64.b64decode(payload))
            if op.name in ("GLOBAL", "STACK_GLOBAL", "SHORT_BINUNICODE", "BINUNICODE", "UNICODE")
        }
        assert "rebuild_storage_filename" in globals_named
        assert not any("rebuild_storage_fd" in name or "DupFd" in name for name in globals_named), globals_named
