# Guest side of the network benchmark (benches/benches/net.rs).
#
# Runs as the guest's init (PID 1) by `init=/usr/bin/python3 /dev/vdb`: the
# benchmark writes this file, padded with newlines to whole sectors, as a
# raw second disk. The kernel hands the command line's unknown
# `name=value` parameters to init as environment variables: netbench_port,
# netbench_mib, netbench_connects, netbench_rounds.
#
# It sets up the same addressing as every Tine sandbox and QEMU's
# user-mode network (10.0.2.15/24 via 10.0.2.2), then measures against the
# benchmark's server on the host's loopback, reached as the gateway
# 10.0.2.2, and prints one line `NETBENCH {json}` to the console.
import json
import os
import socket
import statistics
import subprocess
import time

os.environ["PATH"] = "/usr/sbin:/usr/bin:/sbin:/bin"


def run(*argv):
    subprocess.run(argv, check=True)


run("mount", "-t", "proc", "proc", "/proc")
run("ip", "link", "set", "lo", "up")
run("ip", "addr", "add", "10.0.2.15/24", "dev", "eth0")
run("ip", "link", "set", "eth0", "up")
run("ip", "route", "add", "default", "via", "10.0.2.2")

HOST = ("10.0.2.2", int(os.environ["netbench_port"]))
NBYTES = int(os.environ.get("netbench_mib", "64")) << 20
CONNECTS = int(os.environ.get("netbench_connects", "200"))
ROUNDS = int(os.environ.get("netbench_rounds", "3"))
CHUNK = 256 << 10


def connect():
    s = socket.create_connection(HOST, timeout=60)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_exact(s, n):
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = s.recv_into(view[got:], min(n - got, CHUNK))
        if k == 0:
            raise EOFError("the host closed the connection early")
        got += k
    return bytes(buf)


def upload(n):
    """Guest to host: n bytes, timed until the host acknowledged them all."""
    zeros = memoryview(bytes(CHUNK))
    s = connect()
    t0 = time.perf_counter()
    s.sendall(b"U" + n.to_bytes(8, "little"))
    left = n
    while left:
        k = min(left, CHUNK)
        s.sendall(zeros[:k])
        left -= k
    acked = int.from_bytes(recv_exact(s, 8), "little")
    t1 = time.perf_counter()
    s.close()
    assert acked == n, (acked, n)
    return n / (t1 - t0)


def download(n):
    """Host to guest: n bytes, timed from the request to the last byte."""
    buf = bytearray(CHUNK)
    s = connect()
    t0 = time.perf_counter()
    s.sendall(b"D" + n.to_bytes(8, "little"))
    got = 0
    while got < n:
        k = s.recv_into(buf, min(n - got, CHUNK))
        if k == 0:
            raise EOFError("the host closed the connection early")
        got += k
    t1 = time.perf_counter()
    s.close()
    return n / (t1 - t0)


def connects(count):
    """Connection setup: connect() alone, and connect plus one 1-byte
    round trip (the host's accept included), in seconds."""
    setup, first_byte = [], []
    for _ in range(count):
        t0 = time.perf_counter()
        s = connect()
        t1 = time.perf_counter()
        s.sendall(b"P")
        recv_exact(s, 1)
        t2 = time.perf_counter()
        s.close()
        setup.append(t1 - t0)
        first_byte.append(t2 - t0)
    return setup, first_byte


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


upload(1 << 20)  # warm-up: first-use costs of the stack and the NAT
download(1 << 20)
up = [upload(NBYTES) for _ in range(ROUNDS)]
down = [download(NBYTES) for _ in range(ROUNDS)]
setup, first_byte = connects(CONNECTS)
result = {
    "bytes": NBYTES,
    "rounds": ROUNDS,
    "upload_mb_s": [round(x / 1e6, 3) for x in up],
    "download_mb_s": [round(x / 1e6, 3) for x in down],
    "connects": CONNECTS,
    "connect_ms_median": round(statistics.median(setup) * 1e3, 3),
    "connect_ms_p90": round(pct(setup, 0.9) * 1e3, 3),
    "first_byte_ms_median": round(statistics.median(first_byte) * 1e3, 3),
    "first_byte_ms_p90": round(pct(first_byte, 0.9) * 1e3, 3),
}
print("NETBENCH " + json.dumps(result), flush=True)
time.sleep(3600)
