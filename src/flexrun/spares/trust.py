"""Who the warm interpreters talk to: this user, through a directory only this user enters.

Owns the two checks every side makes before it sends anything (argv, environment, file
descriptors, processes) or serves anyone:

- the spares directory is a real directory (not a symlink, not a file), owned by this user,
  with no access for group or others (mode 0700). The daemon creates it so; a pre-existing
  one that is not so is refused, never "fixed" (another user may already have planted a
  socket in it);
- the process at the other end of a unix socket runs as this user, as the kernel says
  (``SO_PEERCRED``), never as the peer claims. A directory swapped between the check and
  the connect is caught here.

Anything else raises :class:`~flexrun.errors.SparesUntrusted` with one line naming the fix.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
from pathlib import Path

from flexrun.errors import SparesUntrusted

_UCRED = struct.Struct("3i")


def check_dir(root: Path, *, create: bool = False) -> bool:
    """True if ``root`` is a spares directory only this user can enter; False if it does not
    exist (with ``create``: it is created, mode 0700, and True).

    Raises:
        SparesUntrusted: it is a symlink, not a directory, another user's, open to group or
            others, or cannot be inspected or created.
    """
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        if not create:
            return False
        st = _create(root)
    except OSError as exc:
        raise SparesUntrusted(f"spares directory {root}: {exc.strerror}") from exc
    if stat.S_ISLNK(st.st_mode):
        raise SparesUntrusted(f"spares directory {root} is a symlink: name the real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise SparesUntrusted(f"spares directory {root} is not a directory")
    me = os.geteuid()
    if st.st_uid != me:
        raise SparesUntrusted(
            f"spares directory {root} belongs to uid {st.st_uid}, not to you (uid {me}): "
            "use a directory of your own"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise SparesUntrusted(
            f"spares directory {root} has mode {mode:04o}: it must be 0700 (chmod 700 {root})"
        )
    return True


def _create(root: Path) -> os.stat_result:
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(root, 0o700)
        os.chmod(root, 0o700)  # (a umask may have taken the owner's bits)
    except FileExistsError:
        pass  # created meanwhile, by someone: checked like any other
    except OSError as exc:
        raise SparesUntrusted(f"cannot create spares directory {root}: {exc.strerror}") from exc
    return os.lstat(root)


def peer_credentials(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of unix socket ``conn``, from the kernel
    (for a server: as it was when it started listening)."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, _gid = _UCRED.unpack(raw)
    return pid, uid


def check_peer(conn: socket.socket, what: str, *, pid: int | None = None) -> int:
    """The peer's pid, once it is known to run as this user (and, with ``pid``, to be that
    process).

    Raises:
        SparesUntrusted: another uid, or another process than ``pid``.
    """
    peer_pid, uid = peer_credentials(conn)
    me = os.geteuid()
    if uid != me:
        raise SparesUntrusted(
            f"{what} is served by uid {uid}, not by you (uid {me}): refused, nothing sent"
        )
    if pid is not None and peer_pid != pid:
        raise SparesUntrusted(
            f"{what} is served by pid {peer_pid}, not by pid {pid} as offered: refused, "
            "nothing sent"
        )
    return peer_pid


def connect(
    path: Path, what: str, timeout_s: float, *, pid: int | None = None
) -> socket.socket | None:
    """A connection to the socket at ``path`` whose server runs as this user (see
    :func:`check_peer`); None when nothing listens there. Nothing has been sent on it.

    Raises:
        SparesUntrusted: the server is not this user's (``pid``: not that process).
        OSError: the connection failed otherwise (e.g. timed out).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
            sock.close()
            return None
        check_peer(sock, what, pid=pid)
    except BaseException:
        with contextlib.suppress(OSError):
            sock.close()
        raise
    return sock
