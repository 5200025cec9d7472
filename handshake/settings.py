"""Start-up checks every ``epd-*`` command shares: each operator mistake is one line on stderr and
exit status 1, before anything starts (no traceback, no process that looks ready and fails later).

Flag types (``port``, ``byte_size``, ``positive`` ...) refuse a bad value while parsing, the
environment's included (a string default goes through the flag's type too); ``check_*`` refuse
what needs the machine to judge (a port in use, a checkpoint directory, a device, memory).
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import socket
import sys

from data_plane.offers import TRANSPORT_NAMES

DTYPES = ("bfloat16", "float16", "float32")
_SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class SettingError(ValueError):
    """A setting that cannot work; its message is the one line the operator sees."""


class Parser(argparse.ArgumentParser):
    """argparse whose refusals are one line (no usage dump) and exit status 1."""

    def error(self, message: str):
        self.exit(1, f"{self.prog}: error: {message}\n")


def refuse(prog: str, message: object) -> int:
    """Print the one line for a refused start; the exit status to return."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    return 1


def one_line(message: object, limit: int = 400) -> str:
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def env_var(prefix: str, flag: str) -> str:
    """The environment variable a flag also reads: ``--ring-bytes`` -> ``<prefix>RING_BYTES``."""
    return prefix + flag.lstrip("-").replace("-", "_").upper()


def flag_parser(prog: str, description: str, env_prefix: str, flags, switches=()) -> Parser:
    """A ``Parser`` for ``flags`` (``(flag, type, default, help)``) and negatable ``switches``
    (``(flag, default, help)``: ``--x`` / ``--no-x``), each also read from the environment as
    ``<env_prefix><FLAG>``: a value there is a string default, checked by the flag's type when
    parsed (a switch's, now: a bad one is refused with one line)."""
    parser = Parser(prog=prog, description=description,
                    epilog=f"Each flag also reads {env_prefix}<FLAG> from the environment.")
    for flag, kind, default, text in flags:
        name = env_var(env_prefix, flag)
        parser.add_argument(flag, type=kind, default=os.environ.get(name, default), help=f"{text} [{name}]")
    for flag, default, text in switches:
        name = env_var(env_prefix, flag)
        try:
            value = default if name not in os.environ else switch(os.environ[name])
        except argparse.ArgumentTypeError as exc:
            parser.error(f"{name}: {exc}")
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=f"{text} [{name}=1/0]")
    return parser


# ---- flag types (argparse turns their ValueError into "invalid <name> value") -------------------


def port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is not in 1..65535")
    return value


def byte_size(text: str) -> int:
    """Bytes, optionally with a binary suffix: ``1073741824``, ``512M``, ``1G``, ``64K``."""
    body = text.strip().upper().removesuffix("B").removesuffix("I")
    suffix = body[-1:] if body[-1:] in _SIZE_SUFFIXES else ""
    try:
        value = int(float(body[: len(body) - len(suffix)]) * _SIZE_SUFFIXES[suffix])
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or with K, M, G, T)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size cannot be negative")
    return value


def positive(kind):
    """A flag type: ``kind`` (int or float) above zero, and finite."""
    def parse(text: str):
        value = kind(text)
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"{text} must be above 0" if value <= 0 else f"{text} is not finite")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def non_negative(kind):
    """A flag type: ``kind`` (int or float), zero or above, and finite."""
    def parse(text: str):
        value = kind(text)
        if not 0 <= value < math.inf:
            raise argparse.ArgumentTypeError(f"{text} must be 0 or above" if value < 0 else f"{text} is not finite")
        return value
    parse.__name__ = f"non-negative {kind.__name__}"
    return parse


def switch(text: str) -> bool:
    """``1`` / ``0`` (or true / false, yes / no, on / off)."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not 1 or 0")


def dtype(text: str) -> str:
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(DTYPES)}")
    return text


def transports(text: str) -> str:
    """A non-empty comma-separated list of known transports: the same list, in order, without
    blanks or repeats (``.split(",")`` it)."""
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in TRANSPORT_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more of {', '.join(TRANSPORT_NAMES)} "
                                         f"(comma-separated){'; unknown: ' + ', '.join(unknown) if unknown else ''}")
    return ",".join(names)


# ---- checks that need the machine --------------------------------------------------------------


def check_listen(host: str, port_number: int, what: str) -> None:
    """Refuse a port this process cannot listen on (in use, not an address of this host,
    privileged): checked by binding it once, then letting go."""
    try:
        infos = socket.getaddrinfo(host, port_number, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise SettingError(f"{what}: cannot resolve {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            hint = " (another process listens there)" if exc.errno == errno.EADDRINUSE else ""
            raise SettingError(f"{what}: cannot listen on {host}:{port_number}: {exc.strerror}{hint}") from None


def check_checkpoint(path: str, flag: str = "--model") -> str:
    """A checkpoint directory: exists, is a directory, has a config.json."""
    if not os.path.exists(path):
        raise SettingError(f"{flag} {path}: no such directory")
    if not os.path.isdir(path):
        raise SettingError(f"{flag} {path}: not a directory (give the checkpoint's directory, not a file in it)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SettingError(f"{flag} {path}: no config.json (not a Hugging Face checkpoint directory)")
    return path


def check_device(text: str) -> str:
    """A torch device this build and machine have (``cpu``, ``cuda``, ``cuda:N``)."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise SettingError(f"--device {text!r} is not a torch device (cpu, cuda, cuda:N)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SettingError(f"--device {text}: this torch build or machine has no CUDA device "
                               f"(torch {torch.__version__}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SettingError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif device.type != "cpu":
        raise SettingError(f"--device {text}: only cpu and cuda devices are supported")
    return text


def check_memory(nbytes: int, what: str) -> None:
    """Refuse an allocation this machine cannot hold (above its available memory): it would be
    killed while touching the pages, or swap."""
    available = _meminfo("MemAvailable")
    if available is not None and nbytes > available:
        raise SettingError(f"{what} of {nbytes} bytes is more than this machine's available memory "
                           f"({available} bytes)")


def check_shm_space(nbytes: int, what: str) -> None:
    """Refuse a ``/dev/shm`` segment larger than the space left there."""
    info = os.statvfs("/dev/shm")
    free = info.f_bavail * info.f_frsize
    if nbytes > free:
        raise SettingError(f"{what} of {nbytes} bytes does not fit /dev/shm: No space left on device "
                           f"({free} bytes free)")


def handshake_token(token_file: str | None) -> str | None:
    """``handshake.server.load_token`` (``--token-file``, else the environment), its failures as
    one line."""
    from handshake.server import load_token

    try:
        return load_token(token_file)
    except OSError as exc:
        raise SettingError(f"token file {exc.filename}: {exc.strerror}") from None
    except ValueError as exc:
        raise SettingError(f"token file: {exc}") from None


def read_secret(path: str, flag: str) -> str:
    """A token file's content (stripped): it must exist, be readable and not be empty."""
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as exc:
        raise SettingError(f"{flag} {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SettingError(f"{flag} {path}: not a text file") from None
    if not token:
        raise SettingError(f"{flag} {path}: the file is empty")
    return token


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
