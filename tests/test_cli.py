"""The four commands as a careless operator runs them (issue 15): each mistake is one line on
stderr and exit status 1, never a traceback, a segfault or a process that looks ready and fails
later; a successful start says where it listens; epd-dispatch names files and fails when the
prefill process does. Every command runs as its own process, on loopback."""

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from PIL import Image

from epdserve.testing.cluster import free_port
from epdserve.testing.receive_items import loopback_handshake
from epdserve.vision.small_checkpoints import build_full
from tests.encode_helpers import png

pytestmark = pytest.mark.processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {"PYTHONPATH": ROOT, "OMP_WAIT_POLICY": "PASSIVE", "MC_LOG_LEVEL": "ERROR"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_full("qwen2_5_vl", str(tmp_path_factory.mktemp("q25")))


@pytest.fixture(scope="module")
def files(tmp_path_factory, checkpoint):
    """What an operator gets wrong: a file for a directory, a checkpoint without weights, a TIFF,
    a file that is no image, a good image."""
    root = tmp_path_factory.mktemp("files")
    no_weights = root / "no-weights"
    no_weights.mkdir()
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(os.path.join(checkpoint, name), no_weights / name)
    Image.new("RGB", (32, 32)).save(root / "scan.tiff")
    (root / "notes.png").write_bytes(b"not an image")
    (root / "cat.png").write_bytes(png(64, 64, 1))
    (root / "token").write_text("secret\n")
    (root / "empty-token").write_text("\n")
    return {
        "dir": str(root),
        "file": os.path.join(checkpoint, "config.json"),
        "no_weights": str(no_weights),
        "tiff": str(root / "scan.tiff"),
        "notes": str(root / "notes.png"),
        "cat": str(root / "cat.png"),
        "empty_token": str(root / "empty-token"),
    }


def run(module, *args, env=None, timeout=180):
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **ENV, **(env or {})},
    )


def assert_refused(result, *expected):
    """Exit 1 and a single stderr line holding every ``expected`` text, no traceback."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr[-2000:]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def taken_port():
    """A port another process (this one) listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def wait_http(url: str, process, seconds: float = 120) -> None:
    end = time.monotonic() + seconds
    while True:
        assert process.poll() is None, f"{url}: the process exited with {process.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() >= end:
            raise TimeoutError(f"{url} did not answer 200 within {seconds} s")
        time.sleep(0.1)


def stop(process, log_path) -> str:
    """SIGTERM, a clean exit (0), and the process's log."""
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0
    with open(log_path) as f:
        return f.read()


def spawn(module, args, log_path):
    log = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, "-m", module, *map(str, args)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, **ENV},
    )
    log.close()
    return process


# ---- epd-encode-worker -------------------------------------------------------------------------


WORKER_MISTAKES = [
    (["--model", "/nonexistent/model"], {}, ["--model /nonexistent/model: no such directory"]),
    (
        ["--dtype", "nonsense"],
        {},
        ["--dtype", "'nonsense' is not one of bfloat16, float16, float32"],
    ),
    (["--transports", ""], {}, ["--transports", "give one or more of shm, mooncake, loopback"]),
    (["--transports", "shm,carrier-pigeon"], {}, ["unknown: carrier-pigeon"]),
    (["--intake-port", "70000"], {}, ["--intake-port", "port 70000 is not in 0..65535"]),
    (["--queue-items", "-1"], {}, ["--queue-items", "-1 must be above 0"]),
    (["--ring-slot-bytes", "0"], {}, ["--ring-slot-bytes", "0 must be above 0"]),
    (
        ["--ring-slot-bytes", "2M", "--ring-bytes", "1M"],
        {},
        ["--ring-slot-bytes 2097152 is larger than the ring"],
    ),
    (["--receiver-wait-s", "inf"], {}, ["--receiver-wait-s", "inf is not finite"]),
    (["--write-timeout-s", "nan"], {}, ["--write-timeout-s", "nan is not finite"]),
    (
        ["--ring-bytes", "100T"],
        {},
        ["--ring-bytes of 109951162777600 bytes is more than this machine's available memory"],
    ),
    (
        ["--token-file", "/nonexistent/token"],
        {},
        ["token file /nonexistent/token: No such file or directory"],
    ),
    (
        ["--intake-token-file", "/nonexistent/token"],
        {},
        ["--intake-token-file /nonexistent/token: No such file"],
    ),
    ([], {"EPD_RING_BYTES": "lots"}, ["--ring-bytes", "'lots' is not a size"]),
    ([], {"EPD_MODEL": ""}, ["--model (or EPD_MODEL) is required"]),
]


