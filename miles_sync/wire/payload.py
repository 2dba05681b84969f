"""The codec for `update_weights_from_tensor` payloads: named tensors as base64 pickles of shared-memory handles.

Producers pickle tensors the way SGLang clients do, with torch's multiprocessing reducers: a CPU tensor travels as a
handle to a POSIX shared-memory segment (torch's `file_system` sharing strategy; the bytes never enter the pickle), a
CUDA tensor as a CUDA IPC handle whose device is named by UUID (as SGLang's patched reductions do). The receiver
unpickles through an explicit allow-list: only torch's tensor/storage rebuild functions (each wrapped by a checker
of its arguments), torch dtypes, `torch.Size`, and SGLang's `FlattenedTensorMetadata` class name, mapped onto our own
record, resolve. Nothing else can be named by a payload, so a payload can never run code.

Load formats (the request's `load_format`):
- None or "direct": a pickled list of (name, tensor) pairs;
- "flattened_bucket": a pickled dict {"flattened_tensor": 1-D uint8 tensor, "metadata": [FlattenedTensorMetadata]}
  whose records give each tensor's byte range [start_idx, end_idx) in the buffer (numel counts bytes).

Lifetime: a decoded tensor views the producer's memory. The producer keeps its tensors alive until the receiver has
answered; the receiver copies what it keeps before answering.
"""

from __future__ import annotations

import base64
import binascii
import copyreg
import io
import os
import pickle
import re
import stat
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing import reductions

from miles_sync.wire.dtypes import SUPPORTED_DTYPES, dtype_name

__all__ = [
    "FlattenedTensorMetadata",
    "decode_payload",
    "encode_flattened_bucket",
    "encode_named_tensor_dict",
]

LOAD_FORMATS: tuple[str | None, ...] = (None, "direct", "flattened_bucket")

# Where SGLang defines the metadata record; producers and receivers both name the class by this path.
SGLANG_METADATA_MODULE = "sglang.srt.weight_sync.tensor_bucket"
SGLANG_METADATA_NAME = "FlattenedTensorMetadata"

_MAX_DIMS = 16
_METADATA_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")
# torch's file_system strategy names segments "/torch_<pid>_<random>_<counter>" and its manager socket
# "<tmpdir>/manager.sock"; anything else is not a handle torch produced.
_SHM_HANDLE = re.compile(rb"/torch_([0-9]+)_[0-9]+_[0-9]+")
_SHM_DIR = "/dev/shm"

# Tensors may carry exactly the dtypes of the wire's one dtype table, the one the bucket layout also accepts.
_WEIGHT_DTYPES: tuple[torch.dtype, ...] = SUPPORTED_DTYPES


class PayloadError(ValueError):
    """A payload that is not valid base64, names a global outside the allow-list, or has the wrong structure."""


