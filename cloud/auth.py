"""Per-edge bearer tokens: each token names an edge identity, and sessions belong to identities."""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Sequence

ANONYMOUS = "anonymous"


class EdgeAuthenticator:
    """Maps `authorization: Bearer <token>` metadata to an edge identity.

    Without a tokens file every caller is the anonymous edge (fine on loopback, not on a network).
    """

    def __init__(self, tokens: dict[str, str] | None = None) -> None:
        self._identity_by_token = tokens  # token -> edge identity; None: authentication off

    @classmethod
    def from_file(cls, path: Path | None) -> "EdgeAuthenticator":
        """A text file, one `EDGE_ID TOKEN` pair per line; '#' starts a comment."""
        if path is None:
            return cls(None)
        tokens: dict[str, str] = {}
        for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{number}: expected 'EDGE_ID TOKEN'")
            tokens[parts[1]] = parts[0]
        if not tokens:
            raise ValueError(f"{path}: no tokens; an empty file would lock every edge out")
        return cls(tokens)

    def identify(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """The edge identity, or None when the token is missing or unknown."""
        if self._identity_by_token is None:
            return ANONYMOUS
        header = next((v for k, v in metadata or () if k == "authorization"), None)
        if not isinstance(header, str) or not header.startswith("Bearer "):
            return None
        presented = header.removeprefix("Bearer ").strip()
        for token, identity in self._identity_by_token.items():
            if hmac.compare_digest(token, presented):  # constant time: no token guessing by timing
                return identity
        return None
