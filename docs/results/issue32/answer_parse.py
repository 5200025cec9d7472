"""What a room stream's client pays to parse an answer: a frame of 8 views (with a registration,
as a writer gets them; with neither a registration nor a commit, as a begin's, a commit's or an
open's answer; with a commit, as a receiver gets a room's end) through the wire's models
(``BatchResponse.model_validate_json``, what every client does), the standard library's
``json.loads`` and msgspec's untyped decoder: microseconds per view, the best of 5 rounds of 3,000
frames.
Usage: PYTHONPATH=. .venv/bin/python docs/results/issue32/answer_parse.py OUT.json"""

import json
import sys
import timeit

import msgspec
from wire.rooms import BatchResponse

from handshake import answers
from handshake.rooms import RoomLimits, RoomTable
from tests.handshake_helpers import begin, commit, registration

ROOMS, FRAMES = 8, 3000


def frames() -> dict[str, bytes]:
    table = RoomTable(RoomLimits())
    rooms = table.mint(ROOMS, 30)

    def frame(with_registration: bool) -> bytes:
        views = table.views_json(rooms, with_registration=with_registration)
        return answers.frame([answers.viewed(r, v) for r, v in zip(rooms, views)]).encode()

    for room in rooms:
        table.register(registration(room))
    with_registration = frame(True)
    for room in rooms:
        table.begin_write(begin(room))
    plain = frame(False)
    for room in rooms:
        table.commit(commit(room))
    return {"registration": with_registration, "neither": plain, "commit": frame(False)}


def us_per_view(parse, document: bytes) -> float:
    best = min(timeit.repeat(lambda: parse(document), number=FRAMES, repeat=5))
    return round(best / FRAMES / ROOMS * 1e6, 2)


def main(out: str) -> None:
    parsers = {
        "models": BatchResponse.model_validate_json,
        "json.loads": json.loads,
        "msgspec": msgspec.json.Decoder().decode,
    }
    rows = {
        kind: {name: us_per_view(parse, document) for name, parse in parsers.items()}
        for kind, document in frames().items()
    }
    for kind, row in rows.items():
        print(f"{kind:13s}", "  ".join(f"{name} {us:5.2f} us" for name, us in row.items()))
    with open(out, "w") as file:
        json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
