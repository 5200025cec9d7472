"""Process settings: one frozen, typed object per ``epd-*`` process (``ProcessSettings``), from
which its flags, its ``EPD_...`` environment variables, mounted secret files and ``--help`` are
all generated; the value types those objects share; and the start-up checks that need the
machine. An operator's mistake is one line on stderr and exit status 1, before anything starts;
a process that stopped cleanly exits without noise (``exit_process``)."""

from epdserve.process_settings.base import (
    ProcessSettings,
    SettingError,
    exit_process,
    one_line,
    refuse,
)
from epdserve.process_settings.checks import (
    check_checkpoint,
    check_device,
    check_listen,
    check_memory,
    check_shm_space,
    served_name,
)
from epdserve.process_settings.values import (
    DTYPES,
    AdvertisedHost,
    AnyPort,
    ByteSize,
    Dtype,
    NonNegativeInt,
    NonNegativeSeconds,
    Port,
    PositiveByteSize,
    PositiveInt,
    PositiveSeconds,
    ProcessorKwargs,
    TowerCompile,
    TransportNames,
    VisionAttention,
)

__all__ = [
    "ProcessorKwargs",
    "AdvertisedHost",
    "DTYPES",
    "AnyPort",
    "ByteSize",
    "Dtype",
    "NonNegativeInt",
    "Port",
    "PositiveByteSize",
    "PositiveInt",
    "NonNegativeSeconds",
    "PositiveSeconds",
    "ProcessSettings",
    "SettingError",
    "TowerCompile",
    "TransportNames",
    "VisionAttention",
    "check_checkpoint",
    "exit_process",
    "served_name",
    "check_device",
    "check_listen",
    "check_memory",
    "check_shm_space",
    "one_line",
    "refuse",
]
