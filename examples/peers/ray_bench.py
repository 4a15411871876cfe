"""The peer comparison for `gpumesh bench mesh` and `gpumesh bench actors`: the same
measurements on a 3-node local Ray cluster (one CPU per node), on the same machine.

Optional; Ray is not a dependency of gpumesh or its tests. To run it:

    python3 -m venv /tmp/rayvenv && /tmp/rayvenv/bin/pip install "ray[default]"
    /tmp/rayvenv/bin/python examples/peers/ray_bench.py [--json] [--throughput-tasks N] [--in-flight N]

Prints a table; with --json the last line is one JSON object with the keys of both
gpumesh benches: p50_ms, p99_ms, tasks_per_s, mesh_vs_direct, blob_vs_tcp,
blob_stored_vs_tcp (null: Ray's object store keeps objects in memory, no fsync),
call_p50_ms, call_p99_ms, calls_per_s.
"""

import json
import socket
import sys
import threading
import time

import ray
from ray.cluster_utils import Cluster

LATENCY_TASKS = 200
THROUGHPUT_TASKS = 10000
IN_FLIGHT = 64
CALLS = 200
CALLS_IN_FLIGHT = 48
TRANSFER_MIB = 64


def percentile(sorted_values, p):
    return sorted_values[round((len(sorted_values) - 1) * p)]


@ray.remote
def tiny():
    # The gpumesh tiny task's answer: 64 u32s, 256 bytes.
    return bytes(256)


def spin(n):
    x = 0
    for i in range(n):
        x = (x ^ (x >> 13)) * 1664525 + i & 0xFFFFFFFF
    return x


@ray.remote
def spin_remote(n):
    return spin(n)


@ray.remote
class Counter:
    def __init__(self):
        self.value = 0

    def step(self, add):
        self.value += add
        return self.value


@ray.remote(resources={"producer": 1})
def produce(n):
    return bytes(n)


@ray.remote(resources={"consumer": 1})
def consume(blob):
    return len(blob)


def raw_tcp_seconds(nbytes):
    """A plain socket write -> read of nbytes over loopback."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    payload = bytes(1 << 20)

    def send():
        conn, _ = server.accept()
        left = nbytes
        while left > 0:
            n = min(left, len(payload))
            conn.sendall(payload[:n])
            left -= n
        conn.close()

    sender = threading.Thread(target=send)
    sender.start()
    client = socket.create_connection(("127.0.0.1", port))
    start = time.perf_counter()
    got = 0
    while got < nbytes:
        chunk = client.recv(1 << 20)
        if not chunk:
            break
        got += len(chunk)
    elapsed = time.perf_counter() - start
    client.close()
    sender.join()
    server.close()
    return elapsed


def main():
    as_json = "--json" in sys.argv
    throughput_tasks = THROUGHPUT_TASKS
    if "--throughput-tasks" in sys.argv:
        throughput_tasks = int(sys.argv[sys.argv.index("--throughput-tasks") + 1])
    in_flight = IN_FLIGHT
    if "--in-flight" in sys.argv:
        in_flight = int(sys.argv[sys.argv.index("--in-flight") + 1])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1, resources={"producer": 1})
    cluster.add_node(num_cpus=1, resources={"consumer": 1})
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    cluster.wait_for_nodes()

    # Warm-up: workers started on every node.
    ray.get([tiny.remote() for _ in range(64)])

    lat = []
    for _ in range(LATENCY_TASKS):
        t = time.perf_counter()
        assert len(ray.get(tiny.remote())) == 256
        lat.append(time.perf_counter() - t)
    lat.sort()

    start = time.perf_counter()
    pending, done = [], 0
    for _ in range(throughput_tasks):
        if len(pending) >= in_flight:
            ready, pending = ray.wait(pending, num_returns=1)
            ray.get(ready)
            done += 1
        pending.append(tiny.remote())
    ray.get(pending)
    done += len(pending)
    tasks_per_s = done / (time.perf_counter() - start)

    # A ~110 ms function directly and through the cluster.
    n = 10000
    while True:
        t = time.perf_counter()
        spin(n)
        if time.perf_counter() - t > 0.011:
            break
        n *= 2
    n = int(n * 0.11 / (time.perf_counter() - t))
    ray.get(spin_remote.remote(n))
    direct, meshed = [], []
    for _ in range(7):
        t = time.perf_counter()
        spin(n)
        direct.append(time.perf_counter() - t)
        t = time.perf_counter()
        ray.get(spin_remote.remote(n))
        meshed.append(time.perf_counter() - t)
    direct.sort()
    meshed.sort()

    counter = Counter.remote()
    ray.get(counter.step.remote(0))
    calls = []
    for _ in range(CALLS):
        t = time.perf_counter()
        ray.get(counter.step.remote(1))
        calls.append(time.perf_counter() - t)
    calls.sort()
    start = time.perf_counter()
    pending, done = [], 0
    for _ in range(CALLS * 5):
        if len(pending) >= CALLS_IN_FLIGHT:
            ready, pending = ray.wait(pending, num_returns=1)
            done += 1
        pending.append(counter.step.remote(1))
    ray.get(pending)
    done += len(pending)
    calls_per_s = done / (time.perf_counter() - start)

    # An object made on one node and read by a task on another, vs raw TCP.
    nbytes = TRANSFER_MIB << 20
    best = None
    for _ in range(3):
        ref = produce.remote(nbytes)
        ray.wait([ref])
        t = time.perf_counter()
        assert ray.get(consume.remote(ref)) == nbytes
        elapsed = time.perf_counter() - t
        best = elapsed if best is None else min(best, elapsed)
    tcp = min(raw_tcp_seconds(nbytes) for _ in range(3))

    result = {
        "p50_ms": percentile(lat, 0.5) * 1e3,
        "p99_ms": percentile(lat, 0.99) * 1e3,
        "tasks_per_s": tasks_per_s,
        "mesh_vs_direct": meshed[3] / direct[3],
        "blob_vs_tcp": tcp / best,
        "blob_stored_vs_tcp": None,
        "call_p50_ms": percentile(calls, 0.5) * 1e3,
        "call_p99_ms": percentile(calls, 0.99) * 1e3,
        "calls_per_s": calls_per_s,
    }
    print("Ray %s - 3 nodes (1 CPU each) on this machine, ray.cluster_utils.Cluster" % ray.__version__)
    rows = [
        ("trivial task round trip, p50", "%.2f ms" % result["p50_ms"]),
        ("trivial task round trip, p99", "%.2f ms" % result["p99_ms"]),
        ("sustained tiny tasks (%d in flight)" % in_flight, "%.0f /s" % tasks_per_s),
        ("~110 ms function through Ray / direct", "%.3f" % result["mesh_vs_direct"]),
        ("%d MiB object across nodes vs raw TCP" % TRANSFER_MIB, "%.0f%%" % (100 * result["blob_vs_tcp"])),
        ("actor call, one at a time, p50", "%.2f ms" % result["call_p50_ms"]),
        ("actor call, one at a time, p99", "%.2f ms" % result["call_p99_ms"]),
        ("actor calls (%d in flight)" % CALLS_IN_FLIGHT, "%.0f /s" % calls_per_s),
    ]
    for what, value in rows:
        print("%-50s %14s" % (what, value))
    ray.shutdown()
    cluster.shutdown()
    if as_json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