@pytest.mark.parametrize("args, env, expected", WORKER_MISTAKES)
def test_encode_worker_refuses_a_bad_setting_in_one_line(checkpoint, args, env, expected):
    ports = ["--bind", "127.0.0.1", "--bootstrap-port", free_port(), "--intake-port", free_port()]
    model = [] if "EPD_MODEL" in env else ["--model", checkpoint]
    assert_refused(run("encode_worker.cli", *model, *ports, *args, env=env), *expected)


def test_encode_worker_refuses_a_checkpoint_it_cannot_use(files):
    ports = ["--bind", "127.0.0.1", "--bootstrap-port", free_port(), "--intake-port", free_port()]
    assert_refused(run("encode_worker.cli", "--model", files["file"], *ports), "not a directory")
    assert_refused(run("encode_worker.cli", "--model", files["dir"], *ports), "no config.json")
    assert_refused(
        run("encode_worker.cli", "--model", files["no_weights"], *ports),
        "cannot load the vision tower",
        "no file named model.safetensors",
    )
    if not torch.cuda.is_available():
        assert_refused(
            run("encode_worker.cli", "--model", files["no_weights"], *ports, "--device", "cuda:0"),
            "--device cuda:0: this torch build or machine has no CUDA device",
        )


@pytest.mark.parametrize("which", ["--bootstrap-port", "--intake-port"])
def test_encode_worker_refuses_a_port_in_use(checkpoint, taken_port, which):
    ports = {"--bootstrap-port": free_port(), "--intake-port": free_port(), which: taken_port}
    result = run(
        "encode_worker.cli",
        "--model",
        checkpoint,
        "--bind",
        "127.0.0.1",
        "--transports",
        "shm,mooncake",
        *[str(x) for pair in ports.items() for x in pair],
    )
    assert_refused(
        result, f"{which}: cannot listen on 127.0.0.1:{taken_port}", "Address already in use"
    )


def test_a_port_taken_after_the_checks_stops_the_worker_cleanly(checkpoint):
    """The intake port is taken between the check and the bind (or by a library caller): start()
    refuses it in one line and stops what it had started; with Mooncake loaded that used to end
    the process in a segmentation fault (exit 139)."""
    script = f"""
import socket
from encode_worker.config import WorkerConfig
from encode_worker.worker import EncodeWorker
from epdserve.process_settings import SettingError
taken = socket.socket(); taken.bind(("127.0.0.1", 0)); taken.listen()
config = WorkerConfig(model={checkpoint!r}, dtype="float32", bind="127.0.0.1", bootstrap_port=0,
                      intake_port=taken.getsockname()[1], transports=("shm", "mooncake"),
                      ring_bytes=8 << 20)
try:
    EncodeWorker(config).start()
except SettingError as exc:
    print("refused:", exc)
"""
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, **ENV},
    )
    stdout, stderr = process.communicate(timeout=180)
    assert process.returncode == 0, (process.returncode, stderr[-2000:])
    assert "refused: intake port: cannot listen on 127.0.0.1" in stdout
    assert (
        glob.glob(f"/dev/shm/epd-*-{process.pid}-*") == []
    )  # segment names carry their creator's pid


