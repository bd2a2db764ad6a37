"""API key format and hashing: `gw_<id>_<secret>`, shown once, stored as sha256(secret), looked up by id.

The secret is 40 base62 characters (~238 bits) from `secrets`, so a fast hash is enough: brute force over
the secret space is infeasible, unlike passwords, and a slow KDF would cost milliseconds per request.
"""
from __future__ import annotations

import hashlib
import hmac
import re
import secrets

PREFIX = "gw"
ID_LEN = 12
SECRET_LEN = 40
_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_ID_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"
_KEY_RE = re.compile(rf"^{PREFIX}_([0-9a-z]{{{ID_LEN}}})_([0-9A-Za-z]{{{SECRET_LEN}}})$")


def new_key_id() -> str:
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(ID_LEN))


def new_secret() -> str:
    return "".join(secrets.choice(_ALPHABET) for _ in range(SECRET_LEN))


def format_key(key_id: str, secret: str) -> str:
    return f"{PREFIX}_{key_id}_{secret}"


def parse_key(token: str) -> tuple[str, str] | None:
    """(id, secret) of a well-formed gateway key, else None. Never raises, never echoes the token."""
    if len(token) != len(PREFIX) + ID_LEN + SECRET_LEN + 2:
        return None
    m = _KEY_RE.match(token)
    return (m.group(1), m.group(2)) if m else None


def looks_like_gateway_key(token: str) -> bool:
    return token.startswith(PREFIX + "_")


def hash_secret(secret: str) -> str:
    """Hex sha256 of the secret: what the store keeps."""
    return hashlib.sha256(secret.encode()).hexdigest()


def secret_matches(secret: str, stored_hash: str) -> bool:
    """Constant-time comparison of the presented secret's hash with the stored one."""
    return hmac.compare_digest(hashlib.sha256(secret.encode()).hexdigest(), stored_hash)
