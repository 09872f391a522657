"""Probe (issue 27 fence): after a consumer removes a cut-off producer's NIXL agent, can the producer's
queued WRITE bytes still land in the consumer's registered memory over UCX TCP?

Two network namespaces (testkit.netns), each side in a PID namespace of its own, UCX_TLS=tcp, raw NIXL.
The producer posts one WRITE of SIZE bytes into the consumer's buffer over an 8 Mbit/s link; after 1.5 s the
link goes down; the consumer then does ACTION (none | remove | dereg | remove+dereg), waits; the link comes
back (and the rate limit goes) with the producer still progressing its request; the consumer counts the
bytes of its buffer that changed after ACTION (every byte compared). SAME_HOST=1: both processes in one
namespace (UCX may use CMA), the producer SIGSTOPped right after it posted and resumed later. Run as root:
  PYTHONPATH=. python3 benchmarks/probes/late_put_after_remove.py remove
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

SIZE = int(os.environ.get("SIZE_MIB", "16")) << 20
SAME_HOST = os.environ.get("SAME_HOST") == "1"  # both in this namespace, UCX picks CMA; the producer is SIGSTOPped


PEER_IP = "127.0.0.1" if SAME_HOST else "10.90.0.1"


def _sockets_to(ip: str) -> list[int]:
    """This process's TCP sockets connected to ``ip``."""
    import socket

    out = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.family == socket.AF_INET and s.type == socket.SOCK_STREAM and s.getpeername()[0] == ip:
                out.append(fd)
        except OSError:
            pass
        finally:
            s.close()
    return out


def _shut(fd: int) -> None:
    import socket

    s = socket.socket(fileno=os.dup(fd))
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


def side(role: str, d: str, action: str) -> None:  # runs inside a namespace
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    ag = nixl_agent(role, nixl_agent_config(backends=["UCX"]))
    buf = np.full(SIZE, 0xAB if role == "p" else 0, dtype=np.uint8)
    reg = ag.register_memory(np.array([[buf.ctypes.data, SIZE, 0]], dtype=np.uint64), "DRAM")
    open(f"{d}/{role}.md", "wb").write(ag.get_agent_metadata())
    other = "c" if role == "p" else "p"
    while not os.path.exists(f"{d}/{other}.md"):
        time.sleep(0.05)
    time.sleep(0.2)
    ag.add_remote_agent(open(f"{d}/{other}.md", "rb").read())
    log = lambda **k: print(json.dumps({"role": role, "t": round(time.time(), 2), **k}), flush=True)
    if role == "p":
        descs = ag.get_xfer_descs(np.array([[buf.ctypes.data, SIZE, 0]], dtype=np.uint64), "DRAM")
        while not os.path.exists(f"{d}/c.addr"):
            time.sleep(0.05)
        caddr = int(open(f"{d}/c.addr").read())
        rdescs = ag.get_xfer_descs(np.array([[caddr, SIZE, 0]], dtype=np.uint64), "DRAM")
        h = ag.initialize_xfer("WRITE", descs, rdescs, "c", b"")
        open(f"{d}/p.pid", "w").write(str(os.getpid()))
        log(post=ag.transfer(h))
        open(f"{d}/posted", "w").write("1")
        end = time.time() + 120
        st = "PROC"
        while time.time() < end and not os.path.exists(f"{d}/stop"):
            try:
                st = ag.check_xfer_state(h)
            except Exception as e:  # noqa: BLE001
                st = f"raise {e}"
            if st != "PROC":
                break
            time.sleep(0.05)
        log(state=st)
        while not os.path.exists(f"{d}/stop"):
            time.sleep(0.1)
        return
    open(f"{d}/c.addr", "w").write(str(buf.ctypes.data))
    while not os.path.exists(f"{d}/act"):
        ag.get_new_notifs()
        time.sleep(0.01)
    changed_before = int((buf != 0).sum())
    snap = buf.copy()
    if "remove" in action:
        t = time.time()
        ag.remove_remote_agent("p")
        log(removed_s=round(time.time() - t, 3))
    if "dereg" in action:
        ag.deregister_memory(reg)
        log(deregistered=True)
    if "shutdown" in action:
        t = time.time()
        fds = _sockets_to(PEER_IP)
        for fd in fds:
            _shut(fd)
        while _sockets_to(PEER_IP) and time.time() - t < 10:
            ag.get_new_notifs()
            time.sleep(0.01)
        snap = buf.copy()  # what landed until the sockets were gone counts as before
        log(shut=len(fds), left=len(_sockets_to(PEER_IP)), closed_s=round(time.time() - t, 3))
    open(f"{d}/acted", "w").write(str(changed_before))
    while not os.path.exists(f"{d}/stop"):
        ag.get_new_notifs()
        time.sleep(0.01)
    late = int((buf != snap).sum())
    log(landed_before_action=changed_before, landed_after_action=late)


def _wait(path: str, procs) -> None:
    end = time.time() + 60
    while not os.path.exists(path):
        if time.time() > end or any(p.poll() is not None for p in procs):
            raise SystemExit(f"no {path}")
        time.sleep(0.05)


def main(action: str) -> None:
    sys.path.insert(0, os.getcwd())
    from testkit.netns import Network

    d = f"/tmp/probe-{os.getpid()}"
    os.makedirs(d)
    with Network(2, subnet=90) as net:
        a, b = net.hosts
        env = dict(os.environ, UCX_TLS="tcp", NIXL_LOG_LEVEL="WARN")
        if SAME_HOST:
            env.pop("UCX_TLS")
        run = lambda h, r: subprocess.Popen(
            ([] if SAME_HOST else ["ip", "netns", "exec", h.ns, "unshare", "--pid", "--fork"])
            + [sys.executable, __file__, "--side", r, d, action], env=env)
        net.rate_limit(b, "8mbit")
        procs = [run(b, "c"), run(a, "p")]
        if SAME_HOST:  # stop the producer as soon as it posted (its CMA writes are its own system calls)
            _wait(f"{d}/p.pid", procs)
            ppid = int(open(f"{d}/p.pid").read())
            while not os.path.exists(f"{d}/posted"):
                pass
            os.kill(ppid, signal.SIGSTOP)
            print("producer stopped", flush=True)
        else:
            _wait(f"{d}/posted", procs)
            time.sleep(1.5)
            net.link_down(b)
            print("link down", flush=True)
        time.sleep(1.0)
        open(f"{d}/act", "w").write("1")
        _wait(f"{d}/acted", procs)
        time.sleep(float(os.environ.get("DOWN_S", "5")))
        net.link_up(b)
        net.unlimit(b)
        if SAME_HOST:
            os.kill(ppid, signal.SIGCONT)
        print("link up, unlimited (same host: producer resumed)", flush=True)
        time.sleep(float(os.environ.get("AFTER_S", "15")))
        open(f"{d}/stop", "w").write("1")
        for p in procs:
            p.wait(60)


if __name__ == "__main__":
    if sys.argv[1] == "--side":
        side(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main(sys.argv[1])
