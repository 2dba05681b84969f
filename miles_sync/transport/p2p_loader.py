"""The engine side of the p2p transport: a custom weight loader SGLang runs in each TP rank's own process.

An SGLang 0.5.23 server started with `--custom-weight-loader miles_sync.transport.p2p_loader.load_routed` accepts
`update_weights_from_tensor` with `load_format` set to that import path and calls `load_routed(model,
named_tensors)` on every TP rank with that rank's own payload (`serialized_named_tensors[tp_rank]`), inside the
usual update session. The payload is a ticket: one uint8 tensor (`TICKET_NAME`) holding a JSON `Ticket`: the
channel (an update group of the trainer ranks and this engine's TP ranks) and which of this rank's engine
parameters arrive from which trainer rank. Per call the loader:

    joins the channel the first time a ticket names it (its own TCP rendezvous, with the ticket's timeout:
    miles_sync.transport.group), and reuses it after (one channel per slot: a trainer with pipeline stages feeds
    each stage's layers over the stage's own channel);
    receives every parameter straight into the model's own tensor (`model.get_parameter(name)`, where it is
    contiguous, on the channel's device and of the ticket's shape and dtype; else into a buffer copied in after
    its check), every transfer posted at once, then from each source one tensor of digests (SHA-256 of each
    parameter's bytes, in the ticket's order);
    checks every digest and answers each source with one `Status` (checked count, first refused index, why).

SGLang ignores what a custom loader returns, and an exception raised in it ends the scheduler and with it the
whole server, so `load_routed` never raises: a failure is logged, kept (`last_error`) and answered through the
channel where that still works; a channel whose transfer failed is destroyed (the trainer ranks see their own
transfers fail within their timeouts) and joined again from the next ticket. A ticket with `close` set destroys
the channel. Parameters whose digest did not match have already been written: the trainer side fails the sync,
so the engine is held (never resumed on those bytes) until a later sync verifies it.

Imports torch and light miles_sync modules only (no transformers, megatron, HTTP or Ray), so an SGLang server's
venv can import it: launch/install_sglang.sh installs miles_sync there without its dependencies, and an
import-linter contract keeps this module light.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

from miles_sync.transport.group import UpdateGroup, create_update_group

__all__: list[str] = []  # SGLang reaches `load_routed` by its import path (LOADER_PATH); the p2p transport and
# the engine launchers import what they need by name

logger = logging.getLogger(__name__)

LOADER_PATH = "miles_sync.transport.p2p_loader.load_routed"  # what `--custom-weight-loader` and load_format name
TICKET_NAME = "miles_sync.p2p_ticket"
TICKET_VERSION = 1
DIGEST_BYTES = 32  # SHA-256
STATUS_FIELDS = 3  # checked, first refused index (-1: none), Refusal


class Refusal(enum.IntEnum):
    """Why an engine rank refused a parameter (the status' third field)."""

    NONE = 0
    DIGEST = 1  # the bytes received do not hash to the digest their source sent after them
    UNKNOWN = 2  # the model has no parameter of that name
    SHAPE = 3  # the model's parameter has another shape or dtype than the ticket's

    def describe(self) -> str:
        return {
            Refusal.NONE: "accepted",
            Refusal.DIGEST: "its bytes do not match the digest sent with them",
            Refusal.UNKNOWN: "the engine has no parameter of that name",
            Refusal.SHAPE: "the engine's parameter has another shape or dtype",
        }[self]


class DirectModel(Protocol):
    """What the loader needs of the model SGLang hands it: each engine parameter by its name (torch.nn.Module's
    `get_parameter`; the reference engine passes a view of its own storage with the same method)."""

    def get_parameter(self, target: str) -> torch.Tensor: ...


# ---- the ticket -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ChannelSpec:
    """The update group a ticket's parameters travel over; `rank` is the receiving engine rank's own rank in it.
    `slot`: which of the fleet's senders the channel serves (each pipeline stage feeds the engine its own layers
    over a channel of its own: the stage's export source rank); an engine rank keeps one channel per slot."""

    group_name: str
    master_address: str
    master_port: int
    world_size: int
    rank: int
    backend: str = "gloo"
    timeout_s: float = 60.0
    slot: int = 0


@dataclass(frozen=True, kw_only=True)
class ParamTicket:
    """One engine parameter (this rank's own tensor of it), sent whole by trainer rank `source` (its group rank)."""

    name: str
    source: int
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "bfloat16"

    @property
    def num_bytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=_dtype(self.dtype)).element_size()


