"""One JSON ``POST`` to an OpenAI-compatible endpoint (``/chat/completions``), for the chat clients that talk to
one (``workers.rlm.inference.OpenAIChatLLM``, the PRM's ``HTTPScorer``); errors become ``RuntimeError`` naming
the endpoint."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

__all__ = ["post_json"]


def post_json(url: str, body: dict[str, Any], *, api_key: str | None, timeout_s: float, label: str) -> dict:
    """The decoded JSON answer to ``body``; ``api_key`` is sent as a bearer token when set. ``label`` names the
    endpoint in error messages (e.g. "PRM endpoint")."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read().decode("utf-8"))
    except urllib.error.HTTPError as err:
        detail = err.read().decode("utf-8", "replace")[:500]
        raise RuntimeError(f"{label} {url} answered HTTP {err.code}: {detail}") from None
    except urllib.error.URLError as err:
        raise RuntimeError(f"{label} {url} unreachable: {err.reason}") from None
