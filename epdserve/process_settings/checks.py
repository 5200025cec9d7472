"""Start-up checks that need the machine to judge (a port in use, a checkpoint directory, a
device, memory, a token file): each raises ``SettingError`` with the one line the operator sees."""

from __future__ import annotations

import errno
import functools
import os
import re
import socket

from epdserve.process_settings.base import SettingError


def check_listen(host: str, port_number: int, what: str) -> None:
    """Refuse a port this process cannot listen on (in use, not an address of this host,
    privileged): checked by binding it once, then letting go."""
    try:
        infos = socket.getaddrinfo(
            host, port_number, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise SettingError(f"{what}: cannot resolve {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            hint = " (another process listens there)" if exc.errno == errno.EADDRINUSE else ""
            raise SettingError(
                f"{what}: cannot listen on {host}:{port_number}: {exc.strerror}{hint}"
            ) from None


# a Hugging Face repo id, org/name (no "--" or "..", which the hub refuses)
MODEL_ID = re.compile(r"^(?!.*(--|\.\.))[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
PROCESSOR_FILES = ("*.json", "*.txt", "*.model", "*.jinja")  # configs, tokenizer, chat template


def is_model_id(model: str) -> bool:
    """``org/name`` and no such path here: a Hugging Face model id, as vLLM's ``--model`` takes."""
    return bool(MODEL_ID.match(model)) and not os.path.exists(model)


def served_name(model: str) -> str:
    """The model's public name when none is given: a Hugging Face id as it is (vLLM's default),
    a directory by its folder name."""
    return model if is_model_id(model) else os.path.basename(os.path.normpath(model))


def check_checkpoint(path: str, flag: str = "--model", weights: bool = True) -> str:
    """The checkpoint's local directory: ``path`` itself (exists, is a directory, has a
    config.json), or, for a Hugging Face model id, its snapshot in the Hugging Face cache (fetched
    into it first where the hub can be reached; ``HF_HUB_OFFLINE=1``, ``HF_HUB_CACHE`` as
    huggingface_hub reads them). ``weights=False``: a caller that reads configs only (the
    dispatcher, the gateway) fetches no weights."""
    if is_model_id(path):
        path = _hub_snapshot(path, flag, None if weights else PROCESSOR_FILES)
    if not os.path.exists(path):
        raise SettingError(f"{flag} {path}: no such directory")
    if not os.path.isdir(path):
        raise SettingError(
            f"{flag} {path}: not a directory (give the checkpoint's directory, not a file in it)"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SettingError(
            f"{flag} {path}: no config.json (not a Hugging Face checkpoint directory)"
        )
    return path


@functools.cache  # once per process: the gateway asks for its image and video processors and family
def _hub_snapshot(model_id: str, flag: str, files: tuple[str, ...] | None) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(model_id, allow_patterns=list(files) if files else None)
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        raise SettingError(
            f"{flag} {model_id}: not a directory here, and not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) nor fetched from the hub ({type(exc).__name__}); "
            "download it first (hf download " + model_id + ") or give its directory"
        ) from None


def check_device(text: str) -> str:
    """A torch device this build and machine have (``cpu``, ``cuda``, ``cuda:N``)."""
    if text == "cpu":  # every build has it: the checks after this one need no torch import
        return text
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise SettingError(f"--device {text!r} is not a torch device (cpu, cuda, cuda:N)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SettingError(
                f"--device {text}: this torch build or machine has no CUDA device "
                f"(torch {torch.__version__}); use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SettingError(
                f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) here"
            )
    elif device.type != "cpu":
        raise SettingError(f"--device {text}: only cpu and cuda devices are supported")
    return text


def check_memory(nbytes: int, what: str) -> None:
    """Refuse an allocation this machine cannot hold (above its available memory): it would be
    killed while touching the pages, or swap."""
    available = _meminfo("MemAvailable")
    if available is not None and nbytes > available:
        raise SettingError(
            f"{what} of {nbytes} bytes is more than this machine's available memory "
            f"({available} bytes)"
        )


def check_shm_space(nbytes: int, what: str) -> None:
    """Refuse a ``/dev/shm`` segment larger than the space left there."""
    info = os.statvfs("/dev/shm")
    free = info.f_bavail * info.f_frsize
    if nbytes > free:
        raise SettingError(
            f"{what} of {nbytes} bytes does not fit /dev/shm: No space left on device "
            f"({free} bytes free)"
        )


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
