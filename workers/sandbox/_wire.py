"""Wire format of the REPL sandbox, the same on every socket (host <-> zygote, host <-> REPL): a 4-byte
big-endian length, then that many bytes of JSON (UTF-8). Nothing is ever unpickled: the host parses
what a REPL sends as untrusted JSON.

Standard library only and nothing done on import: the host imports it as ``workers.sandbox._wire``,
the zygote from its own folder (see ``_child.py``).
"""

import itertools
import json
import re
import socket
import struct

MAX_FRAME = 64 << 20  # bytes; a bigger frame from a REPL is a protocol violation
# What a frame from a REPL may cost the host's parser beyond its size (SandboxConfig.max_message_mb bounds
# the size): 22 MiB of "[]," parse into some 7 million lists (over 600 MB). Items are JSON values inside
# containers, depth is the nesting of containers.
MAX_ITEMS = 250_000
MAX_DEPTH = 64
_HDR = struct.Struct("!I")
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def encode_frame(obj) -> bytes:
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), default=_json_default)
    raw = data.encode("utf-8", "surrogatepass")
    return _HDR.pack(len(raw)) + raw


def decode_payload(raw) -> object:
    return json.loads(bytes(raw).decode("utf-8", "surrogatepass"))


def bounds_error(raw: bytes) -> str | None:
    """Why parsing the JSON frame ``raw`` would cost more than its size (over MAX_ITEMS values or
    MAX_DEPTH levels of nesting), or None. Strings are skipped first, so their text never counts; the
    scan is a few passes of C-level byte operations and never builds a JSON value."""
    bare = _STRING.sub(b"0", raw)
    items = bare.count(b",") + bare.count(b"[") + bare.count(b"{")
    if items > MAX_ITEMS:
        return f"{items:,} items (at most {MAX_ITEMS:,})"
    depth = max(itertools.accumulate(map(_STEP.__getitem__, bare.translate(None, _NOT_BRACKET))), default=0)
    if depth > MAX_DEPTH:
        return f"nested {depth:,} levels deep (at most {MAX_DEPTH})"
    return None


def _json_default(obj):
    return repr(obj)


def _recv_exact(sock: socket.socket, n: int, fds: list | None = None) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if fds is not None:
            data, anc, _flags, _addr = sock.recvmsg(n - got, socket.CMSG_SPACE(16 * 4))
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(struct.unpack(f"{len(payload) // 4}i", payload[: len(payload) // 4 * 4]))
            k = len(data)
            view[got : got + k] = data
        else:
            k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("peer closed the socket")
        got += k
    return buf


def recv_frame(sock: socket.socket, fds: list | None = None):
    (n,) = _HDR.unpack(_recv_exact(sock, 4, fds))
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes exceeds the limit")
    return decode_payload(_recv_exact(sock, n))


def send_frame(sock: socket.socket, obj) -> None:
    sock.sendall(encode_frame(obj))
