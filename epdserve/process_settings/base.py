"""``ProcessSettings``: the base of each ``epd-*`` process's settings (pydantic-settings).

A subclass declares its fields once (type, default, ``description``) and its ``env_prefix``;
from that come the flags (``--ring-bytes``; booleans as ``--checksum/--no-checksum``), the
environment variables (``EPD_RING_BYTES``), secret files (a file named like the variable in
``$EPD_SECRETS_DIR``, default ``/run/secrets/epd``, when that directory exists) and ``--help``.
Precedence: flag, then environment, then secret file, then default. The object is frozen: a
process reads its settings once, at start.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import ClassVar, NoReturn, Self

from pydantic import ValidationError
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    PydanticBaseSettingsSource,
    SecretsSettingsSource,
    SettingsConfigDict,
)

SECRETS_DIR_ENV = "EPD_SECRETS_DIR"
DEFAULT_SECRETS_DIR = "/run/secrets/epd"


class SettingError(ValueError):
    """A setting that cannot work; its message is the one line the operator sees."""


class Parser(argparse.ArgumentParser):
    """argparse whose refusals are one line (no usage dump) and exit status 1."""

    def error(self, message: str):
        self.exit(1, f"{self.prog}: error: {message}\n")


def refuse(prog: str, message: object) -> int:
    """Print the one line for a refused start; the exit status to return."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    return 1


def exit_process(code: int) -> NoReturn:
    """End a process whose clean shutdown is done, without the interpreter's finalization: the
    logs and standard streams are flushed, nothing else runs. A process that imported torch has
    triton loaded (torch's compiler stack, pulled in through torchvision), and this triton reports
    its bindings as leaked when the interpreter finalizes (~90 "nanobind: leaked" lines on stderr
    that look like a crash; fixed upstream by triton-lang/triton#11552, not in the release torch
    pins)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def one_line(message: object, limit: int = 400) -> str:
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ProcessSettings(BaseSettings):
    """Settings of one process. Subclasses set ``PROG`` and ``model_config``'s ``env_prefix``;
    ``from_command_line`` is how a process reads them, constructing one directly (tests,
    benchmarks, an embedding program) reads the environment too, and validates the same way."""

    model_config = SettingsConfigDict(
        frozen=True,
        extra="forbid",
        validate_default=True,
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_hide_none_type=True,
        cli_show_env_vars=True,
        cli_avoid_json=True,
    )
    PROG: ClassVar[str]

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        secrets_dir = os.environ.get(SECRETS_DIR_ENV, DEFAULT_SECRETS_DIR)
        sources = (init_settings, env_settings)
        if os.path.isdir(secrets_dir):
            sources += (SecretsSettingsSource(settings_cls, secrets_dir=secrets_dir),)
        return sources

    @classmethod
    def parser(cls) -> CliSettingsSource:
        return CliSettingsSource(cls, root_parser=Parser(prog=cls.PROG, description=cls.__doc__))

    @classmethod
    def from_command_line(cls, argv: list[str] | None = None) -> Self:
        """The settings from ``argv`` (default: ``sys.argv[1:]``) and the environment;
        ``SettingError`` (one line naming the flag and its variable) for a value that cannot work.
        ``--help`` and an unknown flag exit here, as argparse does (status 0 and 1)."""
        source = cls.parser()(args=sys.argv[1:] if argv is None else argv)
        try:
            return cls(_cli_settings_source=source)
        except ValidationError as exc:
            raise SettingError(cls.explain(exc)) from None

    @classmethod
    def explain(cls, exc: ValidationError) -> str:
        """The first error of ``exc`` as one line: ``--flag (or ENV): what is wrong``."""
        error = exc.errors(include_url=False)[0]
        message = error["msg"].removeprefix("Value error, ")
        if not error["loc"] or error["loc"][0] not in cls.model_fields:
            return message
        field = str(error["loc"][0])
        where = f"--{field.replace('_', '-')} (or {cls.env_name(field)})"
        if error["type"] == "missing" or (
            error["type"] == "string_too_short" and error.get("input") == ""
        ):
            return f"{where} is required"
        return f"{where}: {message}"

    @classmethod
    def env_name(cls, field: str) -> str:
        """The environment variable a field reads: ``ring_bytes`` -> ``EPD_RING_BYTES``."""
        return (cls.model_config.get("env_prefix", "") + field).upper()