@dataclass(frozen=True, kw_only=True)
class Ticket:
    channel: ChannelSpec
    params: tuple[ParamTicket, ...] = ()
    close: bool = False

    def by_source(self) -> dict[int, list[ParamTicket]]:
        """The parameters per source rank, each list in ticket order (the order its source sends them in)."""
        out: dict[int, list[ParamTicket]] = defaultdict(list)
        for param in self.params:
            out[param.source].append(param)
        return dict(out)


def encode_ticket(ticket: Ticket) -> torch.Tensor:
    """The ticket as the one uint8 tensor a payload carries (name it TICKET_NAME)."""
    record = {"version": TICKET_VERSION, **asdict(ticket)}
    return torch.frombuffer(bytearray(json.dumps(record).encode()), dtype=torch.uint8)


def decode_ticket(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> Ticket:
    """The ticket of one rank's payload. Raises ValueError naming what is wrong."""
    names = [name for name, _ in named_tensors]
    if names != [TICKET_NAME]:
        raise ValueError(f"a p2p payload holds exactly one tensor named {TICKET_NAME!r}; got {names}")
    tensor = named_tensors[0][1]
    if tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise ValueError(f"the ticket must be a 1-D uint8 tensor, got {tensor.dtype} of shape {list(tensor.shape)}")
    try:
        record = json.loads(bytes(tensor.cpu().numpy()))
        version = record.pop("version")
        if version != TICKET_VERSION:
            raise ValueError(f"ticket version {version}; this loader reads version {TICKET_VERSION}")
        params = tuple(
            ParamTicket(
                name=p["name"], source=int(p["source"]), shape=tuple(int(d) for d in p["shape"]), dtype=p["dtype"]
            )
            for p in record.pop("params")
        )
        ticket = Ticket(channel=ChannelSpec(**record.pop("channel")), params=params, close=bool(record.pop("close")))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"the ticket does not decode: {type(exc).__name__}: {exc}") from None
    if record:
        raise ValueError(f"the ticket has unknown fields {sorted(record)}")
    for param in ticket.params:
        _dtype(param.dtype)
        if not 0 <= param.source < ticket.channel.world_size or param.source == ticket.channel.rank:
            raise ValueError(f"{param.name}: source rank {param.source} is not a peer in the channel")
    return ticket


# ---- what travels besides the parameters --------------------------------------------------------------------------


def digest_bytes(tensor: torch.Tensor) -> bytes:
    """SHA-256 of a tensor's bytes (contiguous, any dtype or device)."""
    data = tensor.detach().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.cpu().numpy() if data.device.type != "cpu" else data.numpy()).digest()


def digests_tensor(tensors: Iterable[torch.Tensor], *, device: torch.device) -> torch.Tensor:
    """What a source sends after its parameters: their digests, concatenated."""
    blob = b"".join(digest_bytes(t) for t in tensors)
    return (
        torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device) if blob else torch.empty(0, dtype=torch.uint8)
    )


@dataclass(frozen=True, kw_only=True)
class Status:
    """An engine rank's answer to one source for one ticket: how many of its parameters it checked, the index (in
    that source's list) of the first it refused, and why."""

    checked: int
    refused_index: int = -1
    refusal: Refusal = Refusal.NONE

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([self.checked, self.refused_index, int(self.refusal)], dtype=torch.int64, device=device)

    @classmethod
    def empty(cls, device: torch.device) -> torch.Tensor:
        return torch.zeros(STATUS_FIELDS, dtype=torch.int64, device=device)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> Status:
        checked, index, refusal = (int(v) for v in tensor.cpu().tolist())
        return cls(checked=checked, refused_index=index, refusal=Refusal(refusal))


