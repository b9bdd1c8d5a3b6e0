"""GPUDirect Storage reads through NIXL's GDS and GDS_MT plugins: stored chunk files into GPU memory, byte-checked.

``--objects`` files of ``--layers`` Layer Blocks of ``--layer-mib`` MiB each (a
chunk object's Full Block; random bytes) are written to ``--dir``. For each
plugin: a NIXL agent, the plugin (``nixl_backends.gds.create_gds_backend``),
the files and one GPU buffer registered, and every object read with one
descriptor per Layer Block into the buffer *layer-major* (layer ``l`` of object
``j`` at ``(l * objects + j) * S``: how a hit's layers would land in a KV cache,
scattered from one file). The buffer is compared byte for byte with the files;
the figure is the median of ``--reps`` reads after one warm-up, next to the host
path it replaces (NIXL POSIX into pinned DRAM, then one host->device copy per
layer), interleaved. Whether cuFile ran in compatibility mode (no nvidia-fs) is
reported: there the GDS figure is not a DMA figure.

``--device cpu`` (the self-test ``make test`` runs): the files, the POSIX read into
DRAM, the byte check, and the refusal where no GDS plugin can start (the
message is printed; exit 0 when it names the reason). Exit 0 when every read
is byte-exact, 1 otherwise, 77 with ``--device cuda`` and no GPU.

    python3 scripts/gpu_gds_check.py [--device cuda] [--objects 32] [--layers 32] [--layer-mib 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nixl_backends.gds import GDS_PLUGINS, GdsUnavailable, create_gds_backend, nvidia_fs_loaded  # noqa: E402
from nixl_backends.nixl_io import descriptors, run_nixl_transfers  # noqa: E402
from nixl_backends.posix import create_posix_backend  # noqa: E402

MiB = 1 << 20


def make_agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))


def write_objects(directory: str, count: int, object_bytes: int, seed: int) -> tuple[list[str], np.ndarray]:
    data = np.random.default_rng(seed).integers(0, 256, (count, object_bytes), dtype=np.uint8)
    paths = []
    for j in range(count):
        path = os.path.join(directory, f"chunk-{j:04d}")
        data[j].tofile(path)
        paths.append(path)
    os.sync()
    return paths, data


def _open_direct(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:  # a file system without O_DIRECT (tmpfs)
        return None


def _cufile_log_tail(lines: int = 20) -> list[str]:
    path = os.environ.get("CUFILE_LOGFILE_PATH", "")
    if not os.path.exists(path):
        return []
    with open(path, errors="replace") as log:
        return [line.rstrip() for line in log.readlines()[-lines:] if line.strip()]


def layer_major_reads(fds: list[int], base: int, layers: int, layer_bytes: int, dev: int) -> list[tuple]:
    """Per object: one (local, file) descriptor pair per Layer Block, layer ``l`` of object ``j`` at ``(l*n + j)*S``."""
    n = len(fds)
    pairs = []
    for j, fd in enumerate(fds):
        local = descriptors(base + (np.arange(layers) * n + j) * layer_bytes, layer_bytes, dev)
        remote = descriptors(np.arange(layers) * layer_bytes, layer_bytes, fd)
        pairs.append((local, remote))
    return pairs


def timed_read(agent, pairs: list[tuple], local_type: str, timeout_s: float) -> tuple[float, bool]:
    t0 = time.perf_counter()
    ok = run_nixl_transfers(agent, "READ", pairs, "FILE", timeout_s, local_mem_type=local_type)
    return time.perf_counter() - t0, all(ok)


def run(args: argparse.Namespace) -> dict:
    import torch

    layer_bytes = int(args.layer_mib * MiB)
    object_bytes = layer_bytes * args.layers
    total = object_bytes * args.objects
    cuda = args.device == "cuda"
    out: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "objects": args.objects,
                 "layers": args.layers, "layer_block_mib": args.layer_mib, "total_mib": round(total / MiB, 1),
                 "nvidia_fs": nvidia_fs_loaded(), "plugins": {}}  # fmt: skip
    directory = tempfile.mkdtemp(prefix="gds-check-", dir=args.dir)
    paths, data = write_objects(directory, args.objects, object_bytes, seed=7)
    expected = torch.from_numpy(np.ascontiguousarray(data.reshape(args.objects, args.layers, layer_bytes).transpose(1, 0, 2)))
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    gds_fds: list[int] = []
    file_regs = []
    try:
        # The host path: NIXL POSIX into pinned DRAM, then one host->device copy per layer.
        host = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
        gpu = torch.empty(total, dtype=torch.uint8, device=args.device)
        posix = make_agent(f"gds-check-posix-{os.getpid()}")
        create_posix_backend(posix, "aio")
        posix.register_memory([(host.data_ptr(), total, 0, "")], "DRAM")
        file_regs.append((posix, posix.register_memory([(0, object_bytes, fd, "") for fd in fds], "FILE")))
        host_pairs = layer_major_reads(fds, host.data_ptr(), args.layers, layer_bytes, 0)
        agents = {"posix+h2d": (posix, host_pairs, "DRAM")}
        for plugin in GDS_PLUGINS if cuda else GDS_PLUGINS[:1]:
            agent = make_agent(f"gds-check-{plugin}-{os.getpid()}")
            try:
                create_gds_backend(agent, plugin, where=f"gpu_gds_check {plugin}")
            except GdsUnavailable as exc:
                out["plugins"][plugin] = {"started": False, "refused": str(exc), "cufile_log": _cufile_log_tail()}
                print(f"{plugin}: not started: {exc}", flush=True)
                continue
            # cuFile wants O_DIRECT descriptors for DMA; compatibility mode takes either.
            direct = [_open_direct(path) for path in paths]
            gds_fds.extend(fd for fd in direct if fd is not None)
            plugin_fds = [d if d is not None else fd for d, fd in zip(direct, fds)]
            try:
                agent.register_memory([(gpu.data_ptr(), total, gpu.device.index or 0, "")], "VRAM")
                file_regs.append((agent, agent.register_memory([(0, object_bytes, fd, "") for fd in plugin_fds], "FILE")))
            except Exception as exc:
                out["plugins"][plugin] = {"started": True, "refused": f"{plugin} registration failed: {exc}",
                                          "o_direct": None not in direct, "cufile_log": _cufile_log_tail()}  # fmt: skip
                print(f"{plugin}: registration failed: {exc}", flush=True)
                continue
            agents[plugin] = (agent, layer_major_reads(plugin_fds, gpu.data_ptr(), args.layers, layer_bytes,
                                                       gpu.device.index or 0), "VRAM")  # fmt: skip
            out["plugins"][plugin] = {"started": True, "compat_mode": not nvidia_fs_loaded(), "o_direct": None not in direct}
        times: dict[str, list[float]] = {name: [] for name in agents}
        exact: dict[str, bool] = dict.fromkeys(agents, True)
        for rep in range(args.reps + 1):  # interleaved; the first round warms up
            for name, (agent, pairs, local_type) in agents.items():
                target = gpu if local_type == "VRAM" else host
                target.zero_()
                if cuda:
                    torch.cuda.synchronize()
                dt, ok = timed_read(agent, pairs, local_type, args.timeout)
                if name == "posix+h2d":
                    t0 = time.perf_counter()
                    view = gpu.view(args.layers, -1)
                    for layer in range(args.layers):  # one copy per layer: the layer is one host run
                        view[layer].copy_(host.view(args.layers, -1)[layer], non_blocking=True)
                    if cuda:
                        torch.cuda.synchronize()
                    dt += time.perf_counter() - t0
                got = gpu if cuda or name != "posix+h2d" else host
                exact[name] &= ok and torch.equal(got.view(args.layers, args.objects, layer_bytes).cpu(), expected)
                if rep:
                    times[name].append(dt)
        for name, samples in times.items():
            med = statistics.median(samples)
            row = {"median_gbps": round(total / med / 1e9, 3), "min_gbps": round(total / max(samples) / 1e9, 3),
                   "max_gbps": round(total / min(samples) / 1e9, 3), "byte_exact": exact[name], "reads": len(samples)}  # fmt: skip
            out["plugins"].setdefault(name, {}).update(row)
            print(f"{name}: median {row['median_gbps']} GB/s (min {row['min_gbps']}, max {row['max_gbps']}) over "
                  f"{len(samples)} reads of {out['total_mib']} MiB, layer-major; byte-exact: {exact[name]}", flush=True)  # fmt: skip
        out["ok"] = all(exact.values())
        return out
    finally:
        for agent, reg in file_regs:
            agent.deregister_memory(reg)
        for fd in fds + gds_fds:
            os.close(fd)
        for p in paths:
            os.unlink(p)
        os.rmdir(directory)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--objects", type=int, default=32)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--layer-mib", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the chunk files go (default: the temp dir)")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.device == "cpu":
        args.objects, args.layers, args.layer_mib, args.reps = min(args.objects, 4), min(args.layers, 4), 1 / 16, 1
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 77
    out = run(args)
    if args.device == "cpu":
        # Here no GDS plugin can start: the check is that it was refused with its reason.
        refusal = out["plugins"].get("GDS", {}).get("refused", "")
        out["ok"] = out["ok"] and ("GDS" in refusal and ("not found" in refusal or "did not start" in refusal
                                                         or "no GDS plugin" in refusal))  # fmt: skip
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print("gpu_gds_check:", "PASS" if out["ok"] else "FAIL")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
