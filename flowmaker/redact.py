"""Scrubbing secrets out of text before it is relayed to a caller or written to a log.

Upstream services (an LLM endpoint, an engine) may echo a request back in an error body, headers
included; `scrub()` removes the known secret values and anything shaped like a credential
(Authorization headers, bearer tokens, api-key fields, `sk-...` keys). Pure.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

REDACTED = "[REDACTED]"

_PATTERNS = (
    # Authorization: Bearer xxx / "authorization": "Basic xxx" / x-api-key: xxx
    re.compile(r"""(?i)((?:proxy-)?authorization|x-api-key|api[-_]?key|access[-_]?token|secret|password)"""
               r"""(["']?\s*[:=]\s*["']?)(?:bearer\s+|basic\s+)?[^\s"',;}]+"""),
    re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{4,}"),
    re.compile(r"\bsk-[A-Za-z0-9_-]{8,}"),
)


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with every known secret value and every credential-shaped substring replaced."""
    for s in secrets:
        if s and len(s) >= 4:
            text = text.replace(s, REDACTED)
    text = _PATTERNS[0].sub(lambda m: m.group(1) + m.group(2) + REDACTED, text)
    text = _PATTERNS[1].sub("Bearer " + REDACTED, text)
    return _PATTERNS[2].sub(REDACTED, text)
