"""Sever a cut-off peer host: close this process's TCP connections to it, so no byte of it lands here.

Why (measured, ``benchmarks/probes/late_put_after_remove.py``; NIXL 1.5.1, UCX over TCP, two network
namespaces): a producer's WRITE queued in TCP when its link went down lands in the consumer's
registered memory when the link comes back, also after the consumer removed the producer's NIXL agent
(``remove_remote_agent``: 15.3 of 16 MiB landed after it) and after it deregistered that memory (15.3
MiB): UCX's TCP transport writes a PUT's payload straight to the address in its header (``uct_tcp_ep
_handle_put_req`` / ``_progress_put_rx``: no check against a registration), and removing the remote agent
only closes the consumer's UCP endpoint (``nixlUcxEngine::disconnect``), not the socket that carries the
producer's PUTs. What does stop them: ``shutdown()`` of the consumer's TCP socket to the producer's
host. UCX then reads what the kernel already received (it lands at once), sees the end of the stream,
fails its endpoint and closes the socket (19 ms in the probe); once no socket to that host is left, a
late segment finds no socket (the kernel answers it with a reset): 0 bytes landed after it, and the
producer's request ended ``NIXL_ERR_REMOTE_DISCONNECT``. A peer of this host's own addresses (same
network namespace, loopback) may be reached by CMA or shared memory, which no socket carries:
:func:`remote_host` says None there and nothing is severed.

Every TCP socket of this process to that host is shut down (UCX's, and side-channel connections to any
agent there): use it only for a host already given up.
"""

from __future__ import annotations

import ipaddress
import os
import socket


def remote_host(host: str) -> str | None:
    """``host`` (an IP address) when it is another host's, None when it is one of this network
    namespace's own addresses (or not an IP address): there no socket alone carries its bytes."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.is_loopback or ip.is_unspecified:
        return None
    fam = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    with socket.socket(fam, socket.SOCK_DGRAM) as s:  # no packet is sent: the route picks the source
        try:
            s.connect((host, 9))
        except OSError:
            return str(ip)
        return None if ipaddress.ip_address(s.getsockname()[0]) == ip else str(ip)


def _sockets_to(host: str) -> dict[int, str]:
    """This process's connected TCP sockets whose peer is ``host``: file descriptor → socket inode."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
            if not link.startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6) \
                    and s.getpeername()[0] == host:
                out[int(name)] = link
        except OSError:
            pass
        finally:
            s.close()
    return out


def socket_inodes(host: str) -> frozenset[str]:
    """The sockets (``socket:[inode]``) of this process connected to ``host`` now."""
    return frozenset(_sockets_to(host).values())


def shut(host: str) -> frozenset[str]:
    """Shut down (both ways) every TCP socket of this process to ``host``; returns those sockets. Their
    owners (UCX's progress, the side channel's reader) see the end of the stream and close them; once none
    of them is in :func:`socket_inodes` any more, no byte sent on them can land."""
    fds = _sockets_to(host)
    for fd in fds:
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.close()
    return frozenset(fds.values())
