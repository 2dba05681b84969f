"""The one place that reads environment variables and decides addresses. Every variable of ours has the MILES_SYNC_
prefix and a typed parser.

Addresses default to loopback: nothing in miles_sync binds a public interface unless the user asks for it. On a
cluster every listener binds the address of the node it runs on (`bind_host`), and the network interface that
gloo and NCCL pick for their sockets is derived from that address here (`socket_interface_env`), nowhere else.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass, field
from urllib.parse import urlsplit

PREFIX = "MILES_SYNC_"
LOOPBACK_HOST = "127.0.0.1"
# torch's gloo and NCCL read these (once, when they create a device) to choose the interface their sockets use.
SOCKET_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's (primary) IPv4 address
_IF_INET6 = "/proc/net/if_inet6"  # Linux: every IPv6 address with its interface
# The reference engine's API key travels to the server process in its environment, not on its command line: any
# local user can read a command line (/proc/PID/cmdline), only the owner can read an environment.
ENGINE_API_KEY_VARIABLE = PREFIX + "ENGINE_API_KEY"
ENGINE_ADMIN_API_KEY_VARIABLE = PREFIX + "ENGINE_ADMIN_API_KEY"  # the same, for the admin routes' key
# Set in a CPU SGLang server's environment: its venv's .pth file then loads launch/sglang_cpu's import shims.
CPU_SHIM_VARIABLE = PREFIX + "SGLANG_CPU_SHIM"


def _read_str(name: str, default: str) -> str:
    value = os.environ.get(PREFIX + name)
    return default if value is None else value


def _read_float(name: str, default: float) -> float:
    value = os.environ.get(PREFIX + name)
    if value is None:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{PREFIX}{name}={value!r} is not a number") from None


@dataclass(frozen=True, kw_only=True)
class Environment:
    """Process-wide settings taken from the environment at call time."""

    host: str
    http_timeout_s: float
    collective_timeout_s: float
    cache_dir: str  # generated reference checkpoints and other reusable artifacts
    engine_api_key: str | None = field(default=None, repr=False)  # a secret: never in a repr
    engine_admin_api_key: str | None = field(default=None, repr=False)  # a secret: never in a repr


def read_environment() -> Environment:
    return Environment(
        host=_read_str("HOST", LOOPBACK_HOST),
        http_timeout_s=_read_float("HTTP_TIMEOUT_S", 60.0),
        collective_timeout_s=_read_float("COLLECTIVE_TIMEOUT_S", 120.0),
        cache_dir=os.path.expanduser(_read_str("CACHE_DIR", "~/.cache/miles_sync")),
        engine_api_key=os.environ.get(ENGINE_API_KEY_VARIABLE),
        engine_admin_api_key=os.environ.get(ENGINE_ADMIN_API_KEY_VARIABLE),
    )


def bind_host(*, override: str | None = None, node_ip: str | None = None) -> str:
    """The address this process's servers, stores and process groups bind: `override` (the job's explicit
    `cluster.bind_host`) when given, else `node_ip` (the Ray node the process runs on, as the actor shell read it
    from `ray.util.get_node_ip_address()`), else MILES_SYNC_HOST, else 127.0.0.1. A single-node local cluster runs
    on 127.0.0.1, so everything stays on loopback there. Raises ValueError for a value that is not an IP address
    (or "localhost"); a wildcard (0.0.0.0, ::) is honoured only as an explicit override or MILES_SYNC_HOST."""
    for what, value in (("cluster.bind_host", override), ("node IP", node_ip)):
        if value is not None:
            return _checked_address(value, what=what, allow_wildcard=what == "cluster.bind_host")
    return _checked_address(read_environment().host, what=PREFIX + "HOST", allow_wildcard=True)


def configured_host() -> str | None:
    """MILES_SYNC_HOST when set: the address this process was told to bind (an actor shell adopts its node's)."""
    value = os.environ.get(PREFIX + "HOST")
    return None if value is None else _checked_address(value, what=PREFIX + "HOST", allow_wildcard=True)


def adopt_bind_host(host: str) -> None:
    """Make `host` this process's bind address: MILES_SYNC_HOST (read by `bind_host` and every group this process
    or its children create) and the gloo/NCCL interface variables derived from it. Call it first thing in a
    process (an actor's constructor), before any process group exists; children started later inherit it."""
    os.environ[PREFIX + "HOST"] = host
    try:
        os.environ.update(socket_interface_env(host))
    except ValueError:
        # No interface reports it as its primary address (a secondary address, or a NAT'd one): the groups
        # miles_sync creates still bind `host` explicitly; the libraries choose for the rest.
        pass


def is_wildcard(address: str) -> bool:
    """True for an address that means every interface (0.0.0.0, ::)."""
    try:
        return ipaddress.ip_address(address.strip("[]")).is_unspecified
    except ValueError:
        return False


def is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def socket_interface(address: str) -> str | None:
    """The name of the network interface that carries `address` on this machine: the loopback interface for any
    loopback address (all of 127.0.0.0/8 is loopback on Linux), None for a wildcard. Raises ValueError when no
    interface of this machine has the address (it belongs to another machine)."""
    address = address.strip("[]")
    if address == "localhost":
        address = LOOPBACK_HOST
    if is_wildcard(address):
        return None
    parsed = ipaddress.ip_address(address)
    if parsed.is_loopback:
        parsed = ipaddress.ip_address(LOOPBACK_HOST if parsed.version == 4 else "::1")
    found = _interfaces_v4().get(parsed) if parsed.version == 4 else _interfaces_v6().get(parsed)
    if found is None:
        if parsed.is_loopback:
            return "lo"  # no ioctl/procfs answer (a sandbox): Linux names its loopback interface lo
        raise ValueError(f"no network interface of this machine has the address {address}")
    return found


def socket_interface_env(address: str) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME for a process whose groups bind `address` (empty for a wildcard:
    the libraries choose). Pass them into the process's environment before it creates any process group."""
    interface = socket_interface(address)
    return {} if interface is None else dict.fromkeys(SOCKET_INTERFACE_VARIABLES, interface)


def node_of_url(url: str) -> str:
    """The address an http URL names ("http://10.0.0.3:30000" -> "10.0.0.3", "localhost" -> 127.0.0.1): an engine's
    node, since engines serve at their node's address. A host name is returned as written."""
    host = urlsplit(url).hostname
    if host is None:
        raise ValueError(f"URL {url!r} names no host")
    if host == "localhost":
        return LOOPBACK_HOST
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def _checked_address(value: str, *, what: str, allow_wildcard: bool) -> str:
    value = value.strip()
    if value == "localhost":
        return LOOPBACK_HOST
    try:
        address = str(ipaddress.ip_address(value.strip("[]")))
    except ValueError:
        raise ValueError(f"{what}={value!r} is not an IP address") from None
    if is_wildcard(address) and not allow_wildcard:
        raise ValueError(f"{what}={value!r} binds every interface; only an explicit cluster.bind_host may do that")
    return address


def _interfaces_v4() -> dict[ipaddress.IPv4Address, str]:
    """Each interface's primary IPv4 address (SIOCGIFADDR), interfaces in index order."""
    found: dict[ipaddress.IPv4Address, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # down, or no IPv4 address
                continue
            found.setdefault(ipaddress.IPv4Address(answer[20:24]), name)
    return found


def _interfaces_v6() -> dict[ipaddress.IPv6Address, str]:
    found: dict[ipaddress.IPv6Address, str] = {}
    try:
        with open(_IF_INET6) as table:
            for line in table:
                fields = line.split()
                if len(fields) == 6:
                    found.setdefault(ipaddress.IPv6Address(bytes.fromhex(fields[0])), fields[5])
    except OSError:
        pass
    return found
