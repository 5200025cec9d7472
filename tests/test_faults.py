"""Fault injection with real processes (issue 8): every role is its own process (`epd-handshake`,
`epd-encode-worker`, `epd-prefill`), faults are real signals, real closed ports, a real ENOSPC and a
real Mooncake start-up failure. The scenarios live in ``bench.faults`` (the soak repeats them at
random); each test asserts the expected outcome: only the affected rooms fail, with a reason,
within 2 s of the fault being observable; every other item arrives bit-exact (xxh3 of the rows
against this process's own tower); no receive or send slot stays leased; no /dev/shm segment
outlives its process; the processes keep serving.

The processes are shared by the module (starting them is most of the cost); victims that a test
kills are restarted by the scenario.
"""

import asyncio
import random
import time

import pytest

from epdserve.bench import faults
from epdserve.bench.faults import FaultLab, LabConfig, lab_model, serves
from epdserve.testing.receive_items import loopback_handshake

pytestmark = [pytest.mark.processes, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

# An affected room fails by the fault's detection (a broken stream, a dead peer, a refused
# contract), which the fault lab's runs put near a second (FAST_S, the soak's goal); on its item
# timeout it would fail after LabConfig.item_timeout_s (20 s). The tests tell the two apart with
# half the timeout, which a loaded machine's slower detection still keeps far below.
BEFORE_ITS_TIMEOUT_S = LabConfig.__dataclass_fields__["item_timeout_s"].default / 2


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    config = LabConfig(
        model=lab_model(str(tmp_path_factory.mktemp("lab-tower"))),
        log_dir=str(tmp_path_factory.mktemp("lab-logs")),
    )
    running = FaultLab(config).start()
    try:
        yield running
    finally:
        codes = running.stop()
    assert all(code == 0 for code in codes.values()), (
        codes
    )  # clean SIGTERM exits (victims were replaced)
    time.sleep(0.3)
    assert not running.orphan_segments(), "a /dev/shm segment outlived its process"


def run(lab, scenario, seed=0):
    async def go():
        async with lab.connect() as conn:
            return await scenario(lab, conn, random.Random(seed))

    return asyncio.run(go())


def still_serves(lab, worker="a", prefill="prefill"):
    async def go():
        async with lab.connect() as conn:
            return await serves(lab, conn, random.Random(99), worker, prefill)

    return asyncio.run(go())


def assert_no_leaks(lab, prefill="prefill"):
    """No receive slot stays leased; the ring of every worker drains; no /dev/shm segment of a lab
    process outlives it."""
    assert lab.pool_stats(prefill)["leased"] == 0
    end = time.monotonic() + 10
    while any(lab.ring_occupancy(name) for name in ("a", "v")) and time.monotonic() < end:
        time.sleep(0.05)
    assert lab.ring_occupancy("a") == 0 and lab.ring_occupancy("v") == 0
    end = time.monotonic() + 5  # a killed process's segments go with its resource tracker
    while lab.orphan_segments() and time.monotonic() < end:
        time.sleep(0.05)
    assert not lab.orphan_segments()


def assert_fast(outcome):
    """Every affected room failed, by the fault's detection rather than its item timeout: long
    before that timeout (how fast, against ``FAST_S``, is the soak's measure: epd-bench soak)."""
    assert outcome.affected, outcome
    for entry in outcome.affected:
        assert entry["state"] != "DONE", outcome.as_dict()
        assert entry["ttf_s"] is not None and entry["ttf_s"] < BEFORE_ITS_TIMEOUT_S, (
            outcome.as_dict()
        )


def assert_siblings_exact(outcome, delivered_at_least):
    assert outcome.corrupted == 0 and outcome.collateral == 0, outcome.as_dict()
    assert outcome.delivered >= delivered_at_least, outcome.as_dict()


def test_encode_worker_killed_mid_transfer(lab):
    """SIGKILL of worker v as soon as one of its rooms shows WRITING (a ~10 MB Mooncake write):
    its rooms die with it, the prefill process sees the endpoint refuse connections, fails them
    and quarantines their slots; the items from worker a arrive bit-exact."""
    outcome = run(lab, faults.worker_killed_mid_transfer, seed=1)
    assert outcome.expected, outcome.as_dict()
    assert "WRITING" in outcome.notes["states_at_kill"]
    assert_fast(outcome)
    assert_siblings_exact(outcome, 2)
    assert all("unreachable" in a["reason"] for a in outcome.affected)
    assert (
        outcome.notes["quarantined_after_failure"] > 0
    )  # held: bytes of the dead writer may be in them
    assert_no_leaks(lab)
    assert still_serves(lab)
    assert still_serves(lab, worker="v")  # the restarted victim serves too


def test_prefill_killed_after_registering_frees_the_send_slots(lab):
    """The prefill process pv registers its slots, then is SIGKILLed before the workers write
    (SHM from a, Mooncake from v): each worker ends those rooms and frees its ring slots within its
    write deadline, and serves the next request."""
    outcome = run(lab, faults.prefill_killed_after_registering, seed=2)
    assert outcome.expected, outcome.as_dict()
    for worker, ring in outcome.notes["rings"].items():
        assert ring["ring_occupancy"] == 0 and ring["ring_free_after_s"] <= ring["deadline_s"], (
            worker,
            ring,
        )
    assert all(
        state != "SUCCESS" for state in outcome.notes["room_states"]
    )  # nothing written into the dead
    assert_no_leaks(lab)
    assert still_serves(lab)
    assert still_serves(lab, worker="v", prefill="pv")


def test_handshake_endpoint_unreachable(lab):
    """Rooms at a standalone handshake that is SIGKILLed after the receiver registered, and an item
    naming a port where nothing listens: those items fail fast as unreachable; the worker gives
    up on them and frees its ring; siblings with rooms at worker a arrive."""
    outcome = run(lab, faults.handshake_unreachable, seed=3)
    assert outcome.expected, outcome.as_dict()
    assert_fast(outcome)
    assert_siblings_exact(outcome, 2)
    assert len(outcome.affected) == 3
    assert outcome.notes["worker_ring_free_after_s"] < 10
    assert_no_leaks(lab)
    assert still_serves(lab)


def test_cancel_during_a_write(lab):
    """A room cancelled while worker v's Mooncake write into pv is in flight stays WRITING (cancel
    recorded) until the writer reports, then ends CANCELLED; the prefill process frees the slot
    (the writer settled: no quarantine) and its sibling arrives."""
    outcome = run(lab, faults.cancel_during_write, seed=4)
    assert outcome.expected, outcome.as_dict()
    assert outcome.notes["state_before_cancel"] == "WRITING"
    assert outcome.notes["state_while_held"] == "WRITING" and outcome.notes["cancel_requested"]
    assert_fast(outcome)
    assert "CANCELLED" in outcome.affected[0]["reason"]
    assert_siblings_exact(outcome, 1)
    assert lab.pool_stats("pv") == {"leased": 0, "quarantined": 0}
    assert_no_leaks(lab, "pv")
    assert still_serves(lab, worker="v", prefill="pv")


def test_item_larger_than_the_receive_pool(lab):
    """Placeholders claiming more rows than the whole pool: refused at once, the room cancelled so
    the worker drops the item instead of waiting; the sibling arrives."""
    outcome = run(lab, faults.item_too_large, seed=5)
    assert outcome.expected, outcome.as_dict()
    assert_fast(outcome)
    assert "cannot reserve" in outcome.affected[0]["reason"]
    assert_siblings_exact(outcome, 1)
    assert_no_leaks(lab)


def test_item_larger_than_the_send_ring(lab):
    """In-process (the lab's tower, a real ZMQ intake and room table, loopback transport): the
    refusal happens when the worker stages the rows, before any transport or peer is involved, so a
    separate process adds nothing. The oversized item's room fails at once with the reason; the
    next item arrives bit-exact."""
    from encode_worker.config import WorkerConfig
    from encode_worker.worker import EncodeWorker
    from epdserve.data_plane.commit import checksum
    from epdserve.data_plane.loopback import LoopbackTransport
    from epdserve.wire.intake import IntakeClient
    from epdserve.wire.rooms import RoomState
    from tests.encode_helpers import Receiver

    loopback = LoopbackTransport()
    config = WorkerConfig(
        model=lab.config.model,
        transports=("loopback",),
        bootstrap_port=0,
        intake_port=0,
        bind="127.0.0.1",
        ring_bytes=1 << 20,
        ring_slot_bytes=1 << 16,
        cache_bytes=0,
        receiver_wait_s=10,
    )
    worker = EncodeWorker(config, tower=lab.tower, transports={"loopback": loopback}).start()
    receiver = Receiver(worker.table, {"loopback": loopback})
    intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
    try:
        big, small = lab.describe(
            [faults.synthetic_image(448, 448, 11), faults.synthetic_image(224, 224, 12)]
        )
        assert big.rows * faults.WIDTH * 4 > config.ring_bytes >= small.rows * faults.WIDTH * 4
        rooms = worker.table.mint(2, 60)
        for room, item in zip(rooms, (big, small)):
            receiver.reserve(room, item.rows, faults.WIDTH, lab.tower.dtype)
        started = time.monotonic()
        for room, item in zip(rooms, (big, small)):
            reply = intake.send(
                {
                    "request_id": f"ring{room}",
                    "source": "bytes",
                    "encode_handshake": loopback_handshake(room, worker.bootstrap_port),
                },
                item.data,
            )
            assert reply.ok, reply
        state, _, view = receiver.wait(rooms[0])
        assert state is RoomState.FAILED and "larger than the send ring" in view.reason
        assert time.monotonic() - started < BEFORE_ITS_TIMEOUT_S  # not at the receiver's wait
        state, rows, _ = receiver.wait(rooms[1])
        assert state is RoomState.SUCCESS and checksum(rows) == lab.reference(small.data)
        assert worker.ring.stats()["leased_slots"] == 0
    finally:
        intake.close()
        worker.stop()
        receiver.close()


def test_rows_mismatch_is_refused_before_any_byte_moves(lab):
    """One placeholder fewer than the encoder's rows: the worker checks the contract before writing
    and fails the room with both layouts in the reason; the slot is released, the sibling
    arrives."""
    outcome = run(lab, faults.rows_mismatch, seed=6)
    assert outcome.expected, outcome.as_dict()
    assert_fast(outcome)
    assert "contract mismatch" in outcome.affected[0]["reason"]
    assert_siblings_exact(outcome, 1)
    assert_no_leaks(lab)


@pytest.mark.parametrize("width_delta, dtype", [(-8, "float32"), (0, "bfloat16")])
def test_width_or_dtype_mismatch_between_the_sides(lab, width_delta, dtype):
    """A receiver configured with another width or dtype than worker a's tower (the receiver
    library in this process, as an engine embeds it, over SHM; the worker is the real process):
    the worker refuses to write, the item fails fast with the reason, the slot is released."""
    from epdserve.multimodal.items import Modality, MultimodalDataItem, MultimodalInputs
    from prefill_side import JobState, PrefillReceiver, ReceiverConfig

    receiver = PrefillReceiver(
        ReceiverConfig(
            width=faults.WIDTH + width_delta,
            dtype=dtype,
            pool_bytes=16 << 20,
            slot_bytes=1 << 18,
            transports=("shm",),
            item_timeout_s=10,
        )
    )

    async def go():
        async with lab.connect() as conn:
            (item,) = lab.describe([faults.synthetic_image(224, 224, 21)])
            await conn.mint([item], lab.roles["a"].url)
            mm = MultimodalDataItem(
                Modality.IMAGE,
                offsets=[[0, item.rows - 1]],
                encode_handshake=item.encode_handshake.model_dump(),
            )
            job = receiver.start("mismatch", MultimodalInputs([mm]))
            await conn.send(lab.roles["a"], item, "mismatch")
            sent = time.monotonic()
            await asyncio.wrap_future(job.future)
            return job, time.monotonic() - sent

    try:
        job, elapsed = asyncio.run(go())
        assert job.poll() is JobState.FAILED and "contract mismatch" in job.reasons[0], job.reasons
        assert elapsed < BEFORE_ITS_TIMEOUT_S  # at the registration's check, not its timeout
        assert (
            receiver.pool.stats()["leased_slots"] == 0
            and receiver.pool.stats()["quarantined_slots"] == 0
        )
    finally:
        receiver.close()
    assert still_serves(lab)


def test_duplicate_room_in_one_request(lab):
    """Two items of one request name one room: the second fails at once with the reason, the
    first arrives bit-exact, and no slot stays leased (the duplicate once overwrote the first
    item's entry: its slot stayed leased for good and its outcome PENDING)."""
    outcome = run(lab, faults.duplicate_room_in_one_request, seed=7)
    assert outcome.expected, outcome.as_dict()
    assert_fast(outcome)
    assert "duplicate" in outcome.affected[0]["reason"]
    assert_siblings_exact(outcome, 1)
    assert_no_leaks(lab)


def test_duplicate_room_registered_by_two_receivers(lab):
    """Two prefill processes register the same room: the later one is refused at once, the first
    gets the item bit-exact; neither leaks a slot."""
    outcome = run(lab, faults.duplicate_room_two_receivers, seed=8)
    assert outcome.expected, outcome.as_dict()
    assert_fast(outcome)
    assert_siblings_exact(outcome, 1)
    assert_no_leaks(lab)
    assert_no_leaks(lab, "pv")


def test_duplicate_room_at_the_intake(lab):
    """The same room sent twice to worker a's intake, the second time with another image of the
    same size: the second message is refused while the first is in flight, and the receiver gets
    the first image's rows bit-exact (two writers for one slot would race: the second could land
    after the receiver released the slot to a new tenant)."""
    for seed in (9, 10, 11):
        outcome = run(lab, faults.duplicate_room_at_intake, seed=seed)
        assert outcome.expected, outcome.as_dict()
        assert "already has an item in flight" in outcome.affected[0]["reason"]
        assert_siblings_exact(outcome, 1)
    assert_no_leaks(lab)
    assert still_serves(lab)


def test_encode_worker_paused_past_its_write_deadline(lab):
    """Worker v is SIGSTOPped while it writes (Mooncake), held past its write deadline, then
    resumed, so its write lands late. The prefill process must notice the stalled endpoint and fail
    those items within 2 s of the stop (their slots quarantined, not reused); the late bytes land in
    the quarantined slots, and items received right after the resume are bit-exact."""
    outcome = run(lab, faults.worker_paused_past_deadline, seed=12)
    assert outcome.expected, outcome.as_dict()
    assert "WRITING" in outcome.notes["states_at_stop"]
    assert outcome.notes["stopped_s"] > lab.config.victim_write_timeout_s
    assert_fast(outcome)
    assert_siblings_exact(
        outcome, 2 + 4
    )  # the siblings, then four items into the same pool after the resume
    assert outcome.notes["quarantined_at_resume"] > 0
    assert outcome.notes["victim_serves_after_resume"]
    assert_no_leaks(lab)


def test_malformed_frames_and_bodies_are_refused_and_every_listener_keeps_serving(lab):
    """Malformed ZMQ frames (empty, not JSON, not UTF-8, three frames, 100k-deep nesting, NaN,
    oversized metadata, a payload that is no image, pixels of the wrong size, a path-traversal SHM
    name) to worker a's intake, and malformed REST bodies to worker a's rooms, the standalone
    handshake and epd-prefill: each gets a refusal with a reason or a 4xx, never a 5xx; an SHM
    handle naming no segment is accepted and its room fails with the reason; everything serves
    on."""
    outcome = run(lab, faults.malformed_input, seed=13)
    assert outcome.expected, {key: value for key, value in outcome.notes.items()}
    assert outcome.notes["intake_replies"] == len(faults.MALFORMED_FRAMES)
    assert all(
        status is not None and 400 <= status < 500 for status in outcome.notes["http_statuses"]
    ), outcome.notes
    # the 2 MiB body, over the rooms API's 1 MiB limit: the 413 each room listener really sent
    oversized = outcome.notes["oversized_statuses"]
    assert [status for path, status in oversized.items() if "/v1/rooms" in path] == [413] * 7, (
        oversized
    )
    assert outcome.notes["bad_shm_handle"]["room"] == "FAILED"
    assert "cannot open SHM segment" in outcome.notes["bad_shm_handle"]["reason"]
    assert all(
        entry["ttf_s"] is not None and entry["ttf_s"] < BEFORE_ITS_TIMEOUT_S
        for entry in outcome.affected
    )
    assert outcome.notes["serves_after"]
    assert_no_leaks(lab)


@pytest.mark.skipif(
    not faults.can_mount_tmpfs(), reason="needs unshare(1) and CAP_SYS_ADMIN to mount a small tmpfs"
)
def test_dev_shm_full_at_start_up(lab):
    """epd-prefill in a private mount namespace whose /dev/shm (an 8 MiB tmpfs) cannot hold its
    32 MiB pool: creating the pool gets a real ENOSPC. Offered SHM and Mooncake, the process comes
    up on a Mooncake-only pool, says why, and receives bit-exact over Mooncake; offered SHM alone,
    it exits at once with a one-line error naming ENOSPC. The host's /dev/shm is untouched."""
    outcome = run(lab, faults.dev_shm_full, seed=14)
    assert outcome.expected, outcome.notes
    assert outcome.notes["shm_only_exit_code"] not in (None, 0)
    assert "No space left on device" in outcome.notes["shm_only_last_line"]
    assert outcome.notes["fallback_serves_over_mooncake"]
    assert (
        outcome.affected[0]["ttf_s"] < 60
    )  # the process start itself (imports, tower) on this machine
    assert_no_leaks(lab)


def test_mooncake_unavailable_at_start_up(lab):
    """An encode worker and a prefill process start while Mooncake cannot initialize (its whole port
    range is taken: TransferEngine.initialize returns -1): both come up SHM-only, say so, and
    serve bit-exact over SHM; a prefill process offered Mooncake alone exits with a clear error."""
    outcome = run(lab, faults.mooncake_unavailable, seed=15)
    assert outcome.expected, outcome.notes
    assert outcome.notes["serves_over_shm"]
    assert outcome.notes["worker_says"] and outcome.notes["prefill_says"]
    assert outcome.notes["mooncake_only_exit_code"] not in (None, 0)
    assert outcome.notes["exit_codes"] == [0, 0]
    assert_no_leaks(lab)


def test_quarantined_slots_come_back_when_their_quarantine_ends(lab):
    """Last: every slot the faults above held in quarantine comes back once its quarantine ends;
    nothing stays leased or quarantined for good."""
    end = time.monotonic() + lab.config.quarantine_s + 5
    while lab.pool_stats()["quarantined"] and time.monotonic() < end:
        time.sleep(0.2)
    assert lab.pool_stats() == {"leased": 0, "quarantined": 0}