def send_params(
    group: UpdateGroup,
    per_rank: Mapping[int, Sequence[torch.Tensor]],
    *,
    timeout_s: float,
    digests: Mapping[int, bytes | None] | None = None,
) -> dict[int, Status]:
    """The sending side of one ticket: to each engine rank r (its group rank) the parameters `per_rank[r]` in its
    ticket's order, then their digests (`digests[r]`, their SHA-256 concatenated, where the caller hashed them
    already; else hashed here), all posted at once; then every rank's status. Raises TimeoutError or RuntimeError
    when a transfer fails (the group is unusable after)."""
    known = digests or {}
    sends = {r: [*tensors, _digests_of(tensors, known.get(r), device=group.device)] for r, tensors in per_rank.items()}
    group.exchange(sends=sends, timeout_s=timeout_s)
    statuses = {r: Status.empty(group.device) for r in per_rank}
    group.exchange(recvs={r: [t] for r, t in statuses.items()}, timeout_s=timeout_s)
    return {r: Status.from_tensor(t) for r, t in statuses.items()}


def _digests_of(tensors: Sequence[torch.Tensor], known: bytes | None, *, device: torch.device) -> torch.Tensor:
    if known is None or not tensors:
        return digests_tensor(tensors, device=device)
    if len(known) != DIGEST_BYTES * len(tensors):
        raise ValueError(f"{len(known)} digest bytes for {len(tensors)} parameters ({DIGEST_BYTES} each)")
    return torch.frombuffer(bytearray(known), dtype=torch.uint8).to(device)


# ---- the receiver ---------------------------------------------------------------------------------------------------


@dataclass
class _Target:
    ticket: ParamTicket
    buffer: torch.Tensor  # where the bytes land: the parameter itself, or a buffer of the ticket's shape
    param: torch.Tensor | None  # the parameter to copy `buffer` into after its check (None: received in place)
    refusal: Refusal = Refusal.NONE


