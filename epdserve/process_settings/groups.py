"""Settings that several processes take alike, each group declared once (its fields' types,
defaults and descriptions) and mixed into each process's settings class: the model's public name
and processor overrides (``ModelNaming``: the encode worker, the dispatcher, the gateway,
``epd-prefill``), the room endpoints a process calls (``RoomEndpointPolicy``: the encode worker and
every receiver), a listener closed without its tokens (``ClosedListener``: every process that
listens), and the transports' own settings (``TransportSettings``: every process that
builds transports; ``ReceiverTransportSettings`` adds the address a receiver's Mooncake engine is
reached at). The receiver's own group is ``prefill_side.settings.ReceiverSettings``."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

from epdserve.process_settings.base import SettingError
from epdserve.process_settings.checks import served_name
from epdserve.process_settings.values import AdvertisedHost, ProcessorKwargs
from epdserve.wire.room_signatures import UnsignedRooms, is_loopback


class ModelNaming(BaseModel):
    """The model's public name and its processors' overrides. The name defaults to the process's
    ``model`` as given (a Hugging Face id) or its folder name (a directory), as vLLM's does."""

    served_model_name: str | None = Field(
        None,
        max_length=256,  # intake's ``model`` field: a longer name could name no item
        description="the model's public name, as vLLM's --served-model-name: in intake "
        "messages (an encode worker refuses other names) and every metric's model_name label "
        "(default: --model, a Hugging Face id as given, a directory's folder name)",
    )
    mm_processor_kwargs: ProcessorKwargs = Field(
        default_factory=dict,
        description="JSON keyword arguments over the image and video processors' configs, as "
        "vLLM's --mm-processor-kwargs (e.g. '{\"max_pixels\": 1003520}'): the same on the "
        "encode workers, the dispatcher or gateway and epd-prefill (a worker refuses an item "
        "sized otherwise)",
    )

    @model_validator(mode="after")
    def _default_served_name(self):
        model = getattr(self, "model", None)
        if not self.served_model_name and model:
            object.__setattr__(self, "served_model_name", served_name(model))
        return self


class ClosedListener(BaseModel):
    """A process that listens beyond loopback needs its tokens: it refuses to start without them,
    unless told it listens open on purpose (a lab on a private network)."""

    insecure_listen: bool = Field(
        False,
        description="listen beyond loopback without the tokens that guard this process's "
        "ports (a lab on a private network; never a cluster): the start is refused otherwise",
    )

    def closed(self, host: str, tokens: dict[str, str | None]) -> None:
        """``SettingError`` when ``host`` is beyond loopback and a token of ``tokens`` (its flag
        -> its value) is missing, unless ``insecure_listen``."""
        missing = [flag for flag, token in tokens.items() if not token]
        if missing and not is_loopback(host) and not self.insecure_listen:
            raise SettingError(
                f"listening on {host} (beyond loopback) without {' and '.join(missing)}: anyone "
                "who reaches the port could use it; give the token, listen on 127.0.0.1, or pass "
                "--insecure-listen for a lab on a private network"
            )


class RoomEndpointPolicy(BaseModel):
    """Which room endpoints a process calls with its bearer token (``wire.room_signatures``): with
    a handshake token, only those whose address the deployment signed; without one, loopback
    ones unless ``unsigned_rooms`` says any."""

    unsigned_rooms: UnsignedRooms = Field(
        "loopback",
        description="without a handshake token, the room endpoints called unsigned: loopback "
        "(the default) or any (a lab on a private network, never a cluster)",
    )


class TransportSettings(BaseModel):
    """The transports' own settings, in one group for every process that builds transports (only
    Mooncake has any: its RDMA devices and protocol); ``transport_configs`` hands each its config.
    A transport with settings adds its fields and its config here, and every process has them."""

    mooncake_ib_device: str = Field(
        "",
        description="comma-separated RDMA devices Mooncake may use, as SGLang's "
        "--disaggregation-ib-device (mlx5_0,mlx5_1; '' = every one found)",
    )
    mooncake_force_tcp: bool = Field(False, description="Mooncake over TCP even where RDMA exists")

    def transport_configs(self, hostname: str, write_timeout_s: float | None = None) -> dict:
        """``{transport: its config}`` for ``data_plane.transport.build_transports``, for a process
        reached at ``hostname`` whose writes have ``write_timeout_s`` (a writer's: Mooncake's own
        per-transfer give-up time follows it)."""
        from epdserve.data_plane.mooncake import MIN_ENGINE_TIMEOUT_S, MooncakeConfig

        engine = {}
        if write_timeout_s is not None:
            engine["transfer_timeout_s"] = max(MIN_ENGINE_TIMEOUT_S, int(write_timeout_s))
        return {
            "mooncake": MooncakeConfig(
                hostname=hostname,
                device_names=self.mooncake_ib_device,
                force_tcp=self.mooncake_force_tcp,
                **engine,
            )
        }


class ReceiverTransportSettings(TransportSettings):
    """A receiver's: the transports' settings, and the address encode workers reach its Mooncake
    engine at."""

    mooncake_host: AdvertisedHost = Field(
        "127.0.0.1",
        description="address encode workers use to reach this process's Mooncake engine (the "
        "pod IP; not 0.0.0.0)",
    )
