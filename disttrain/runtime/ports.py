"""Is the rendezvous port free, and who holds it? Checked before a launch (Makefile) and by `make doctor`.

    python -m disttrain.runtime.ports --port 29500 [--nodes 2 --node-rank 0]

On node rank 0 a taken port is fatal for a multi-node job (the other nodes are told to connect to it);
on one node accelerate moves to a free port by itself, so it is only a warning there.
"""

from __future__ import annotations

import argparse
import socket
import sys


def port_in_use(port: int, host: str = "") -> bool:
    """True when nothing can listen on `port` here (what the launcher will try to do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def port_owner(port: int) -> str | None:
    """'pid 1234 (python: torchrun ...)' for the process listening on `port`, when this user may see it."""
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                proc = psutil.Process(conn.pid)
                cmdline = " ".join(proc.cmdline())[:120]
                return f"pid {conn.pid} ({proc.name()}: {cmdline})"
    except Exception:  # no permission (another user's process, macOS without root): say nothing
        return None
    return None


def reachable(host: str, port: int, timeout_s: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def conflict_message(port: int) -> str:
    owner = port_owner(port)
    held = f"held by {owner}" if owner else "held by another process (not visible to this user; `sudo ss -ltnp`)"
    return (f"rendezvous port {port} is already in use, {held}. Pick another one: `make ... MASTER_PORT=<port>` "
            f"(accelerate launch --main_process_port <port>; torchrun --master_port <port>) on every node, or "
            "stop the old job")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    args = parser.parse_args(argv)
    if args.node_rank != 0 or not port_in_use(args.port):
        return 0  # only node rank 0 listens on the rendezvous port
    if args.nodes > 1:
        print(f"error: {conflict_message(args.port)}", file=sys.stderr)
        return 2
    print(f"warning: {conflict_message(args.port)}; on one node accelerate picks a free port instead",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