@dataclass(frozen=True, kw_only=True)
class FlattenedTensorMetadata:
    """One tensor of a flattened bucket: bytes [start_idx, end_idx) of the buffer, `numel` bytes long.

    Pickled under SGLang's class name with SGLang's field set, so SGLang receivers and ours decode the same bytes.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int

    def __getstate__(self) -> dict[str, Any]:
        state = {field: getattr(self, field) for field in _METADATA_FIELDS}
        state["shape"] = torch.Size(self.shape)
        return state

    def __setstate__(self, state: Any) -> None:
        # Called by the unpickler with attacker-controlled state: check everything before accepting it.
        if not isinstance(state, dict) or set(state) != set(_METADATA_FIELDS):
            keys = sorted(map(repr, state)) if isinstance(state, dict) else type(state).__name__
            raise PayloadError(f"FlattenedTensorMetadata state must have exactly {list(_METADATA_FIELDS)}, got {keys}")
        name, shape, dtype = state["name"], state["shape"], state["dtype"]
        if not isinstance(name, str):
            raise PayloadError(f"FlattenedTensorMetadata.name must be a str, got {type(name).__name__}")
        if not isinstance(dtype, torch.dtype):
            raise PayloadError(f"FlattenedTensorMetadata {name!r}: dtype must be a torch.dtype, got {dtype!r}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "shape", _checked_dims(shape, what=f"FlattenedTensorMetadata {name!r} shape"))
        object.__setattr__(self, "dtype", dtype)
        for field in ("start_idx", "end_idx", "numel"):
            value = state[field]
            if not _is_int(value) or value < 0:
                raise PayloadError(f"FlattenedTensorMetadata {name!r}: {field} must be an int >= 0, got {value!r}")
            object.__setattr__(self, field, value)


def encode_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """Payload for load_format None or "direct": a list of (name, tensor) pairs.

    Mutates: each CPU tensor's storage moves into shared memory (one copy, once per storage). The caller keeps the
    tensors alive until the receiver has answered.
    """
    pairs = []
    for name, tensor in named:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise ValueError(f"expected (str, Tensor) pairs, got ({type(name).__name__}, {type(tensor).__name__})")
        pairs.append((name, tensor.detach()))
    return _encode(pairs)


def encode_inline_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """A load_format None (or custom loader) payload that carries its CPU tensors' bytes inside it, for a receiver on
    another node (no shared memory to map): each storage travels as `torch.save` bytes, which SGLang's unpickler
    and this module's load with `weights_only`. For small tensors (a p2p ticket); weights go by their transport."""
    pairs = []
    for name, tensor in named:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            raise ValueError(f"expected (str, CPU tensor) pairs, got ({type(name).__name__}, {tensor!r:.40})")
        pairs.append((name, tensor.detach()))
    return base64.b64encode(pickle.dumps(pairs, protocol=pickle.DEFAULT_PROTOCOL)).decode("ascii")


