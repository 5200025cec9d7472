"""The room table's limits as process settings: the standalone handshake server and every encode
worker (which serves its own rooms) take the same four flags."""

from __future__ import annotations

from pydantic import Field

from epdserve.process_settings import PositiveInt, PositiveSeconds, ProcessSettings
from handshake.rooms import RoomLimits


class RoomTableSettings(ProcessSettings):
    max_live_rooms: PositiveInt = Field(
        RoomLimits.max_live_rooms,
        description="rooms alive at once; a mint beyond is refused with 503",
    )
    max_tombstones: PositiveInt = Field(
        RoomLimits.max_tombstones,
        description="ended rooms remembered (a late "
        "call for one gets its outcome, not 'unknown room')",
    )
    tombstone_ttl_s: PositiveSeconds = Field(
        RoomLimits.tombstone_ttl_s, description="how long an ended room is remembered"
    )
    max_room_ttl_s: PositiveSeconds = Field(
        RoomLimits.max_ttl_s,
        description="longest lifetime a mint may ask for (a longer ttl_s is refused)",
    )

    def room_limits(self) -> RoomLimits:
        return RoomLimits(
            self.max_live_rooms, self.max_tombstones, self.tombstone_ttl_s, self.max_room_ttl_s
        )
