"""`accelerate launch`, served by the warm launcher when one runs (tests/warm/server.py says what that is).

    python tests/warm/client.py <the arguments of `accelerate launch`>

tests/conftest.py points DISTTRAIN_LAUNCHER here and DISTTRAIN_WARM_SOCKET at its server, so the suite's
launches (its own and those of the tools it runs: preflight, bench) fork their workers from warm imports.
Without a server, or when the server says the launch is not one it serves, this process becomes the real
`python -m accelerate.commands.launch` with the same arguments. It imports nothing heavy."""

import json
import os
import socket
import sys


def real_launcher(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, "-m", "accelerate.commands.launch", *argv])


def main(argv: list[str]) -> None:
    path = os.environ.get("DISTTRAIN_WARM_SOCKET")
    if not path:
        real_launcher(argv)
    for fd in (0, 1, 2):  # a closed one (stdin, under some CI runners) becomes /dev/null: the server takes three;
        # before the socket, which would otherwise take the free descriptor
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: this one
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        real_launcher(argv)
    request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}) + "\n"
    socket.send_fds(conn, [request.encode()], [0, 1, 2])
    answer = b""
    while not answer.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            print("warm launcher: the server went away during the launch", file=sys.stderr)
            sys.exit(1)
        answer += chunk
    reply = json.loads(answer)
    if reply.get("fallback"):
        conn.close()
        real_launcher(argv)
    log = os.environ.get("DISTTRAIN_WARM_CPU_LOG")  # TEST_CPU_LOG's share of the forked workers (tests/conftest.py)
    if log:
        with open(log, "a") as f:
            f.write(f"{reply['workers_cpu_s']}\n")
    sys.exit(reply["exit"])


if __name__ == "__main__":
    main(sys.argv[1:])