def encode_named_tensor_dict(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """Payload of an adapter for load_format None: a pickled dict {name: tensor}, what SGLang's
    `load_lora_adapter_from_tensors` reads (it indexes the payload by name). Same lifetime contract as
    `encode_named_tensors`."""
    pairs = {}
    for name, tensor in named:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise ValueError(f"expected (str, Tensor) pairs, got ({type(name).__name__}, {type(tensor).__name__})")
        pairs[name] = tensor.detach()
    return _encode(pairs)


def encode_flattened_bucket(*, buffer: torch.Tensor, metadata: Sequence[FlattenedTensorMetadata]) -> str:
    """Payload for load_format "flattened_bucket": one uint8 buffer plus one metadata record per tensor.

    Same lifetime contract as `encode_named_tensors`.
    """
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(
            f"flattened buffer must be a 1-D uint8 tensor, got {buffer.dtype} with shape {tuple(buffer.shape)}"
        )
    _check_flattened_ranges(buffer, list(metadata))
    return _encode({"flattened_tensor": buffer.detach(), "metadata": list(metadata)})


def decode_payload(data: Any, *, load_format: str | None, is_adapter: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Decode one TP rank's payload into (name, tensor) pairs in payload order; tensors view the producer's memory.
    `is_adapter`: a LoRA adapter payload, whose load_format None form is a dict {name: tensor} (SGLang's).

    Raises PayloadError (a ValueError) naming the problem for bad base64, a global outside the allow-list, a wrong
    structure, a duplicate name, or flattened-bucket metadata that does not describe its buffer.
    """
    if load_format not in LOAD_FORMATS:
        raise PayloadError(f"unknown load_format {load_format!r}; allowed: {list(LOAD_FORMATS)}")
    if not isinstance(data, str):
        raise PayloadError(f"a serialized payload must be a base64 str, got {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise PayloadError(f"payload is not valid base64: {exc}") from None
    try:
        obj = _RestrictedUnpickler(io.BytesIO(raw)).load()
    except PayloadError:
        raise
    except Exception as exc:  # the bytes are untrusted: any failure to unpickle is the producer's error
        raise PayloadError(f"payload does not unpickle: {type(exc).__name__}: {exc}") from None
    if load_format == "flattened_bucket":
        named = _named_from_flattened(obj)
    elif is_adapter:
        if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
            raise PayloadError(f"an adapter payload must be a dict {{name: tensor}}, got {type(obj).__name__}")
        named = _named_from_pairs(list(obj.items()))
    else:
        named = _named_from_pairs(obj)
    seen: set[str] = set()
    duplicates: set[str] = set()
    for name, _ in named:
        (duplicates if name in seen else seen).add(name)
    if duplicates:
        raise PayloadError(f"payload names tensors more than once: {sorted(duplicates)}")
    return named


# ----------------------------------------------------------------------------------------------------------- encode


def _encode(obj: Any) -> str:
    buf = io.BytesIO()
    _PayloadPickler(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _reduce_storage_to_shared_file(storage: torch.UntypedStorage) -> tuple:
    """torch's file_system strategy, without changing the process-wide sharing strategy."""
    if storage.device.type != "cpu":
        raise ValueError(f"cannot share a {storage.device.type} storage through CPU shared memory")
    manager, handle, size = storage._share_filename_cpu_()
    # A pending reference for the receiver, so the segment outlives this storage until it is opened.
    storage._shared_incref()
    reductions.shared_cache[handle] = reductions.StorageWeakRef(storage)
    return (reductions.rebuild_storage_filename, (type(storage), manager, handle, size))


def _reduce_tensor(tensor: torch.Tensor) -> tuple:
    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor:
        # Name the device by UUID: producer and receiver may number the visible devices differently.
        device_index = args[_CUDA_DEVICE_ARG]
        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        args = (*args[:_CUDA_DEVICE_ARG], uuid, *args[_CUDA_DEVICE_ARG + 1 :])
    return (rebuild, args)


# Position of the device argument of torch's rebuild_cuda_tensor.
_CUDA_DEVICE_ARG = 6


def _load_storage_bytes(data: Any) -> Any:
    """`torch.storage._load_from_bytes` without its unrestricted `torch.load` (as SGLang's unpickler maps it)."""
    if not isinstance(data, bytes):
        raise PayloadError(f"an inline storage must be bytes, got {type(data).__name__}")
    try:
        storage = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise PayloadError(f"an inline storage does not load: {type(exc).__name__}: {exc}") from None
    if not isinstance(storage, torch.TypedStorage):
        raise PayloadError(f"an inline storage must load as a typed storage, got {type(storage).__name__}")
    return storage


def _rebuild_inline_tensor(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, *rest: Any
) -> torch.Tensor:
    """`torch._utils._rebuild_tensor_v2` (a plainly pickled CPU tensor) with its view checked and no hooks."""
    if not isinstance(storage, torch.TypedStorage) or storage.dtype not in (*_WEIGHT_DTYPES, torch.uint8):
        raise PayloadError(f"an inline tensor needs a typed storage of a weight dtype or uint8, got {storage!r:.60}")
    if hooks or rest:
        raise PayloadError("an inline tensor carries no backward hooks or metadata")
    num_elements = storage._untyped_storage.nbytes() // storage.dtype.itemsize
    _check_view("tensor", storage_elements=num_elements, offset=offset, size=size, stride=stride)
    return torch._utils._rebuild_tensor_v2(storage, offset, torch.Size(size), tuple(stride), False, OrderedDict())


class _PayloadPickler(pickle._Pickler):
    """torch's multiprocessing reducers, plus SGLang's class name for our metadata record.

    The pure-Python pickler is used because only it lets the metadata class be written under a module path that
    need not be importable here (sglang is not a dependency); tensor bytes never pass through it.
    """

    dispatch_table = {
        **copyreg.dispatch_table,
        torch.Tensor: _reduce_tensor,
        torch.nn.Parameter: _reduce_tensor,
        torch.storage.TypedStorage: reductions.reduce_typed_storage,
        torch.UntypedStorage: _reduce_storage_to_shared_file,
    }

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is not FlattenedTensorMetadata:
            super().save_global(obj, name)
            return
        self.save(SGLANG_METADATA_MODULE)
        self.save(SGLANG_METADATA_NAME)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


# ----------------------------------------------------------------------------------------------------------- decode


class _ClassToken:
    """Stands in for a class a payload may name only as an argument (never call it): calling it is an error."""

    def __init__(self, qualified_name: str) -> None:
        self.qualified_name = qualified_name

    def __repr__(self) -> str:
        return self.qualified_name


_TENSOR_CLASS = _ClassToken("torch.Tensor")
_PARAMETER_CLASS = _ClassToken("torch.nn.Parameter")
_UNTYPED_STORAGE_CLASS = _ClassToken("torch.UntypedStorage")
_TYPED_STORAGE_CLASS = _ClassToken("torch.TypedStorage")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _checked_dims(value: Any, *, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list, torch.Size)) or len(value) > _MAX_DIMS:
        raise PayloadError(f"{what} must be a sequence of at most {_MAX_DIMS} ints, got {value!r}")
    dims = tuple(value)
    if not all(_is_int(d) and d >= 0 for d in dims):
        raise PayloadError(f"{what} must hold ints >= 0, got {list(dims)}")
    return dims


def _make_size(dims: Any) -> torch.Size:
    return torch.Size(_checked_dims(dims, what="torch.Size"))


def _rebuild_storage_filename(cls: Any, manager: Any, handle: Any, size: Any, dtype: Any = None) -> Any:
    if cls is not _UNTYPED_STORAGE_CLASS or dtype is not None:
        raise PayloadError(f"shared-memory storages must be untyped, got class {cls!r} dtype {dtype!r}")
    if not isinstance(manager, bytes) or not isinstance(handle, bytes) or not _is_int(size) or size < 0:
        raise PayloadError("a shared-memory handle is (manager: bytes, handle: bytes, size: int >= 0)")
    if _SHM_HANDLE.fullmatch(handle) is None:
        raise PayloadError(f"{handle!r} is not a torch shared-memory handle")
    cached = reductions.shared_cache.get(handle)
    if cached is None:
        # Mapping past the end of a segment would fault on first touch: check the segment covers `size`.
        _check_socket(manager)
        try:
            segment_bytes = os.stat(os.path.join(_SHM_DIR, handle[1:].decode("ascii"))).st_size
        except OSError as exc:
            raise PayloadError(f"shared-memory segment {handle!r} cannot be opened: {exc.strerror}") from None
        if segment_bytes < size:
            raise PayloadError(f"shared-memory segment {handle!r} holds {segment_bytes} bytes, payload claims {size}")
    return reductions.rebuild_storage_filename(torch.UntypedStorage, manager, handle, size)


def _check_socket(path: bytes) -> None:
    if not path.endswith(b"/manager.sock"):
        raise PayloadError(f"{path!r} is not a torch shared-memory manager socket")
    try:
        is_socket = stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError as exc:
        raise PayloadError(f"shared-memory manager {path!r} is not reachable: {exc.strerror}") from None
    if not is_socket:
        raise PayloadError(f"{path!r} is not a socket")


def _rebuild_storage_empty(cls: Any) -> torch.UntypedStorage:
    if cls is not _UNTYPED_STORAGE_CLASS:
        raise PayloadError(f"empty storages must be untyped, got class {cls!r}")
    return torch.UntypedStorage()


def _rebuild_typed_storage(storage: Any, dtype: Any) -> torch.TypedStorage:
    if not isinstance(storage, torch.UntypedStorage) or dtype not in _WEIGHT_DTYPES:
        raise PayloadError(f"typed storage needs an untyped storage and a weight dtype, got {dtype!r}")
    return torch.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)


def _check_view(what: str, *, storage_elements: int, offset: Any, size: Any, stride: Any) -> None:
    dims = _checked_dims(size, what=f"{what} size")
    strides = _checked_dims(stride, what=f"{what} stride")
    if not _is_int(offset) or offset < 0 or len(strides) != len(dims):
        raise PayloadError(f"{what}: offset {offset!r} / stride {list(strides)} do not fit size {list(dims)}")
    if 0 in dims:
        return
    last = offset + sum((d - 1) * s for d, s in zip(dims, strides))
    if last >= storage_elements:
        raise PayloadError(f"{what} reaches element {last} of a storage of {storage_elements} elements")


def _rebuild_tensor(cls: Any, storage: Any, metadata: Any) -> torch.Tensor:
    if cls not in (_TENSOR_CLASS, _PARAMETER_CLASS) or not isinstance(storage, torch.TypedStorage):
        raise PayloadError(f"rebuild_tensor needs a tensor class and a typed storage, got {cls!r}")
    if not isinstance(metadata, tuple) or len(metadata) != 4:
        raise PayloadError("rebuild_tensor metadata must be (offset, size, stride, requires_grad)")
    offset, size, stride, _requires_grad = metadata
    # TypedStorage.size() warns about deprecation; the element count follows from the untyped bytes.
    num_elements = storage._untyped_storage.nbytes() // storage.dtype.itemsize
    _check_view("tensor", storage_elements=num_elements, offset=offset, size=size, stride=stride)
    # Received weights never carry autograd state.
    metadata = (offset, torch.Size(size), tuple(stride), False)
    return reductions.rebuild_tensor(torch.Tensor, storage, metadata)


def _device_index(device: Any) -> int:
    if _is_int(device):
        return device
    if isinstance(device, str):
        for index in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(index).uuid) == device:
                return index
        raise PayloadError(f"no visible CUDA device has UUID {device}")
    raise PayloadError(f"a CUDA device is an index or a UUID, got {device!r}")


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    if not torch.cuda.is_available():
        raise PayloadError("payload holds CUDA IPC handles but this process has no CUDA device")
    if len(args) != 15:
        raise PayloadError(f"rebuild_cuda_tensor takes 15 arguments, got {len(args)}")
    tensor_cls, size, stride, offset, storage_cls, dtype = args[:6]
    if tensor_cls not in (_TENSOR_CLASS, _PARAMETER_CLASS) or storage_cls is not _TYPED_STORAGE_CLASS:
        raise PayloadError(f"rebuild_cuda_tensor got classes {tensor_cls!r}, {storage_cls!r}")
    if dtype not in _WEIGHT_DTYPES:
        raise PayloadError(f"rebuild_cuda_tensor got dtype {dtype!r}")
    storage_bytes = args[8]
    if not _is_int(storage_bytes) or storage_bytes < 0:
        raise PayloadError(f"rebuild_cuda_tensor got storage size {storage_bytes!r}")
    num_elements = storage_bytes // dtype.itemsize
    _check_view("CUDA tensor", storage_elements=num_elements, offset=offset, size=size, stride=stride)
    rebuilt = (
        torch.Tensor,
        torch.Size(size),
        tuple(stride),
        offset,
        torch.storage.TypedStorage,
        dtype,
        _device_index(args[6]),
        *args[7:10],
        False,
        *args[11:],
    )
    return reductions.rebuild_cuda_tensor(*rebuilt)