def test_encode_worker_says_it_started_and_logs_item_failures_once(checkpoint, tmp_path):
    from epdserve.wire.intake import IntakeClient

    bootstrap, intake_port = free_port(), free_port()
    log_path = tmp_path / "worker.log"
    process = spawn(
        "encode_worker.cli",
        [
            "--model",
            checkpoint,
            "--dtype",
            "float32",
            "--bind",
            "127.0.0.1",
            "--bootstrap-port",
            bootstrap,
            "--intake-port",
            intake_port,
            "--transports",
            "shm",
            "--ring-bytes",
            "32M",
        ],
        log_path,
    )
    try:
        wait_http(f"http://127.0.0.1:{bootstrap}/readyz", process)
        intake = IntakeClient(f"tcp://127.0.0.1:{intake_port}")
        room = 12345  # never minted here: the item is refused, its room cannot be failed
        reply = intake.send(
            {
                "request_id": "bad",
                "source": "bytes",
                "encode_handshake": loopback_handshake(room, bootstrap),
            },
            b"not an image",
        )
        assert reply.ok is False
        assert intake.send_raw([b"not json"]).ok is False
        intake.close()
    finally:
        log = stop(process, log_path)
    ready = [line for line in log.splitlines() if "encode worker ready" in line]
    assert len(ready) == 1, log
    for text in (
        checkpoint,
        f"http://127.0.0.1:{bootstrap}",
        f"tcp://127.0.0.1:{intake_port}",
        "transports shm",
        "float32 on cpu",
    ):
        assert text in ready[0], ready[0]
    assert (
        sum(f"room {room} failed: cannot read image header" in line for line in log.splitlines())
        == 1
    ), log
    assert (
        sum(
            "intake refused an item" in line and "bad metadata" in line for line in log.splitlines()
        )
        == 1
    ), log
    assert "Traceback" not in log and "nanobind" not in log, log[-3000:]


# ---- epd-handshake -----------------------------------------------------------------------------


def test_handshake_refuses_bad_settings_and_says_where_it_serves(files, taken_port, tmp_path):
    assert_refused(
        run("handshake.server", "--host", "127.0.0.1", "--port", taken_port),
        f"--port: cannot listen on 127.0.0.1:{taken_port}",
        "Address already in use",
    )
    assert_refused(run("handshake.server", "--port", "70000"), "port 70000 is not in 1..65535")
    assert_refused(
        run("handshake.server", "--port", free_port(), "--token-file", "/nonexistent/token"),
        "token file /nonexistent/token: No such file or directory",
    )
    assert_refused(
        run("handshake.server", "--port", free_port(), "--token-file", files["empty_token"]),
        "is empty",
    )
    assert_refused(
        run("handshake.server", "--max-live-rooms", "-5"), "--max-live-rooms", "-5 must be above 0"
    )
    assert_refused(
        run("handshake.server", env={"EPD_HANDSHAKE_PORT": "eighty"}),
        "--port (or EPD_HANDSHAKE_PORT): 'eighty' is not a port number",
    )
    port = free_port()
    process = spawn(
        "handshake.server", ["--host", "127.0.0.1", "--port", port], tmp_path / "handshake.log"
    )
    wait_http(f"http://127.0.0.1:{port}/healthz", process)
    log = stop(process, tmp_path / "handshake.log")
    assert (
        f"epd-handshake serving rooms on http://127.0.0.1:{port}" in log
        and "bearer token off" in log
    ), log


# ---- epd-prefill -------------------------------------------------------------------------------


PREFILL_MISTAKES = [
    (["--width", "96", "--dtype", "nonsense"], ["--dtype", "'nonsense' is not one of"]),
    (["--width", "96", "--slot-bytes", "0"], ["--slot-bytes", "0 must be above 0"]),
    (
        ["--width", "96", "--slot-bytes", "2M", "--pool-bytes", "1M"],
        ["--slot-bytes 2097152 is larger than --pool-bytes"],
    ),
    (
        ["--width", "96", "--pool-bytes", "100T"],
        ["--pool-bytes of 109951162777600 bytes is more than this machine's"],
    ),
    (["--width", "96", "--transports", ""], ["--transports", "give one or more of"]),
    (["--width", "96", "--port", "70000"], ["port 70000 is not in 1..65535"]),
    (
        ["--width", "96", "--token-file", "/nonexistent/token"],
        ["token file /nonexistent/token: No such file"],
    ),
    (
        ["--width", "96", "--deepstack-width", "96"],
        ["--deepstack-width 96 leaves no main embedding"],
    ),
    ([], ["give --width (or --model to read it from the checkpoint)"]),
    (["--model", "/nonexistent/model"], ["--model /nonexistent/model: no such directory"]),
]


