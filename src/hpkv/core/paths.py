"""The trust boundary on the file system: directories hpkv keeps chunks and pools in.

Records in a directory that another user can write are not hpkv's to trust: that
user can plant files under the (predictable) chunk names, with valid checksums.
So a pool or storage directory must be owned by the user hpkv runs as and must
not be writable by others; a group may share it only when the operator says the
group is trusted (``shared_group``). A world-writable directory with the sticky
bit (``/dev/shm``, ``/tmp``) is accepted for pool files only: they are created
with O_EXCL under this process's id, and the sticky bit keeps others from
replacing them.
"""

from __future__ import annotations

import os
import stat

from hpkv.core.errors import HpkvConfigError


def check_private_dir(
    path: str, where: str, example: str, *, shared_group: bool = False, sticky_ok: bool = False
) -> None:
    """Raise HpkvConfigError naming ``where`` unless ``path`` is a directory owned by this user and
    writable by nobody else (its group too when ``shared_group``; everyone when sticky and
    ``sticky_ok``)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise HpkvConfigError(f"{where}={path!r} cannot be used ({e.strerror}); use e.g. {example}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise HpkvConfigError(f"{where}={path!r} is not a directory; use e.g. {example}")
    me = os.geteuid()
    if st.st_uid != me and not (sticky_ok and st.st_mode & stat.S_ISVTX):
        raise HpkvConfigError(
            f"{where}={path!r} is owned by uid {st.st_uid}, not by the user hpkv runs as (uid {me}): "
            f"another user could plant chunks there; use a directory of your own, e.g. {example}"
        )
    if st.st_mode & stat.S_IWOTH and not (sticky_ok and st.st_mode & stat.S_ISVTX):
        raise HpkvConfigError(
            f"{where}={path!r} is writable by every user (mode {stat.S_IMODE(st.st_mode):o}): "
            f"anyone could plant chunks there; chmod o-w it or use e.g. {example}"
        )
    if st.st_mode & stat.S_IWGRP and not shared_group and not (sticky_ok and st.st_mode & stat.S_ISVTX):
        raise HpkvConfigError(
            f"{where}={path!r} is writable by its group (mode {stat.S_IMODE(st.st_mode):o}); "
            "if every member of that group may write chunks, set HPKV_SHARED_GROUP=true, "
            f"else chmod g-w it or use e.g. {example}"
        )


class NotARegularFile(OSError):
    pass


def read_regular_file(path: str, limit: int) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes. Never blocks on a
    FIFO or device put there (NotARegularFile); a larger file raises ValueError; OSError as usual."""
    fd = os.open(os.path.expanduser(path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotARegularFile(0, "not a regular file")
        data = b""
        while len(data) <= limit:
            part = os.read(fd, limit + 1 - len(data))
            if not part:
                break
            data += part
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return data
