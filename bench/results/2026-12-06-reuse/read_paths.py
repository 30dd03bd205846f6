"""Why a reload after a restart runs at half the disk's rate: one 128K-token Llama-3.1-8B shard file (17.7 GB),
read cold (posix_fadvise DONTNEED) by each path the disk tier has, and the parts apart (raw reads, hashing).
Usage: python read_paths.py DIR OUT.json [tokens]"""
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from starshard.serving import kv_file
from starshard.serving.cache_key import cache_key
from starshard.serving.disk_read import read_file
from starshard.serving.disk_staging import StagingArea, read_kv_staged
from starshard.serving.host_tier import HostKV, layout, to_device
from starshard.serving.pinned_arena import PinnedArena
from starshard.serving.tail_read import TailRead

d, out = Path(sys.argv[1]), Path(sys.argv[2])
n = int(sys.argv[3]) if len(sys.argv) > 3 else 134_827
key = cache_key("read-probe", dtype=torch.bfloat16)
sections, nbytes = layout(range(32), 1, 8, 128, n, torch.bfloat16, False)
buf = torch.empty(nbytes, dtype=torch.uint8)
buf[::4096] = torch.randint(0, 255, (len(buf[::4096]),), dtype=torch.uint8)
host = HostKV(buf, sections, torch.bfloat16, False, n, n)
path = d / "probe.kv"
dev = "cuda" if torch.cuda.is_available() else "cpu"
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
t = time.perf_counter()
if not path.exists():
    kv_file.write_kv_file(path, host, list(range(n)), key, 0)
res = {"code": os.environ.get("CODE", "this tree"), "tokens": n, "file_bytes": path.stat().st_size, "write_s": time.perf_counter() - t,
       "cpus": os.cpu_count(), "hash_threads": kv_file.HASH_THREADS}
del buf, host


def cold():
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def timed(name, fn):
    cold()
    sync()
    t = time.perf_counter()
    fn()
    sync()
    res[name] = round(time.perf_counter() - t, 3)
    print(name, res[name], f"{res['file_bytes'] / res[name] / 1e9:.2f} GB/s", flush=True)


x = os.urandom(256 << 20)
t = time.perf_counter()
hashlib.blake2b(x, digest_size=16).digest()
res["blake2b_gbps_one_thread"] = round(0.268 / (time.perf_counter() - t), 3)
h = kv_file.read_header(path)
for r in (1, 4, 8) if os.environ.get("RAW", "1") == "1" else ():
    timed(f"raw_readers{r}", lambda: [None for _ in read_file(path, h.payload_offset, h.payload_bytes, None, r)])
staging = StagingArea()
kv = {}
timed("staged_verify", lambda: kv.update(x=read_kv_staged(path, dev, staging, key, 0, verify=True)[0]))
timed("staged_noverify", lambda: read_kv_staged(path, dev, staging, key, 0, verify=False))
staging.close()
arena = PinnedArena(nbytes + (64 << 20))
timed("host_pinned_verify_to_device",
      lambda: to_device(kv_file.read_kv_host(path, key, 0, verify=True, arena=arena)[0], dev).synchronize())
del arena


def tail_all():
    t = TailRead(path, h, 0)
    t.attach(kv["x"])
    t.join(0)
    res["tail_read_seconds"] = round(t.seconds, 3)


timed("tail_read_all", tail_all)
out.write_text(json.dumps(res, indent=1))
