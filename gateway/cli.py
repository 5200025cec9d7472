"""`epd-gateway`: OpenAI's chat completions API in front of encode workers and vLLM.

    epd-gateway --model /models/Qwen2.5-VL-7B-Instruct --vllm-url http://prefill:8000 \\
        --dns epd-encode-workers.default.svc.cluster.local

``--model`` is the checkpoint vLLM serves, read for its image processor config only (rows per
image, as the encode workers compute them). Every flag also reads ``EPD_GATEWAY_<FLAG>`` from the
environment. A mistake in the command line is one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from handshake.settings import (
    SettingError,
    byte_size,
    check_checkpoint,
    check_listen,
    env_var,
    flag_parser,
    handshake_token,
    non_negative,
    port,
    positive,
    read_secret,
    refuse,
)

PROG = "epd-gateway"
FLAGS = [
    # (flag, type, default, help)
    ("--host", str, "0.0.0.0", "address to listen on"),
    ("--port", port, 8000, "port to listen on"),
    ("--model", str, None, "checkpoint directory vLLM serves (its image processor config sizes each image)"),
    ("--served-model-name", str, None, "the model's name in metrics and intake messages, as the encode "
                                         "workers' --served-model (default: --model's folder name, theirs too)"),
    ("--vllm-url", str, None, "the vLLM OpenAI server with the EPD connector, http://host:port"),
    ("--workers", str, "", "static encode workers: comma-separated host[:bootstrap_port[:intake_port]]"),
    ("--dns", str, "", "DNS name listing the encode workers (a Kubernetes headless Service)"),
    ("--bootstrap-port", port, 8998, "workers' bootstrap (rooms) port, with --dns"),
    ("--intake-port", port, 8999, "workers' intake port, with --dns"),
    ("--rooms-url", str, "", "standalone handshake endpoint for all rooms (default: each item's worker)"),
    ("--near", str, "", "host of the vLLM engine: its encode workers go first (same-node SHM)"),
    ("--token-file", str, None, "handshake bearer token file (or $EPD_HANDSHAKE_TOKEN[_FILE])"),
    ("--intake-token-file", str, None, "intake token file (or $EPD_INTAKE_TOKEN)"),
    ("--max-image-bytes", byte_size, "20M", "largest image taken (data URI or fetched)"),
    ("--fetch-timeout-s", positive(float), 10.0, "time to fetch one http(s) image, redirects included"),
    ("--max-redirects", non_negative(int), 3, "redirects followed when fetching an image"),
    ("--max-body-bytes", byte_size, "100M", "largest request body taken"),
    ("--max-in-flight", positive(int), 256, "chat requests served at once; one more gets 503 and Retry-After"),
    ("--request-timeout-s", positive(float), 600.0, "time for vLLM's whole answer"),
    ("--log-level", str, "info", "debug, info, warning, error"),
]
SWITCHES = [
    # (flag, default, help): --flag / --no-flag
    ("--allow-private-urls", False, "fetch image URLs on loopback, private and link-local addresses"),
    ("--retry-colocated", True, "when a request's encode-worker images fail inside vLLM, send it once more "
                                "with the images inline (vLLM encodes them)"),
]


def env_name(flag: str) -> str:
    return env_var("EPD_GATEWAY_", flag)


def build_parser() -> argparse.ArgumentParser:
    return flag_parser(PROG, __doc__.split("\n\n")[0], "EPD_GATEWAY_", FLAGS, SWITCHES)


def settings_from(args):
    """The ``GatewaySettings`` the command line names, checked."""
    import yarl

    from dispatcher.workers import WorkerAddress
    from gateway.app import GatewaySettings

    if not args.model:
        raise SettingError("--model (or EPD_GATEWAY_MODEL) is required")
    check_checkpoint(args.model)
    if not args.vllm_url:
        raise SettingError("--vllm-url (or EPD_GATEWAY_VLLM_URL) is required")
    for flag, value in (("--vllm-url", args.vllm_url), ("--rooms-url", args.rooms_url)):
        if value:
            url = yarl.URL(value)
            if url.scheme not in ("http", "https") or not url.host:
                raise SettingError(f"{flag} {value!r} is not an http:// URL")
    try:
        static = tuple(WorkerAddress.parse(w) for w in args.workers.split(",") if w.strip())
    except ValueError as exc:
        raise SettingError(f"--workers: {exc}") from None
    if not static and not args.dns:
        raise SettingError("give the encode workers: --workers host[:bootstrap_port[:intake_port]],... or --dns NAME")
    intake_token = (read_secret(args.intake_token_file, "--intake-token-file") if args.intake_token_file
                    else os.environ.get("EPD_INTAKE_TOKEN") or None)
    if args.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise SettingError(f"--log-level {args.log_level!r}: one of debug, info, warning, error")
    served = args.served_model_name or os.path.basename(os.path.normpath(args.model))  # as the workers' default
    return GatewaySettings(
        vllm_url=args.vllm_url.rstrip("/"), served_model_name=served,
        workers=static, dns=args.dns or None, bootstrap_port=args.bootstrap_port, intake_port=args.intake_port,
        rooms_url=args.rooms_url or None, near=args.near or None, handshake_token=handshake_token(args.token_file),
        intake_token=intake_token, max_image_bytes=args.max_image_bytes, fetch_timeout_s=args.fetch_timeout_s,
        max_redirects=args.max_redirects, allow_private_urls=args.allow_private_urls,
        max_body_bytes=args.max_body_bytes, max_in_flight=args.max_in_flight, request_timeout_s=args.request_timeout_s,
        retry_colocated=args.retry_colocated)


def processor_of(model: str):
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise SettingError(f"--model {model}: cannot read its image processor config: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    from gateway.app import Gateway, build_app
    from handshake.server import serve

    args = build_parser().parse_args(argv)
    try:
        settings = settings_from(args)
        processor = processor_of(args.model)
        check_listen(args.host, args.port, "--port")
    except SettingError as exc:
        return refuse(PROG, exc)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger(PROG).info("%s ready: http://%s:%d (/v1/chat/completions, /v1/models, /health, /readyz, "
                                 "/metrics) in front of vLLM at %s", PROG, args.host, args.port, settings.vllm_url)
    serve(build_app(Gateway(settings, processor)), args.host, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
