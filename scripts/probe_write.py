"""What a storage write costs on this host when the page cache needs new pages: CPU time per new
1.5 MiB chunk file (`write_atomic`, as the write-behind does), in batches deleted after each, some
after an idle pause. On a VM whose balloon reports free pages back to the host, memory freed a few
seconds ago must be backed again on its next use, and every page of a new file pays for it.
Usage: python3 scripts/probe_write.py [DIR]   (DIR: where to write; default the home directory)"""

from __future__ import annotations

import mmap
import os
import sys
import tempfile
import time

from hpkv.tiers.disk.io import write_atomic

SIZE, FILES = 1_572_928, 64  # the demo model's chunk record, a batch of 96 MiB


def main() -> None:
    d = tempfile.mkdtemp(
        prefix="probe-write-", dir=sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~")
    )
    mm = mmap.mmap(-1, 2 << 20)
    mm.write(os.urandom(2 << 20))
    rec = memoryview(mm)[:SIZE]
    try:
        for n, pause in enumerate((0, 0, 5, 0, 15, 0)):
            time.sleep(pause)
            t = time.process_time()
            for i in range(FILES):
                write_atomic(os.path.join(d, f"{n}-{i}"), rec)
            took = (time.process_time() - t) / FILES
            for i in range(FILES):
                os.unlink(os.path.join(d, f"{n}-{i}"))
            print(f"after {pause:2d} s idle: {took * 1e3:.2f} ms of CPU per new {SIZE / 2**20:.1f} MiB file")
    finally:
        for name in os.listdir(d):
            os.unlink(os.path.join(d, name))
        os.rmdir(d)
    balloon = os.path.exists("/sys/bus/virtio/drivers/virtio_balloon")
    print(f"virtio_balloon driver present: {balloon}")


if __name__ == "__main__":
    main()
