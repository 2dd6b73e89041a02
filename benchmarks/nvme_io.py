"""The NVMe tier's two I/O backends on this machine's disk, measured the way the tier uses them: one
layer region at a time, written then read back (``megatrain_ds.host.nvme``'s ``_ThreadIO`` over an
O_DIRECT file, and DeepSpeed's async I/O op where it builds), with the ``aio`` block's settings.

    python -m benchmarks.nvme_io --path /nvme/folder --region-gib 1.87 --regions 4 --out io.json

Prints one line per backend (GB/s write, GB/s read, whether O_DIRECT held) and writes them as JSON.
The file is deleted afterwards. ``--regions`` × ``--region-gib`` should exceed the page cache's
reach only when the backend is buffered (O_DIRECT bypasses it).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from megatrain_ds.host import nvme
from megatrain_ds.host.host_state import HostRegion


def bench(backend: str, path: str, region_bytes: int, regions: int, aio: dict) -> dict:
    settings = nvme.NvmeSettings(nvme_path=os.path.dirname(path), aio=aio)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.posix_fallocate(fd, 0, region_bytes * regions)
    os.close(fd)
    try:
        io = nvme.open_backend(path, settings, backend)
    except Exception as exc:  # noqa: BLE001 (the aio op may not build here)
        return {"backend": backend, "status": "unavailable", "error": str(exc)[:300]}
    buf = HostRegion(region_bytes, torch.uint8, pin=False)
    buf.tensor.fill_(7)
    out = {
        "backend": io.name,
        "direct": getattr(io, "direct", True),
        "region_bytes": region_bytes,
        "regions": regions,
    }
    for write in (True, False):
        t0 = time.perf_counter()
        # one request per region, waited for before the next (the tier's worst case)
        for k in range(regions):
            for fut in io.submit(write, buf.tensor, k * region_bytes):
                fut.result()
        if write and not out["direct"]:  # buffered: the bytes are on the disk only once synced
            sync_fd = os.open(path, os.O_RDONLY)
            os.fsync(sync_fd)
            os.close(sync_fd)
        dt = time.perf_counter() - t0
        out["write_GBps" if write else "read_GBps"] = region_bytes * regions / dt / 1e9
    io.close()
    out["status"] = "ok"
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--path", required=True, help="a folder on the disk to measure")
    p.add_argument("--region-gib", type=float, default=1.0)
    p.add_argument("--regions", type=int, default=4)
    p.add_argument("--block-size", type=int, default=1 << 20)
    p.add_argument("--queue-depth", type=int, default=8)
    p.add_argument("--intra-op-parallelism", type=int, default=1)
    p.add_argument("--backends", default="threads,aio")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    aio = {
        "block_size": args.block_size,
        "queue_depth": args.queue_depth,
        "single_submit": False,
        "overlap_events": True,
        "intra_op_parallelism": args.intra_op_parallelism,
        "use_gds": False,
    }
    region = nvme.align(int(args.region_gib * 2**30))
    path = os.path.join(args.path, f".megatrain_nvme_io-{os.getpid()}.bin")
    results = []
    try:
        for backend in args.backends.split(","):
            r = bench(backend, path, region, args.regions, aio)
            r["aio"] = aio
            results.append(r)
            if r["status"] == "ok":
                print(
                    f"[nvme_io] {r['backend']:>14} direct={r['direct']}: write "
                    f"{r['write_GBps']:.2f} GB/s, "
                    f"read {r['read_GBps']:.2f} GB/s ({args.regions} x {region / 2**30:.2f} GiB)",
                    flush=True,
                )
            else:
                print(f"[nvme_io] {backend}: {r['status']}: {r['error']}", flush=True)
    finally:
        if os.path.exists(path):
            os.remove(path)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
