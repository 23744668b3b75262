"""`cat` for a slow filesystem: wait --latency-ms, then copy FILE to stdout at --mb-per-s (64 KB chunks).

A FUSE-free stand-in for a network filesystem or object store, used as a webdataset `pipe:` URL by
benchmarks/data/shard_throughput.py: `pipe:python benchmarks/tools/throttled_cat.py --latency-ms 10 --mb-per-s 50 FILE`
(run by path: it imports nothing of the project).
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--latency-ms", type=float, default=10.0)
    ap.add_argument("--mb-per-s", type=float, default=50.0)
    ap.add_argument("file")
    a = ap.parse_args()
    time.sleep(a.latency_ms / 1e3)
    t0, sent, rate = time.perf_counter(), 0, a.mb_per_s * 1e6
    out = sys.stdout.buffer
    try:
        with open(a.file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 16), b""):
                out.write(chunk)
                sent += len(chunk)
                ahead = sent / rate - (time.perf_counter() - t0)
                if ahead > 0:
                    time.sleep(ahead)
        out.flush()
    except BrokenPipeError:  # the reader took what it needed (a shard split between two streams) and closed
        sys.stderr.close()


if __name__ == "__main__":
    main()