@pytest.mark.parametrize("args, expected", PREFILL_MISTAKES)
def test_prefill_refuses_a_bad_setting_in_one_line(args, expected):
    assert_refused(
        run("epdserve.prefill_server.cli", "--host", "127.0.0.1", "--port", free_port(), *args),
        *expected,
    )


def test_prefill_refuses_a_checkpoint_or_port_it_cannot_use(checkpoint, files, taken_port):
    assert_refused(
        run(
            "epdserve.prefill_server.cli",
            "--host",
            "127.0.0.1",
            "--port",
            free_port(),
            "--model",
            files["no_weights"],
        ),
        "cannot load the vision tower",
    )
    assert_refused(
        run(
            "epdserve.prefill_server.cli",
            "--host",
            "127.0.0.1",
            "--port",
            free_port(),
            "--model",
            checkpoint,
            "--width",
            "5",
        ),
        "--width 5 differs from the checkpoint's (96)",
    )
    assert_refused(
        run(
            "epdserve.prefill_server.cli",
            "--host",
            "127.0.0.1",
            "--port",
            taken_port,
            "--width",
            "96",
        ),
        f"--port: cannot listen on 127.0.0.1:{taken_port}",
    )


# ---- epd-dispatch ------------------------------------------------------------------------------


def test_dispatch_names_the_file_it_refuses(checkpoint, files):
    workers = ["--workers", "127.0.0.1:1:1"]
    line = assert_refused(
        run(
            "epdserve.dispatcher.cli", "--model", checkpoint, *workers, files["cat"], files["notes"]
        ),
        f"{files['notes']}: not an image encode workers read",
    )
    assert "BytesIO" not in line and "image 1" not in line
    assert_refused(
        run("epdserve.dispatcher.cli", "--model", checkpoint, *workers, files["tiff"]),
        f"{files['tiff']}: image format 'TIFF' is not accepted",
    )
    assert_refused(
        run("epdserve.dispatcher.cli", "--model", checkpoint, *workers, "/nonexistent/a.png"),
        "/nonexistent/a.png: No such file or directory",
    )
    assert_refused(
        run("epdserve.dispatcher.cli", "--model", files["file"], *workers, files["cat"]),
        "not a directory",
    )
    assert_refused(
        run("epdserve.dispatcher.cli", "--model", checkpoint, files["cat"]),
        "give the encode workers",
    )
    assert_refused(
        run("epdserve.dispatcher.cli", "--model", checkpoint, "--workers", "h:70000", files["cat"]),
        "--workers",
        "ports must be in 1..65535",
    )
    assert_refused(
        run(
            "epdserve.dispatcher.cli",
            "--model",
            checkpoint,
            *workers,
            "--prefill",
            "prefill:9100",
            files["cat"],
        ),
        "--prefill",
        "'prefill:9100' is not an http:// URL",
    )


