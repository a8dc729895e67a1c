# Guest side of the in-guest disk benchmark (benches/benches/disk_guest.rs).
#
# Runs as the guest's init (PID 1) by `init=/usr/bin/python3 /dev/vdb`: the
# benchmark writes this file, padded with newlines to whole sectors, as a
# raw second disk. The kernel hands the command line's unknown
# `name=value` parameters to init as environment variables:
# diskbench_mib (sequential MiB each way) and diskbench_ops (random 4 KiB
# requests each way).
#
# It measures the data disk /dev/vdc with O_DIRECT (no guest page cache:
# each request is one virtio-blk request, whose cost is the guest kernel's
# block layer and the device), sequential 1 MiB writes (then an fsync, a
# VIRTIO_BLK_T_FLUSH) and reads, then random 4 KiB writes and reads, and
# prints one line `DISKBENCH {json}` to the console.
import json
import mmap
import os
import random
import time

MIB = int(os.environ.get("diskbench_mib", "32"))
OPS = int(os.environ.get("diskbench_ops", "200"))
DEV = "/dev/vdc"

fd = os.open(DEV, os.O_RDWR | os.O_DIRECT)
big = mmap.mmap(-1, 1 << 20)  # page-aligned, as O_DIRECT wants
big.write(random.Random(1).randbytes(1 << 20))  # made in user space
small = mmap.mmap(-1, 4096)
small.write(random.Random(2).randbytes(4096))
result = {"mib": MIB, "ops": OPS}

t = time.monotonic()
for i in range(MIB):
    os.pwrite(fd, big, i << 20)
os.fsync(fd)
result["seq_write_mb_s"] = MIB * 1.048576 / (time.monotonic() - t)
t = time.monotonic()
for i in range(MIB):
    os.preadv(fd, [big], i << 20)
result["seq_read_mb_s"] = MIB * 1.048576 / (time.monotonic() - t)

rng = random.Random(3)
offsets = [rng.randrange(MIB * 256) << 12 for _ in range(OPS)]
t = time.monotonic()
for off in offsets:
    os.pwrite(fd, small, off)
os.fsync(fd)
result["rand_write_us"] = (time.monotonic() - t) * 1e6 / OPS
rng.shuffle(offsets)
t = time.monotonic()
for off in offsets:
    os.preadv(fd, [small], off)
result["rand_read_us"] = (time.monotonic() - t) * 1e6 / OPS

print("DISKBENCH " + json.dumps(result), flush=True)
# PID 1 must not exit (the kernel would panic): the benchmark stops the VM.
while True:
    time.sleep(3600)