_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): _rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): _rebuild_storage_filename,
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"): _rebuild_storage_empty,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): _rebuild_typed_storage,
    ("torch", "Tensor"): _TENSOR_CLASS,
    ("torch._tensor", "Tensor"): _TENSOR_CLASS,
    ("torch.nn.parameter", "Parameter"): _PARAMETER_CLASS,
    ("torch", "UntypedStorage"): _UNTYPED_STORAGE_CLASS,
    ("torch.storage", "UntypedStorage"): _UNTYPED_STORAGE_CLASS,
    ("torch", "TypedStorage"): _TYPED_STORAGE_CLASS,
    ("torch.storage", "TypedStorage"): _TYPED_STORAGE_CLASS,
    ("torch", "Size"): _make_size,
    ("torch.storage", "_load_from_bytes"): _load_storage_bytes,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_inline_tensor,
    ("collections", "OrderedDict"): OrderedDict,
    (SGLANG_METADATA_MODULE, SGLANG_METADATA_NAME): FlattenedTensorMetadata,
    **{("torch", dtype_name(dtype)): dtype for dtype in _WEIGHT_DTYPES},
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED_GLOBALS.get((module, name))
        if found is None:
            raise PayloadError(f"payload names {module}.{name}, which is outside the allow-list of tensor payloads")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise PayloadError("payload uses persistent ids, which tensor payloads never contain")


