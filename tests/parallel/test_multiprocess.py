"""Multi-host context parallelism: 2 processes on localhost, 2 fake CPU devices each.

Each process runs this file as a script (`_worker`): it initialises `jax.distributed` (gloo
collectives on CPU), builds a 4-device mesh over both processes, makes global q, k, v with
`jax.make_array_from_callback` (every process holds only its own shards), and runs the ring
strategy (per-step implementation "chunked") forward and backward. Every process checks the
shards it holds against a one-device `flashmesh.attention` (the reference) of the whole problem
computed locally, and prints a line the test reads. The test skips only when a process never
got past `jax.distributed.initialize`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

NUM_PROCESSES, LOCAL_DEVICES = 2, 2
TIMEOUT_S = 120
B, T, N, K, H = 2, 32, 4, 2, 8
OK_LINE, STARTED_LINE = "multiprocess-ok", "multiprocess-started"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _worker(process_id: int, port: int) -> None:
    import jax

    # Before any backend exists: 2 CPU devices in this process, gloo for cross-process collectives.
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=NUM_PROCESSES,
                               process_id=process_id, initialization_timeout=TIMEOUT_S)

    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import flashmesh
    from flashmesh.parallel.context import context_parallel_attention

    devices = jax.devices()
    if len(devices) != NUM_PROCESSES * LOCAL_DEVICES or jax.process_count() != NUM_PROCESSES:
        raise RuntimeError(f"expected {NUM_PROCESSES * LOCAL_DEVICES} devices over {NUM_PROCESSES} "
                           f"processes, got {len(devices)} over {jax.process_count()}")
    print(f"{STARTED_LINE} process {process_id}: {len(jax.local_devices())} of {len(devices)} devices",
          flush=True)
    mesh = Mesh(np.asarray(devices), ("cp",))
    sharding = NamedSharding(mesh, P(None, "cp", None, None))

    # The same data in every process (one seed); each process gives jax only its own shards.
    rng = np.random.default_rng(2026)
    data = {name: rng.standard_normal(shape, np.float32) for name, shape in (
        ("q", (B, T, N, H)), ("k", (B, T, K, H)), ("v", (B, T, K, H)), ("ct", (B, T, N, H)))}
    glob = {name: jax.make_array_from_callback(x.shape, sharding, lambda idx, x=x: x[idx])
            for name, x in data.items()}
    if any(a.is_fully_addressable for a in glob.values()):
        raise RuntimeError("the global arrays must span both processes")

    def sharded(q, k, v):
        return context_parallel_attention(q, k, v, mesh=mesh, strategy="ring", mask="causal",
                                          implementation="chunked")

    def one_device(q, k, v):
        return flashmesh.attention(q, k, v, mask="causal", implementation="reference")

    def loss(f):
        return lambda q, k, v, ct: jnp.sum(f(q, k, v) * ct)

    out = jax.jit(sharded)(glob["q"], glob["k"], glob["v"])
    grads = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2)))(*glob.values())

    local = {name: jax.device_put(x, jax.local_devices()[0]) for name, x in data.items()}
    want_out = one_device(local["q"], local["k"], local["v"])
    want_grads = jax.grad(loss(one_device), argnums=(0, 1, 2))(*local.values())

    checked = 0
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (want_out, *want_grads)):
        want = np.asarray(want)
        for shard in got.addressable_shards:  # only this process's shards
            np.testing.assert_allclose(np.asarray(shard.data), want[shard.index], rtol=1e-5,
                                       atol=1e-5, err_msg=f"{name}, shard {shard.index}")
            checked += 1
    print(f"{OK_LINE} process {process_id}: {checked} shards of out, dq, dk, dv match one device",
          flush=True)
    jax.distributed.shutdown()


def test_two_processes_match_one_device():
    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2] / "src"),
                                                      env.get("PYTHONPATH")]))
    env.pop("XLA_FLAGS", None)  # a forced host device count would override jax_num_cpu_devices
    procs = [subprocess.Popen([sys.executable, __file__, str(i), str(port)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for i in range(NUM_PROCESSES)]
    deadline, outputs = time.monotonic() + TIMEOUT_S, []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
        pytest.fail(f"the {NUM_PROCESSES} processes did not finish within {TIMEOUT_S} s")
    text = "\n".join(f"--- process {i} (exit {p.returncode}) ---\n{out[-3000:]}"
                     for i, (p, out) in enumerate(zip(procs, outputs)))
    if any(p.returncode for p in procs) and not all(STARTED_LINE in out for out in outputs):
        pytest.skip(f"jax.distributed cannot start on this platform:\n{text}")
    assert all(p.returncode == 0 for p in procs), text
    assert all(OK_LINE in out for out in outputs), text


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]))
