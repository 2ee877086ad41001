"""Keys that authenticate every request to a job's network-facing servers (embedded store, control channel).

A server opens each connection with a fresh random challenge; the client's request line carries the
id of the key it signs with and an HMAC-SHA256 of the challenge and the request, and the reply is
signed the same way. A request replayed on another connection, altered on the way, or signed with
any other key is refused before its JSON is parsed.

Where keys come from (see docs/security.md):

- the embedded store: the job's secret, the same on every node: ``ETC_AGENT_SECRET`` (the secret
  itself) or ``ETC_AGENT_SECRET_FILE`` / ``--rdzv-conf secret_file=PATH`` (a file holding it). A store
  that listens on loopback only needs neither: the agent that hosts it writes a random secret to a
  file only this user can read (:func:`local_secret_path`), where the other agents and ``etc-agent``
  find it;
- the control channel: each agent makes a random key per run; worker ``local_rank`` gets only its own
  key, derived from it (:func:`derive`), in ``ETC_AGENT_TOKEN``; a sidecar's workers, which another
  launcher starts, derive theirs from the job's secret.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CHALLENGE_BYTES = 16
MIN_SECRET_BYTES = 16
"""A secret shorter than this is refused (it could be guessed)."""
SECRET_ENV = "ETC_AGENT_SECRET"
SECRET_FILE_ENV = "ETC_AGENT_SECRET_FILE"
TOKEN_ENV = "ETC_AGENT_TOKEN"
"""A worker's control-channel key: ``<key id>:<hex key>``, set by its agent."""


class AuthError(ValueError):
    """A key could not be found or read (a user mistake: one line, exit 2)."""


@dataclass(frozen=True)
class Key:
    """A signing key and the id the server looks it up by (sent in the clear with each request)."""

    id: str
    secret: bytes

    def __post_init__(self) -> None:
        assert self.id and " " not in self.id and len(self.id) <= 64, self.id

    def sign(self, *parts: bytes) -> str:
        return hmac.new(self.secret, b"\n".join(parts), hashlib.sha256).hexdigest()

    def verify(self, mac: str, *parts: bytes) -> bool:
        return hmac.compare_digest(self.sign(*parts), mac)

    def token(self) -> str:
        """The form a worker gets in ``ETC_AGENT_TOKEN``."""
        return f"{self.id}:{self.secret.hex()}"

    @classmethod
    def from_token(cls, text: str) -> Key:
        key_id, sep, hex_secret = text.strip().partition(":")
        try:
            secret = bytes.fromhex(hex_secret)
        except ValueError:
            secret = b""
        if not sep or not key_id or len(secret) < MIN_SECRET_BYTES:
            raise AuthError(f"{TOKEN_ENV}: expected <key id>:<hex key of at least {MIN_SECRET_BYTES} bytes>")
        return cls(key_id, secret)


KeyLookup = Callable[[str], Key | None]
"""What a server knows: the key of an id, or None (the request is refused)."""


def derive(master: bytes, key_id: str) -> Key:
    """The key of ``key_id`` under ``master``: a server holding ``master`` recomputes it per request."""
    return Key(key_id, hmac.new(master, b"etc-agent key " + key_id.encode(), hashlib.sha256).digest())


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def challenge() -> bytes:
    return secrets.token_hex(CHALLENGE_BYTES).encode()


def secret_from_text(text: str, where: str) -> bytes:
    secret = text.strip().encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise AuthError(f"{where}: the job's secret must be at least {MIN_SECRET_BYTES} characters")
    return secret


def read_secret_file(path: str | Path, where: str) -> bytes:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise AuthError(f"{where} {path}: cannot read the job's secret ({err})") from None
    return secret_from_text(text, f"{where} {path}")


def configured_secret(secret_file: str | None = None) -> bytes | None:
    """The job's secret the user gave (``secret_file``, else ``ETC_AGENT_SECRET``, else
    ``ETC_AGENT_SECRET_FILE``), or None."""
    if secret_file:
        return read_secret_file(secret_file, "--rdzv-conf secret_file")
    if os.environ.get(SECRET_ENV):
        return secret_from_text(os.environ[SECRET_ENV], SECRET_ENV)
    if os.environ.get(SECRET_FILE_ENV):
        return read_secret_file(os.environ[SECRET_FILE_ENV], SECRET_FILE_ENV)
    return None


def _runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"etc-agent-{os.getuid()}"


def local_secret_path(endpoint: str, run_id: str) -> Path:
    """Where the agent hosting a loopback-only store keeps the job's secret for this user's processes."""
    name = hashlib.sha256(f"{endpoint}\n{run_id}".encode()).hexdigest()[:24]
    return _runtime_dir() / f"{name}.secret"


def write_local_secret(endpoint: str, run_id: str, secret: bytes) -> None:
    """``secret`` in :func:`local_secret_path` (mode 0600 in a 0700 directory), replacing a stale one."""
    directory = _runtime_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if directory.stat().st_uid != os.getuid() or directory.stat().st_mode & 0o077:
        raise AuthError(f"{directory}: not a private directory of this user; set {SECRET_ENV} instead")
    path = local_secret_path(endpoint, run_id)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".secret-")
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    os.replace(tmp, path)


def read_local_secret(endpoint: str, run_id: str) -> bytes | None:
    path = local_secret_path(endpoint, run_id)
    try:
        return path.read_bytes().strip() or None
    except OSError:
        return None


def remove_local_secret(endpoint: str, run_id: str) -> None:
    try:
        local_secret_path(endpoint, run_id).unlink()
    except OSError:
        pass


STORE_KEY_ID = "job"
"""The embedded store knows one key: the job's secret."""


def worker_key_id(local_rank: int) -> str:
    return f"w{local_rank}"


def worker_rank_of(key_id: str) -> int | None:
    """The local rank a control-channel key id names, or None."""
    if key_id.startswith("w") and key_id[1:].isdigit() and len(key_id) <= 8:
        return int(key_id[1:])
    return None


def control_master(configured: bytes | None) -> bytes:
    """The control channel's master key: derived from the job's secret where there is one (a sidecar's
    workers, started by another launcher, derive their keys the same way), else random."""
    return derive(configured, "control").secret if configured is not None else new_secret().hex().encode()


def control_secret_name(control_addr: str) -> tuple[str, str]:
    """The (endpoint, run id) a sidecar's control key file is named by: its port (the host part may be
    spelled in several ways on the one host the file serves)."""
    return f"control:{control_addr.rpartition(':')[2]}", "control"


def worker_key(control_addr: str, local_rank: int) -> Key:
    """This worker's control-channel key: ``ETC_AGENT_TOKEN`` (its agent started it), else derived from
    the job's secret, else from the sidecar's private file for ``control_addr`` on this host."""
    if os.environ.get(TOKEN_ENV):
        key = Key.from_token(os.environ[TOKEN_ENV])
        if worker_rank_of(key.id) != local_rank:
            raise AuthError(f"{TOKEN_ENV} is the key of {key.id}, not of local rank {local_rank}")
        return key
    configured = configured_secret()
    if configured is None:
        configured_master = read_local_secret(*control_secret_name(control_addr))
        if configured_master is None:
            raise AuthError(
                f"no key for the agent's control channel at {control_addr}: {TOKEN_ENV} is not set (the agent "
                f"sets it for the workers it starts); give the job's secret ({SECRET_ENV} or {SECRET_FILE_ENV})"
            )
        return derive(configured_master, worker_key_id(local_rank))
    return derive(control_master(configured), worker_key_id(local_rank))
