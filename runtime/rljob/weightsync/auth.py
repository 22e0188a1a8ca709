"""The job's peer key: how a job's own processes tell each other from anyone else.

Two places take bytes from the network that would run code if a stranger wrote them: an
engine's `/update_weights_from_tensor` unpickles its body (SGLang's format), and a sidecar
unpickles the CUDA IPC handles an announcement in the weight-sync store carries. So nothing
a peer sends is parsed before it is authenticated:

- engines require `Authorization: Bearer <key>` on every route but `/health` (the hf
  engine through `bearer_middleware`, SGLang through its `--api-key`, which it checks the
  same way) and answer 401 without reading the body; `EngineClient` sends the header;
- every value written to the weight-sync store is `sign`ed (HMAC-SHA256 under the key, over
  the store key's name and the value) and `SignedStore.get` checks the tag
  (`hmac.compare_digest`) before it hands the value on, raising `UnauthenticatedValue`
  otherwise. Counters (`add`) carry no tag; they only count, and every value they index is
  signed. torch's process groups write their rendezvous entries themselves (no tag): they
  are never unpickled, and what travels through the groups is checked against the signed
  digest.

The key (`peer_key`): `$RLJOB_PEER_KEY` when set; else derived from `$RAY_AUTH_TOKEN`,
which every pod of a job has from the job's Secret (HMAC of a fixed label, so the engines'
key, which SGLang logs with its arguments, does not give away the Ray token); else a random
one for this run (`rljob run` on one machine), which is put into this process's environment
so that the Ray it starts and the processes it spawns inherit it, and is handed to Ray
workers with the run's other settings (`rljob.cluster.cluster.worker_env`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from rljob_api import env

# Derivation label: a key derived for anything else from the same token differs.
KEY_LABEL = b"rljob.io/peer-key/v1"
TAG_CHARS = 64  # hex of an HMAC-SHA256
AUTHORIZATION = "Authorization"
# Open without the key, as SGLang keeps them: liveness only, nothing is parsed.
OPEN_PATHS = ("/health",)


class UnauthenticatedValue(RuntimeError):
    """A store value without a valid tag under this job's key: refused unread."""


def derive_key(ray_token: str) -> str:
    return hmac.new(ray_token.encode(), KEY_LABEL, hashlib.sha256).hexdigest()


def peer_key(environ: MutableMapping[str, str] | None = None) -> str:
    """This job's peer key (see the module's docstring); always one, never an open mode."""
    environ = os.environ if environ is None else environ
    key = environ.get(env.PEER_KEY)
    if key:
        return key
    token = environ.get(env.RAY_AUTH_TOKEN)
    key = derive_key(token) if token else secrets.token_hex(32)
    # Whatever this process starts from now on (its Ray, an engine server) inherits it.
    environ[env.PEER_KEY] = key
    return key


def bearer(key: str) -> dict[str, str]:
    """The header an engine requires."""
    return {AUTHORIZATION: f"Bearer {key}"}


def authorized(header: str | None, key: str) -> bool:
    """Whether an Authorization header carries `key` (compared in constant time)."""
    return hmac.compare_digest((header or "").encode(), bearer(key)[AUTHORIZATION].encode())


def bearer_middleware(key: str) -> Callable[..., Awaitable[Any]]:
    """aiohttp middleware refusing, with 401 and before the body is read, every request to
    a route but `OPEN_PATHS` that does not carry `key`."""
    from aiohttp import web

    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]
                    ) -> Any:
        if request.path in OPEN_PATHS or authorized(request.headers.get(AUTHORIZATION), key):
            return await handler(request)
        return web.json_response(
            {"error": "Unauthorized: this engine serves only its job's own processes "
                      f"(Authorization: Bearer <the job's peer key, ${env.PEER_KEY}>)"},
            status=401)

    return check


def _tag(key: str, name: str, value: bytes) -> bytes:
    mac = hmac.new(key.encode(), name.encode() + b"\0" + value, hashlib.sha256)
    return mac.hexdigest().encode()


def sign(key: str, name: str, value: str | bytes) -> bytes:
    """`value` as written under store key `name`: its tag, then the value."""
    raw = value.encode() if isinstance(value, str) else value
    return _tag(key, name, raw) + raw


def verify(key: str, name: str, stored: bytes) -> bytes:
    """The value `sign` wrapped, once its tag checks out; UnauthenticatedValue otherwise."""
    tag, value = stored[:TAG_CHARS], stored[TAG_CHARS:]
    if len(tag) != TAG_CHARS or not hmac.compare_digest(tag, _tag(key, name, value)):
        raise UnauthenticatedValue(
            f"weight-sync store value {name!r} is not signed with this job's peer key: "
            "refused unread (written by a process outside the job, or by one started with "
            f"another ${env.PEER_KEY})")
    return value


class SignedStore:
    """A TCP store whose values are signed when set and checked when read. `raw` is the
    store itself, for torch's process groups (which write their own entries)."""

    def __init__(self, raw: Any, key: str) -> None:
        self.raw = raw
        self._key = key

    def __repr__(self) -> str:  # never the key
        return f"SignedStore({self.raw!r})"

    @property
    def port(self) -> int:
        return int(self.raw.port)

    def set(self, name: str, value: str | bytes) -> None:
        self.raw.set(name, sign(self._key, name, value))

    def get(self, name: str) -> bytes:
        return verify(self._key, name, bytes(self.raw.get(name)))

    def check(self, names: list[str]) -> bool:
        return bool(self.raw.check(names))

    def add(self, name: str, amount: int) -> int:
        return int(self.raw.add(name, amount))
