"""Each process's one settings object: flags, environment variables and secret files generated
from its fields, in that order of precedence; booleans as --x/--no-x; frozen; a bad value is one
line naming the flag and the variable."""

import pytest
from pydantic import ValidationError

from encode_worker.config import WorkerConfig
from epdserve.dispatcher.cli import DispatchSettings
from epdserve.gateway.settings import GatewaySettings
from epdserve.prefill_server.settings import PrefillSettings
from epdserve.process_settings import ProcessSettings, SettingError
from handshake.server import HandshakeSettings

PROCESSES = [WorkerConfig, PrefillSettings, DispatchSettings, GatewaySettings, HandshakeSettings]
REQUIRED = {
    WorkerConfig: ["--model", "m"],
    PrefillSettings: [],
    HandshakeSettings: [],
    DispatchSettings: ["--model", "m", "--workers", "h", "a.png"],
    GatewaySettings: [
        *("--model", "m", "--workers", "h"),
        *("--vllm-url", "http://v:8000", "--engine-url", "http://v:8001"),
    ],
}


@pytest.fixture(autouse=True)
def no_epd_environment(monkeypatch, tmp_path):
    """Only what a test sets: no EPD_* variable of the machine, an empty secrets directory."""
    import os

    for name in [name for name in os.environ if name.startswith("EPD_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("EPD_SECRETS_DIR", str(tmp_path))
    # every listener on loopback (beyond it, a process needs its tokens: tested on its own)
    for variable in ("EPD_BIND", "EPD_HANDSHAKE_HOST", "EPD_PREFILL_HOST", "EPD_GATEWAY_HOST"):
        monkeypatch.setenv(variable, "127.0.0.1")


@pytest.mark.parametrize("settings", PROCESSES, ids=lambda cls: cls.PROG)
def test_every_field_is_a_described_flag_with_its_own_variable(settings, capsys):
    assert issubclass(settings, ProcessSettings)
    fields = settings.model_fields
    secrets = {name for name, field in fields.items() if field.exclude}  # read from their files
    assert all(field.description for name, field in fields.items() if name not in secrets), settings
    assert len({settings.env_name(name) for name in fields}) == len(fields)
    with pytest.raises(SystemExit) as exit_:
        settings.from_command_line(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for name in fields:
        if name in secrets or name == "images":
            continue
        assert f"--{name.replace('_', '-')}" in text and settings.env_name(name) in text, name


@pytest.mark.parametrize("settings", PROCESSES, ids=lambda cls: cls.PROG)
def test_settings_are_frozen(settings):
    made = settings.from_command_line(REQUIRED[settings])
    field = "model" if "model" in settings.model_fields else "host"
    with pytest.raises(ValidationError, match="frozen"):
        setattr(made, field, "other")


def test_a_flag_beats_the_variable_which_beats_a_secret_file(monkeypatch, tmp_path):
    (tmp_path / "EPD_RING_BYTES").write_text("64M")
    (tmp_path / "EPD_QUEUE_ITEMS").write_text("7\n")
    (tmp_path / "EPD_INTAKE_TOKEN").write_text("from-a-file")
    monkeypatch.setenv("EPD_RING_BYTES", "128M")
    settings = WorkerConfig.from_command_line(["--model", "m"])
    assert (settings.ring_bytes, settings.queue_items, settings.intake_token) == (
        128 << 20,
        7,
        "from-a-file",
    )
    assert (
        WorkerConfig.from_command_line(["--model", "m", "--ring-bytes", "32M"]).ring_bytes
        == 32 << 20
    )
    assert "from-a-file" not in repr(settings)  # a token never shows in a log line


def test_booleans_are_negatable_flags_and_read_true_false_from_the_environment(monkeypatch):
    assert WorkerConfig.from_command_line(["--model", "m"]).checksum
    assert not WorkerConfig.from_command_line(["--model", "m", "--no-checksum"]).checksum
    monkeypatch.setenv("EPD_CHECKSUM", "false")
    assert not WorkerConfig.from_command_line(["--model", "m"]).checksum
    assert WorkerConfig.from_command_line(["--model", "m", "--checksum"]).checksum
    monkeypatch.setenv("EPD_CHECKSUM", "maybe")
    with pytest.raises(SettingError, match=r"--checksum \(or EPD_CHECKSUM\)"):
        WorkerConfig.from_command_line(["--model", "m"])


@pytest.mark.parametrize(
    "args, line",
    [
        (["--ring-bytes", "lots"], "--ring-bytes (or EPD_RING_BYTES): 'lots' is not a size"),
        (["--transports", "shm,carrier-pigeon"], "unknown: carrier-pigeon"),
        (
            ["--bootstrap-port", "9000", "--intake-port", "9000"],
            "--bootstrap-port and --intake-port are both 9000",
        ),
        (["--max-live-rooms", "0"], "--max-live-rooms (or EPD_MAX_LIVE_ROOMS): 0 must be above 0"),
        (
            ["--mm-processor-kwargs", "{max_pixels: 1}"],
            "--mm-processor-kwargs (or EPD_MM_PROCESSOR",
        ),
        (["--mm-processor-kwargs", "[1, 2]"], "is not a JSON object of keyword arguments"),
        (
            ["--tombstone-ttl-s", "nan"],
            "--tombstone-ttl-s (or EPD_TOMBSTONE_TTL_S): nan is not finite",
        ),
        (  # longer than an intake message's model field: no item could name it
            ["--served-model-name", "m" * 257],
            "--served-model-name (or EPD_SERVED_MODEL_NAME)",
        ),
    ],
)
def test_a_bad_worker_setting_is_one_line_naming_flag_and_variable(args, line):
    with pytest.raises(SettingError) as refused:
        WorkerConfig.from_command_line(["--model", "m", *args])
    assert line in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("unspecified", ["0.0.0.0", "::", "[::]", "0:0::0"])
def test_an_advertised_address_cannot_be_an_unspecified_one(unspecified):
    """Peers are given ``--host`` (a worker) and ``--mooncake-host`` (a receiver) to reach the
    process at: 0.0.0.0 names no machine to them, so it is refused at start, not at the first
    write."""
    from epdserve.prefill_server.settings import PrefillSettings

    why = "is an unspecified address, which peers cannot reach"
    with pytest.raises(SettingError, match=r"--host \(or EPD_HOST\): .*" + why):
        WorkerConfig.from_command_line(["--model", "m", "--host", unspecified])
    with pytest.raises(SettingError, match=r"--mooncake-host .*" + why):
        PrefillSettings.from_command_line(["--mooncake-host", unspecified])
    for reachable in ("10.0.0.7", "encoder-0.epd.svc", "fd00::7"):
        assert WorkerConfig.from_command_line(["--model", "m", "--host", reachable]).host


def test_the_worker_room_table_limits_are_settings(monkeypatch):
    monkeypatch.setenv("EPD_MAX_TOMBSTONES", "11")
    limits = WorkerConfig.from_command_line(
        [
            "--model",
            "m",
            "--max-live-rooms",
            "5",
            "--tombstone-ttl-s",
            "2.5",
            "--max-room-ttl-s",
            "60",
        ]
    ).room_limits()
    assert (
        limits.max_live_rooms,
        limits.max_tombstones,
        limits.tombstone_ttl_s,
        limits.max_ttl_s,
    ) == (5, 11, 2.5, 60)


def test_shared_groups_read_each_process_prefix(monkeypatch):
    monkeypatch.setenv("EPD_GATEWAY_WORKERS", "10.0.0.5,[fd00::6]:9000:9001")
    monkeypatch.setenv("EPD_DISPATCH_DNS", "epd-encode-workers")
    gateway = GatewaySettings.from_command_line(
        [
            *("--model", "/models/Qwen2.5-VL-7B-Instruct"),
            *("--vllm-url", "http://v:8000/", "--engine-url", "http://v:8001"),
        ]
    )
    assert [(w.host, w.bootstrap_port, w.intake_port) for w in gateway.workers] == [
        ("10.0.0.5", 8990, 8999),
        ("fd00::6", 9000, 9001),
    ]
    assert (
        gateway.vllm_url == "http://v:8000"
        and gateway.served_model_name == "Qwen2.5-VL-7B-Instruct"
    )
    dispatch = DispatchSettings.from_command_line(["--model", "m", "a.png"])
    assert dispatch.dns == "epd-encode-workers" and dispatch.workers == ()
    with pytest.raises(SettingError, match="give the encode workers"):
        DispatchSettings.from_command_line(["--model", "m", "--dns", "", "a.png"])


HUB_PROBE = """
from epdserve.vision.tower import VisionTower
from epdserve.gateway.settings import GatewaySettings
from epdserve.process_settings import SettingError, check_checkpoint, served_name

directory = check_checkpoint("epd-tests/tiny-qwen2_5-vl")
print("dir", directory)
print("family", VisionTower.load(directory).info.family)
print("name", served_name("epd-tests/tiny-qwen2_5-vl"))
gateway = GatewaySettings.from_command_line(
    ["--model", "epd-tests/tiny-qwen2_5-vl", "--workers", "127.0.0.1", "--vllm-url", "http://v:1",
     "--engine-url", "http://v:2"]
)
print("gateway", gateway.served_model_name, gateway.image_processor().merge_size)
from epdserve.gateway.engine import EngineModel
from epdserve.vision.fingerprint import tower_fingerprint
from epdserve.wire.fingerprint import EngineDescription
engine = EngineModel.agree(gateway, EngineDescription(
    served_model_name="m", fingerprint=tower_fingerprint(VisionTower.load(directory))
))
# Qwen2.5-VL's, found by its family through the id
print("video_seconds", engine.family.video_seconds and engine.video_processor is not None)
try:
    check_checkpoint("epd-tests/not-cached")
except SettingError as exc:
    print("absent", exc)
"""


@pytest.mark.processes
def test_a_hugging_face_model_id_resolves_through_the_hub_cache(checkpoints, tmp_path):
    """``--model org/name`` (vLLM's habit) takes the checkpoint from the Hugging Face cache, offline
    here (``HF_HUB_OFFLINE=1``); its default public name is the id, as vLLM's; one not cached is one
    clear line, not a traceback."""
    import os
    import shutil
    import subprocess
    import sys

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--epd-tests--tiny-qwen2_5-vl"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(checkpoints["qwen2_5_vl"], repo / "snapshots" / commit)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": root,
    }
    result = subprocess.run(
        [sys.executable, "-c", HUB_PROBE], capture_output=True, text=True, timeout=180, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["dir"] == str(repo / "snapshots" / commit)
    assert lines["family"] == "qwen2_5_vl" and lines["name"] == "epd-tests/tiny-qwen2_5-vl"
    assert lines["gateway"] == "epd-tests/tiny-qwen2_5-vl 2" and lines["video_seconds"] == "True"
    assert "not in the Hugging Face cache" in lines["absent"] and "\n" not in lines["absent"]


def test_a_gateway_serves_an_engine_that_takes_no_request_of_grids_alone(checkpoints):
    """Gemma 3: vLLM needs the image in the request; the gateway agrees with such an engine and
    its requests carry each placed image (``PreparedChat``, by the family's
    ``grid_only_requests``): no video processor, as the family takes none."""
    from epdserve.gateway.engine import EngineModel
    from epdserve.gateway.settings import GatewaySettings
    from epdserve.vision.fingerprint import tower_fingerprint
    from epdserve.vision.tower import VisionTower
    from epdserve.wire.fingerprint import EngineDescription

    directory = checkpoints["gemma3"]
    gateway = GatewaySettings.from_command_line(
        ["--model", directory, "--workers", "127.0.0.1", "--vllm-url", "http://v:1",
         "--engine-url", "http://v:2"]
    )  # fmt: skip
    description = EngineDescription(
        served_model_name="m", fingerprint=tower_fingerprint(VisionTower.load(directory))
    )
    engine = EngineModel.agree(gateway, description)
    assert engine.family.model_type == "gemma3" and not engine.family.grid_only_requests
    assert engine.video_processor is None
