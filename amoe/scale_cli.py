"""`amoe scale`: add or remove expert runtimes of a running server (POST /admin/scale, docs/rebalancing.md
"Scaling"). Waits for the joins and drains to end unless told not to, and prints the server's answer as one JSON
line. Bad input is refused here, before anything is sent, with the words the server would use (exit 2); a refusal by
the server (400) exits 2 too, a scale under way (409) or a failed one exits 1."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from amoe.errors import AmoeError, RequestError
from amoe.scaling import target_count

EXIT_USAGE = 2


def add_scale_command(sub: Any) -> None:
    p = sub.add_parser("scale", help="add or remove expert runtimes of a running server")
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", help="the server's API key, if it has one")
    p.add_argument("--expert-runtimes", metavar="+N|-N|N", help='a change ("+1", "-1") or the count wanted')
    p.add_argument(
        "--attention-runtimes", metavar="+N|-N|N", help="attention runtimes (refused: they do not move yet)"
    )
    p.add_argument(
        "--remove", type=int, action="append", metavar="RUNTIME", help="an expert runtime to remove; repeat"
    )
    p.add_argument("--no-wait", action="store_true", help="answer once the scale has started, not ended")
    p.add_argument(
        "--timeout", type=float, default=3600.0, metavar="S", help="seconds to wait (default: 3600)"
    )
    p.set_defaults(run=run_scale)


def run_scale(args: argparse.Namespace) -> int:
    try:
        body = request_body(args)
    except RequestError as exc:
        print(f"amoe: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    status, reply = post(args.url.rstrip("/"), body, args.api_key, args.timeout)
    if status != 200:
        error = reply.get("error", {}) if isinstance(reply, dict) else {}
        print(f"amoe: error: HTTP {status}: {error.get('message', reply)}", file=sys.stderr)
        return EXIT_USAGE if status == 400 else 1
    print(json.dumps(reply))
    return 1 if reply.get("outcome") == "failed" else 0


def request_body(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON body; RequestError (naming the flag's field) for input the server would refuse anyway."""
    if args.attention_runtimes is not None:
        target_count(args.attention_runtimes, 1, "attention_runtimes")  # the same words for a malformed count
    if args.expert_runtimes is not None:
        target_count(args.expert_runtimes, 1, "expert_runtimes")
    elif not args.remove and args.attention_runtimes is None:
        raise RequestError(
            "say how many expert runtimes: --expert-runtimes +1, -1 or a count", "expert_runtimes"
        )
    if args.timeout <= 0:
        raise RequestError(f"--timeout must be positive; got {args.timeout}", "timeout")
    body: dict[str, Any] = {"wait": not args.no_wait}
    for key in ("expert_runtimes", "attention_runtimes", "remove"):
        if getattr(args, key) is not None:
            body[key] = getattr(args, key)
    return body


def post(url: str, body: dict[str, Any], api_key: str | None, timeout_s: float) -> tuple[int, Any]:
    """POST url/admin/scale; (status, JSON answer). AmoeError (one line) if the server cannot be reached."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        reply = httpx.post(f"{url}/admin/scale", json=body, headers=headers, timeout=timeout_s)
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: not even a URL
        raise AmoeError(f"cannot reach {url}/admin/scale: {exc or type(exc).__name__}") from None
    try:
        return reply.status_code, reply.json()
    except ValueError:
        return reply.status_code, reply.text
