"""NIXL/UCX moving bytes between host memory (DRAM) and GPU memory (VRAM) with the project's transport code.

Two NIXL agents in this process, set up as the connector's workers set theirs up (no progress thread,
strict thread sync, ``add_ucx_backend``), exchange metadata as a PeerLink handshake does
(``add_remote_agent(get_agent_metadata())``) and READ each other's registered memory with
``nixl_backends.transport.post_read`` (the call ``dualpath_connector/worker/worker.py`` uses for PD pulls and
DE-buffer reads):

- agent "gpu" owns a CUDA tensor (``mem_type("cuda")`` -> VRAM) and READs the host agent's DRAM into it;
- agent "host" owns a pinned host tensor (DRAM) and READs the GPU agent's VRAM into it.

Each READ carries a notification, which the owner must receive (that is how a PE learns its blocks were pulled).
Bytes are compared after every READ; the figure is the median of ``--reps`` timed READs of ``--mib`` MiB after one
warm-up. Needs an NVIDIA GPU, torch and nixl; exit status 0 when every READ is byte-exact, 1 otherwise, 77 when
there is no GPU.

    python3 scripts/gpu_nixl_check.py [--mib 256] [--reps 5] [--descs 1] [--device cuda|cpu]

``--device cpu`` runs the same READs between two DRAM regions (checks the script on a machine without a GPU).
``--descs N`` splits each READ into N descriptors of equal size (as a KV pull of N blocks would be, unmerged).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nixl_backends.transport import UCX, PeerRead, add_ucx_backend, mem_type, post_read  # noqa: E402

MiB = 1 << 20


def make_agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    agent = nixl_agent(
        name,
        nixl_agent_config(enable_prog_thread=False, backends=[], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT),
    )
    add_ucx_backend(agent)
    return agent


def rows(addr: int, nbytes: int, device_id: int, descs: int) -> np.ndarray:
    """Nx3 descriptor rows, N equal pieces of [addr, addr + nbytes); every other row swapped with its
    neighbour so that ``coalesce`` cannot merge them back into one (local and remote get the same order)."""
    piece = nbytes // descs
    r = np.empty((descs, 3), dtype=np.uint64)
    r[:, 0] = addr + np.arange(descs, dtype=np.uint64) * np.uint64(piece)
    r[:, 1] = piece
    r[:, 2] = device_id
    if descs > 1:
        order = np.arange(descs)
        order[: descs - descs % 2] = order[: descs - descs % 2].reshape(-1, 2)[:, ::-1].reshape(-1)
        r = r[order]
    return r


def read_once(reader, owner, owner_name: str, local: np.ndarray, local_type: str, remote: np.ndarray,
              remote_type: str, note: bytes, timeout_s: float) -> float:
    """Post one READ, wait for it (polling the owner too, as the owner's side channel would), return seconds."""
    t0 = time.perf_counter()
    read: PeerRead = post_read(reader, owner_name, local, local_type, remote, remote_type, note)
    deadline = time.monotonic() + timeout_s
    while read.state() == "PROC":
        owner.get_new_notifs()  # progresses the owner's UCX worker (what PeerLink's tick does)
        if time.monotonic() > deadline:
            raise TimeoutError(f"READ still in flight after {timeout_s}s")
    dt = time.perf_counter() - t0
    if read.state() != "DONE":
        raise RuntimeError(f"READ ended in state {read.state()}")
    # The owner is told once the READ is complete.
    got: list[bytes] = []
    while note not in got:
        for msgs in owner.get_new_notifs().values():
            got.extend(msgs)
        if time.monotonic() > deadline:
            raise TimeoutError(f"notification {note!r} not delivered")
        reader.get_new_notifs()
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--descs", type=int, default=1)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no usable GPU (torch.cuda.is_available() is False)")
        return 77
    n = args.mib * MiB
    assert n % args.descs == 0
    gpu_side = torch.empty(n, dtype=torch.uint8, device=args.device)
    host_side = torch.empty(n, dtype=torch.uint8, pin_memory=args.device == "cuda")
    dev_id = gpu_side.device.index or 0
    gpu_type, host_type = mem_type(gpu_side.device.type), mem_type("cpu")
    print(f"device: {torch.cuda.get_device_name(0) if args.device == 'cuda' else 'cpu'}; "
          f"{args.mib} MiB per READ in {args.descs} descriptor(s); gpu side {gpu_type}, host side {host_type} "
          f"(pinned: {host_side.is_pinned()})", flush=True)

    pid = os.getpid()
    gpu_agent, host_agent = make_agent(f"nixl-check-gpu-{pid}"), make_agent(f"nixl-check-host-{pid}")
    gpu_reg = gpu_agent.register_memory([(gpu_side.data_ptr(), n, dev_id, "")], gpu_type, backends=[UCX])
    host_reg = host_agent.register_memory([(host_side.data_ptr(), n, 0, "")], host_type, backends=[UCX])
    # The handshake: each side learns the other's metadata (the side channel's "hello").
    host_name = gpu_agent.add_remote_agent(host_agent.get_agent_metadata())
    gpu_name = host_agent.add_remote_agent(gpu_agent.get_agent_metadata())
    host_name = host_name if isinstance(host_name, str) else host_name.decode()
    gpu_name = gpu_name if isinstance(gpu_name, str) else gpu_name.decode()

    gpu_rows = rows(gpu_side.data_ptr(), n, dev_id, args.descs)
    host_rows = rows(host_side.data_ptr(), n, 0, args.descs)
    gen = torch.Generator().manual_seed(0)
    results: dict[str, dict] = {}
    ok = True
    for name, reader, owner, owner_name, local, ltype, remote, rtype in (
        ("dram_to_vram", gpu_agent, host_agent, host_name, gpu_rows, gpu_type, host_rows, host_type),
        ("vram_to_dram", host_agent, gpu_agent, gpu_name, host_rows, host_type, gpu_rows, gpu_type),
    ):
        times, mismatches = [], 0
        for rep in range(args.reps + 1):  # the first READ warms up (connection, registration caches)
            pattern = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
            src, dst = (host_side, gpu_side) if name == "dram_to_vram" else (gpu_side, host_side)
            src.copy_(pattern)
            dst.zero_()
            if args.device == "cuda":
                torch.cuda.synchronize()
            dt = read_once(reader, owner, owner_name, local, ltype, remote, rtype, f"{name}-{rep}".encode(),
                           args.timeout)
            if not torch.equal(dst.cpu() if dst.device.type != "cpu" else dst, pattern):
                mismatches += 1
            if rep:
                times.append(dt)
        med = statistics.median(times)
        gbps = [n / t / 1e9 for t in times]
        results[name] = {"median_gbps": n / med / 1e9, "min_gbps": min(gbps), "max_gbps": max(gbps),
                         "mismatched_reads": mismatches, "reads": args.reps + 1}
        ok &= mismatches == 0
        print(f"{name}: median {n / med / 1e9:.2f} GB/s (min {min(gbps):.2f}, max {max(gbps):.2f}) over {args.reps} "
              f"READs of {args.mib} MiB; byte mismatches in {mismatches} of {args.reps + 1} READs", flush=True)

    gpu_agent.remove_remote_agent(host_name)
    host_agent.remove_remote_agent(gpu_name)
    gpu_agent.deregister_memory(gpu_reg, backends=[UCX])
    host_agent.deregister_memory(host_reg, backends=[UCX])
    out = {"mib": args.mib, "descs": args.descs, "reps": args.reps, "device": args.device, **results}
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out) + "\n")
    print("gpu_nixl_check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