@dataclass
class Receiver:
    """One TP rank's channels and last error (a process runs one: SGLang calls the loader on its scheduler thread)."""

    channels: dict[str, tuple[ChannelSpec, UpdateGroup]] = field(default_factory=dict)
    last_error: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def load(self, model: DirectModel, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> list[Status]:
        """Handle one payload (module docstring); returns the statuses sent, per source in rank order. Raises
        nothing SGLang would die on: every failure is logged and kept in `last_error`."""
        with self.lock:
            try:
                ticket = decode_ticket(named_tensors)
            except Exception as exc:
                return self._failed(f"refused a payload: {exc}")
            if ticket.close:
                self._drop(ticket.channel.group_name)
                self.last_error = None
                return []
            try:
                group = self._join(ticket.channel)
            except Exception as exc:
                return self._failed(f"could not join channel {ticket.channel.group_name!r}: {exc}")
            try:
                statuses = self._receive(model, ticket, group)
            except Exception as exc:
                self._drop(ticket.channel.group_name)
                return self._failed(f"channel {ticket.channel.group_name!r} failed; dropped it: {exc}")
            refused = [s for s in statuses.values() if s.refusal is not Refusal.NONE]
            self.last_error = None if not refused else f"refused {len(refused)} source(s)' parameters"
            return [statuses[source] for source in sorted(statuses)]

    def close(self) -> None:
        with self.lock:
            for name in list(self.channels):
                self._drop(name)

    def _failed(self, message: str) -> list[Status]:
        logger.error("p2p loader: %s", message)
        self.last_error = message
        return []

    def _join(self, spec: ChannelSpec) -> UpdateGroup:
        known = self.channels.get(spec.group_name)
        if known is not None and known[0] == spec and known[1].is_usable:
            return known[1]
        for name, (known_spec, _) in list(self.channels.items()):
            if known_spec.slot == spec.slot:  # one fleet per engine rank: a slot's channel no longer named is done
                self._drop(name)
        group = create_update_group(
            master_address=spec.master_address,
            master_port=spec.master_port,
            rank=spec.rank,
            world_size=spec.world_size,
            group_name=spec.group_name,
            backend=spec.backend,
            timeout_s=spec.timeout_s,
        )
        self.channels[spec.group_name] = (spec, group)
        return group

    def _drop(self, group_name: str) -> None:
        known = self.channels.pop(group_name, None)
        if known is not None:
            known[1].destroy()

    def _receive(self, model: DirectModel, ticket: Ticket, group: UpdateGroup) -> dict[int, Status]:
        by_source = ticket.by_source()
        targets = {source: [_target(model, p, group.device) for p in params] for source, params in by_source.items()}
        digests = {
            source: torch.empty(DIGEST_BYTES * len(params), dtype=torch.uint8, device=group.device)
            for source, params in by_source.items()
        }
        recvs = {source: [*(t.buffer for t in ts), digests[source]] for source, ts in targets.items()}
        group.exchange(recvs=recvs, timeout_s=ticket.channel.timeout_s)
        statuses = {source: _check(ts, bytes(digests[source].cpu().numpy())) for source, ts in targets.items()}
        for status, ts in zip(statuses.values(), targets.values()):
            if status.refusal is Refusal.NONE:
                for t in ts:
                    if t.param is not None:
                        t.param.copy_(t.buffer)
            else:
                bad = ts[status.refused_index].ticket
                logger.error("p2p loader: refused %s from rank %d: %s", bad.name, bad.source, status.refusal.describe())
        group.exchange(
            sends={source: [status.to_tensor(group.device)] for source, status in statuses.items()},
            timeout_s=ticket.channel.timeout_s,
        )
        return statuses


def _target(model: DirectModel, ticket: ParamTicket, device: torch.device) -> _Target:
    dtype = _dtype(ticket.dtype)
    try:
        param = model.get_parameter(ticket.name)
    except AttributeError:
        param = None
    if param is None:
        return _Target(ticket=ticket, buffer=_empty(ticket, device), param=None, refusal=Refusal.UNKNOWN)
    data = param.data if isinstance(param, torch.nn.Parameter) else param
    if tuple(data.shape) != ticket.shape or data.dtype != dtype:
        return _Target(ticket=ticket, buffer=_empty(ticket, device), param=None, refusal=Refusal.SHAPE)
    if data.is_contiguous() and data.device == device:
        return _Target(ticket=ticket, buffer=data, param=None)
    return _Target(ticket=ticket, buffer=_empty(ticket, device), param=data)


def _check(targets: Sequence[_Target], digests: bytes) -> Status:
    for index, target in enumerate(targets):
        refusal = target.refusal
        if (
            refusal is Refusal.NONE
            and digest_bytes(target.buffer) != digests[index * DIGEST_BYTES : (index + 1) * DIGEST_BYTES]
        ):
            refusal = Refusal.DIGEST
        if refusal is not Refusal.NONE:
            return Status(checked=index, refused_index=index, refusal=refusal)
    return Status(checked=len(targets))


def _empty(ticket: ParamTicket, device: torch.device) -> torch.Tensor:
    return torch.empty(ticket.shape, dtype=_dtype(ticket.dtype), device=device)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


_RECEIVER = Receiver()


def load_routed(model: DirectModel, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader entry point (LOADER_PATH): one TP rank's ticket. Never raises."""
    _RECEIVER.load(model, named_tensors)


def last_error() -> str | None:
    """What the last call of this process's loader failed on (None after one that succeeded)."""
    return _RECEIVER.last_error