def _named_from_pairs(obj: Any) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(obj, (list, tuple)):
        raise PayloadError(f"payload must be a list of (name, tensor) pairs, got {type(obj).__name__}")
    named = []
    for index, pair in enumerate(obj):
        if (
            not isinstance(pair, (list, tuple))
            or len(pair) != 2
            or not isinstance(pair[0], str)
            or not isinstance(pair[1], torch.Tensor)
        ):
            raise PayloadError(f"payload entry {index} is not a (name, tensor) pair")
        named.append((pair[0], pair[1]))
    return named


def _named_from_flattened(obj: Any) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
        keys = sorted(map(repr, obj)) if isinstance(obj, dict) else type(obj).__name__
        raise PayloadError(
            f"flattened_bucket payload must be a dict with 'flattened_tensor' and 'metadata', got {keys}"
        )
    buffer, metadata = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise PayloadError("flattened_tensor must be a 1-D uint8 tensor")
    if not buffer.is_contiguous():
        raise PayloadError("flattened_tensor must be contiguous")
    if not isinstance(metadata, list):
        raise PayloadError(f"metadata must be a list, got {type(metadata).__name__}")
    _check_flattened_ranges(buffer, metadata)
    named = []
    for meta in metadata:
        piece = buffer[meta.start_idx : meta.end_idx]
        named.append((meta.name, piece.view(meta.dtype).reshape(meta.shape)))
    return named


