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

import errno
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
    if sticky_ok and st.st_mode & stat.S_ISVTX:
        return  # /dev/shm-like: files are created O_EXCL, and others cannot replace them
    me = os.geteuid()
    if st.st_uid != me:
        raise HpkvConfigError(
            f"{where}={path!r} is owned by uid {st.st_uid}, not by the user hpkv runs as (uid {me}): "
            f"another user could plant chunks there; use a directory of your own, e.g. {example}"
        )
    if st.st_mode & stat.S_IWOTH:
        raise HpkvConfigError(
            f"{where}={path!r} is writable by every user (mode {stat.S_IMODE(st.st_mode):o}): "
            f"anyone could plant chunks there; chmod o-w it or use e.g. {example}"
        )
    if st.st_mode & stat.S_IWGRP and not shared_group:
        raise HpkvConfigError(
            f"{where}={path!r} is writable by its group (mode {stat.S_IMODE(st.st_mode):o}); "
            "if every member of that group may write chunks, set HPKV_SHARED_GROUP=true, "
            f"else chmod g-w it or use e.g. {example}"
        )


class NotARegularFile(OSError):
    """A name that holds something other than a regular file (a FIFO, a device, a directory, or,
    when links are not followed, a symlink)."""


def open_regular(path: str, *, follow: bool = True) -> int:
    """``path`` opened for reading if it is a regular file: never blocking on a FIFO or device put
    there (O_NONBLOCK is a no-op for regular files), a symlink not followed unless ``follow``.
    Raises NotARegularFile for anything else, OSError as usual."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise NotARegularFile(errno.ELOOP, "a symlink, not a regular file", path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotARegularFile(errno.EINVAL, "not a regular file", path)
    return fd


def read_regular_file(path: str, limit: int, *, follow: bool = True) -> bytes:
    """The bytes of ``path`` if it is a regular file (:func:`open_regular`) of at most ``limit``
    bytes; a larger file raises ValueError."""
    fd = open_regular(os.path.expanduser(path), follow=follow)
    try:
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
