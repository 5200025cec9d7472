"""The bearer tokens a process holds, as settings fields: a token comes from its file flag
(``--token-file``, ``--intake-token-file``), else from the environment or a secret file, and
never from a flag's value (a command line is visible to every user of the machine)."""

from __future__ import annotations

import os

from pydantic import Field, model_validator
from pydantic_settings import CliSuppress

from epdserve.process_settings.base import ProcessSettings, SettingError

HANDSHAKE_TOKEN_ENV = "EPD_HANDSHAKE_TOKEN"
HANDSHAKE_TOKEN_FILE_ENV = "EPD_HANDSHAKE_TOKEN_FILE"
INTAKE_TOKEN_ENV = "EPD_INTAKE_TOKEN"


def read_secret(path: str, what: str) -> str:
    """A token file's content (stripped): it must exist, be readable and not be empty;
    ``SettingError`` (one line, starting with ``what`` and the path) otherwise."""
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as exc:
        raise SettingError(f"{what} {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SettingError(f"{what} {path}: not a text file") from None
    if not token:
        raise SettingError(f"{what} {path}: the file is empty")
    return token


def handshake_token(token_file: str | None) -> str | None:
    """The room API's bearer token: from ``token_file`` (``--token-file``), else the file
    ``$EPD_HANDSHAKE_TOKEN_FILE`` names, else ``$EPD_HANDSHAKE_TOKEN``; None without one."""
    if path := token_file or os.environ.get(HANDSHAKE_TOKEN_FILE_ENV):
        return read_secret(path, "token file")
    return os.environ.get(HANDSHAKE_TOKEN_ENV) or None


class HandshakeToken(ProcessSettings):
    """The room API's bearer token: ``--token-file``, ``$EPD_HANDSHAKE_TOKEN_FILE`` or
    ``$EPD_HANDSHAKE_TOKEN`` (also under the process's own prefix)."""

    token_file: str | None = Field(
        None, description="handshake bearer token file (or $EPD_HANDSHAKE_TOKEN[_FILE])"
    )
    handshake_token: CliSuppress[str | None] = Field(None, repr=False, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _read_handshake_token(cls, data):
        if isinstance(data, dict) and not data.get("handshake_token"):
            data = {**data, "handshake_token": handshake_token(data.get("token_file"))}
        return data


class IntakeToken(ProcessSettings):
    """The encode workers' intake token: ``--intake-token-file``, else ``$EPD_INTAKE_TOKEN``
    (also under the process's own prefix)."""

    intake_token_file: str | None = Field(
        None, description=f"intake token file (or ${INTAKE_TOKEN_ENV})"
    )
    intake_token: CliSuppress[str | None] = Field(None, repr=False, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _read_intake_token(cls, data):
        if isinstance(data, dict) and not data.get("intake_token"):
            path = data.get("intake_token_file")
            token = (
                read_secret(path, "--intake-token-file")
                if path
                else os.environ.get(INTAKE_TOKEN_ENV) or None
            )
            data = {**data, "intake_token": token}
        return data