def _check_flattened_ranges(buffer: torch.Tensor, metadata: list[Any]) -> None:
    for index, meta in enumerate(metadata):
        if not isinstance(meta, FlattenedTensorMetadata) or not all(hasattr(meta, f) for f in _METADATA_FIELDS):
            raise PayloadError(f"metadata entry {index} is not a complete FlattenedTensorMetadata record")
        if meta.dtype not in _WEIGHT_DTYPES:
            raise PayloadError(f"tensor {meta.name!r} has unsupported dtype {meta.dtype}")
        expected = meta.dtype.itemsize
        for d in meta.shape:
            expected *= d
        if meta.numel != expected or meta.end_idx - meta.start_idx != expected:
            raise PayloadError(
                f"tensor {meta.name!r}: shape {list(meta.shape)} of {meta.dtype} is {expected} bytes, but metadata "
                f"says numel={meta.numel} and range [{meta.start_idx}, {meta.end_idx})"
            )
        if meta.end_idx > buffer.numel():
            raise PayloadError(
                f"tensor {meta.name!r} ends at byte {meta.end_idx}, past the buffer's {buffer.numel()} bytes"
            )
        if (buffer.storage_offset() + meta.start_idx) % meta.dtype.itemsize != 0:
            raise PayloadError(
                f"Unaligned received tensor {meta.name!r}: byte offset {meta.start_idx} is not a multiple of "
                f"the itemsize {meta.dtype.itemsize} of {str(meta.dtype).removeprefix('torch.')}"
            )
