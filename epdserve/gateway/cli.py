"""`epd-gateway`: OpenAI's chat completions API in front of encode workers and vLLM.

    epd-gateway --model /models/Qwen2.5-VL-7B-Instruct --vllm-url http://prefill:8000 \\
        --engine-url http://prefill:8001 --dns epd-encode-workers.default.svc.cluster.local

Its flags, ``EPD_GATEWAY_<FLAG>`` environment variables and ``--help`` come from
``gateway.settings.GatewaySettings``. A mistake in the command line is one line on stderr and
exit status 1.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from epdserve.gateway.settings import GatewaySettings
from epdserve.process_settings import SettingError, check_listen, exit_process, refuse


def main(argv: list[str] | None = None) -> int:
    try:  # the settings before anything heavy: a mistake is answered at once
        settings = GatewaySettings.from_command_line(argv)
        check_listen(settings.host, settings.port, "--port")
    except SettingError as exc:
        return refuse(GatewaySettings.PROG, exc)
    from epdserve.gateway.app import Gateway, build_app
    from handshake.server import serve

    try:
        settings.family()  # --model is a checkpoint of a supported family
        # flags or a checkpoint that disagree with vLLM's engine: stop, and exit 1 (below)
        gateway = Gateway(settings, on_refusal=lambda _: os.kill(os.getpid(), signal.SIGTERM))
    except SettingError as exc:
        return refuse(GatewaySettings.PROG, exc)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    serve(
        build_app(gateway),
        settings.host,
        settings.port,
        graceful_s=settings.drain_s,  # answers in flight, streams included, finish first
        ready=lambda: logging.getLogger(settings.PROG).info(
            "%s serving: http://%s:%d (/v1/chat/completions, /v1/models, /health, /readyz, "
            "/metrics) in front of vLLM at %s; /readyz says ready once vLLM's engine (%s) is read "
            "and the encode workers probed",
            settings.PROG,
            settings.host,
            settings.port,
            settings.vllm_url,
            settings.engine_url,
        ),
    )
    if gateway.readiness.refused is not None:
        exit_process(refuse(GatewaySettings.PROG, gateway.readiness.refused))
    exit_process(0)


if __name__ == "__main__":
    sys.exit(main())
