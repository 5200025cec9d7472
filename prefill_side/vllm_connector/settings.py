"""``ec_connector_extra_config``, validated: ``ConnectorSettings``."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from epdserve.process_settings.groups import ReceiverTransportSettings
from prefill_side.settings import ReceiverSettings


class ConnectorSettings(ReceiverSettings, ReceiverTransportSettings):
    """``ec_connector_extra_config``: the receiver's settings and its Mooncake engine's (the same
    groups, defaults and meanings as ``epd-prefill``'s flags), and the connector's own."""

    model_config = ConfigDict(extra="forbid")

    handshake_token_file: str | None = None  # else $EPD_HANDSHAKE_TOKEN_FILE / $EPD_HANDSHAKE_TOKEN
    # "own": the connector makes its own TransferEngine. "kv_connector": it uses the one vLLM's
    # MooncakeConnector (kv_transfer_config) runs in this process for the KV cache, so the
    # process has one engine, whose host (VLLM_HOST_IP), devices and protocol are that
    # connector's; the three mooncake_* settings above are then refused.
    mooncake_engine: Literal["own", "kv_connector"] = "own"
    # The connector's HTTP port in the process the scheduler runs in (vllm_connector.http): the
    # receiver's metrics (Prometheus, each family labelled model_name; vLLM's own /metrics is
    # served by its API server process, which does not see this one's registries) and
    # /v1/engine, the model this engine runs (a gateway reads it). None: not served. A
    # data-parallel engine serves its own on this port plus its local data-parallel rank.
    http_port: int | None = Field(None, ge=1, le=65535)
    # The address http_port binds: loopback unless set (vLLM's --host is its API server's,
    # which this process does not see); a pod scraped or read by a gateway sets 0.0.0.0.
    http_host: str = Field("127.0.0.1", min_length=1, max_length=255)

    def for_data_parallel_rank(self, rank: int) -> ConnectorSettings:
        """The settings of one data-parallel engine: ``http_port`` moved up by its local rank
        (engines on one host serve their receivers on ports of their own)."""
        if self.http_port is None or rank == 0:
            return self
        return self.model_copy(update={"http_port": self.http_port + rank})

    @model_validator(mode="after")
    def _one_owner_of_the_engines_settings(self) -> ConnectorSettings:
        own = {"mooncake_host", "mooncake_ib_device", "mooncake_force_tcp"} & self.model_fields_set
        if self.mooncake_engine == "kv_connector" and own:
            raise ValueError(
                f"mooncake_engine='kv_connector' uses vLLM's KV connector's TransferEngine, whose "
                f"host, devices and protocol are its own: drop {', '.join(sorted(own))}"
            )
        return self