def test_dispatch_exits_non_zero_when_the_prefill_process_fails_items(checkpoint, files, tmp_path):
    """The worker takes the item, and the prefill process reports it FAILED (it reserved rows of
    the wrong width: the worker refuses the write): epd-dispatch used to exit 0."""
    from encode_worker.config import WorkerConfig
    from encode_worker.worker import EncodeWorker
    from epdserve.data_plane.shm_transport import ShmTransport
    from epdserve.vision.tower import VisionTower

    worker = EncodeWorker(
        WorkerConfig(
            model=checkpoint,
            dtype="float32",
            bind="127.0.0.1",
            bootstrap_port=0,
            intake_port=0,
            transports=("shm",),
            ring_bytes=8 << 20,
            ring_slot_bytes=1 << 16,
        ),
        tower=VisionTower.load(checkpoint),
        transports={"shm": ShmTransport()},
    ).start()
    port = free_port()
    prefill = spawn(
        "epdserve.prefill_server.cli",
        [
            "--host",
            "127.0.0.1",
            "--port",
            port,
            "--width",
            "8",
            "--dtype",
            "float32",
            "--transports",
            "shm",
            "--pool-bytes",
            "16M",
            "--slot-bytes",
            "64K",
        ],
        tmp_path / "prefill.log",
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", prefill)
        result = run(
            "epdserve.dispatcher.cli",
            "--model",
            checkpoint,
            "--workers",
            f"127.0.0.1:{worker.bootstrap_port}:{worker.intake_port}",
            "--prefill",
            f"http://127.0.0.1:{port}",
            files["cat"],
        )
    finally:
        prefill_log = stop(prefill, tmp_path / "prefill.log")
        worker.stop()
    assert f"epd-prefill ready: http://127.0.0.1:{port}" in prefill_log, prefill_log
    assert "rows of 8 x float32; transports shm" in prefill_log, prefill_log
    assert result.returncode == 1, (result.stdout[-2000:], result.stderr[-2000:])
    assert '"state": "FAILED"' in result.stdout
    assert (
        f"{files['cat']}: prefill FAILED" in result.stderr and "contract mismatch" in result.stderr
    )
    assert "Traceback" not in result.stderr


# ---- "ready" means serving ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "module, args, line",
    [
        (
            "epdserve.gateway.cli",
            [
                *("--vllm-url", "http://127.0.0.1:9", "--engine-url", "http://127.0.0.1:9"),
                *("--workers", "127.0.0.1:9:10"),
            ],
            "epd-gateway serving: http://127.0.0.1:{port}",
        ),
        ("handshake.server", [], "epd-handshake serving rooms on http://127.0.0.1:{port}"),
        (
            "epdserve.prefill_server.cli",
            ["--width", "64"],
            "epd-prefill ready: http://127.0.0.1:{port}",
        ),
    ],
)
def test_a_server_says_it_is_ready_only_once_it_answers_and_stops_quietly(
    checkpoint, module, args, line
):
    """The moment its "ready" line is written, the server answers on its port (an operator, or a
    script waiting for that line, may call it at once); stopped, it exits 0 without noise (no
    "nanobind: leaked" lines from the triton that torch loads)."""
    port = free_port()
    if module == "epdserve.gateway.cli":
        args = [*args, "--model", checkpoint]
    process = subprocess.Popen(
        [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={**os.environ, **ENV},
    )
    expected, seen = line.format(port=port), []
    try:
        for output in process.stdout:  # ends when the process does: the check below says why
            seen.append(output)
            if expected in output:
                break
        assert expected in "".join(seen), "".join(seen)[-3000:]
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # accepted at once: refused would raise
    finally:
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=60)
    assert process.returncode == 0
    assert "nanobind" not in rest and "Traceback" not in rest, rest[-3000:]


# ---- closed by default -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module, args, missing",
    [
        (
            "encode_worker.cli",
            ["--model", "{checkpoint}", "--bind", "0.0.0.0"],
            "--token-file and --intake-token-file",
        ),
        ("handshake.server", ["--host", "0.0.0.0"], "--token-file"),
        ("epdserve.prefill_server.cli", ["--host", "0.0.0.0", "--width", "64"], "--token-file"),
        (
            "epdserve.gateway.cli",
            [
                *("--host", "0.0.0.0", "--model", "{checkpoint}", "--workers", "127.0.0.1"),
                *("--vllm-url", "http://127.0.0.1:9", "--engine-url", "http://127.0.0.1:9"),
            ],
            "--api-key-file",
        ),
    ],
)
def test_a_process_listening_beyond_loopback_needs_its_token(checkpoint, module, args, missing):
    """Every process that listens refuses to start beyond loopback without the token that guards
    its ports, saying which flag gives it; --insecure-listen is the lab's way past it."""
    args = [arg.format(checkpoint=checkpoint) for arg in args]
    environment = {
        name: "" for name in ("EPD_HANDSHAKE_TOKEN", "EPD_HANDSHAKE_TOKEN_FILE", "EPD_INTAKE_TOKEN")
    }
    line = assert_refused(run(module, *args, env=environment), "beyond loopback", missing)
    assert "--insecure-listen" in line
