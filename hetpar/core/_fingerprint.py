"""One way to fingerprint a structure: a short hash of its canonical JSON.

A fingerprint names *what* something is (which layers, edges, devices,
shapes), not its figures: callers choose the payload, this module only makes
the hash stable (sorted keys, no whitespace) and recognisable (`sha256:`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def fingerprint(payload: Any) -> str:
    """`sha256:` and the first 16 hex digits of the SHA-256 of `payload` as canonical JSON.

    Args:
      payload: JSON-able data (dicts, lists, strings, numbers); dict key order
        does not matter, list order does.
    """
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()[:16]
