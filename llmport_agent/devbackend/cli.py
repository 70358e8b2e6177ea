"""
C{llmport-agent devbackend}: run the local stand-in backend until SIGINT/SIGTERM.

Prints the backend URL and a freshly minted enrollment token (for the operator: this is
the one place a token is shown; it never goes to the log).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, cast

from twisted.internet.defer import Deferred
from twisted.logger import (
    FilteringLogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    globalLogBeginner,
    textFileLogObserver,
)

from llmport_agent.devbackend._state import GENERATION_CURRENT, GENERATIONS
from llmport_agent.devbackend.backend import DevBackend
from llmport_agent.devbackend.tls import TLSFiles, make_test_tls, tls_files_in

EX_USAGE = 2


def _positive(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be greater than 0")
    return number


def _port(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number (0-65535)")
    return number


def _image(value: str) -> tuple[str, str, str]:
    ref, sep, path = value.partition("=")
    name, colon, tag = ref.rpartition(":")
    if not sep or not path or not colon or not name or not tag or "/" in tag:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME:TAG=PATH_TO_DOCKER_SAVE_TAR")
    return name, tag, path


def _model(value: str) -> tuple[str, str, str]:
    parts = value.split(",", 2)
    if len(parts) != 3 or not all(parts):
        raise argparse.ArgumentTypeError(f"{value!r}: expected MODEL_ID,HF_REPO_ID,DIRECTORY")
    return parts[0], parts[1], parts[2]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmport-agent devbackend",
        description="Run a local stand-in of the llm-port backend's node-facing side "
        "(enrollment, rotation, the node stream, node files, a dev admin API under /dev).",
        epilog="Join requests of a running stand-in are decided with: "
        + "; ".join(f"llmport-agent devbackend {verb} ({what})" for verb, what in ADMIN_VERBS.items()) + ".",
    )
    parser.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000; 0 = any)")
    parser.add_argument("--interface", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--base-path", default="", help="serve below this path, e.g. /llm")
    parser.add_argument("--idle-timeout", type=_positive, default=120.0,
                        help="seconds without a frame before a stream is closed with 4408")
    parser.add_argument("--token-ttl", type=_positive, default=1800.0,
                        help="enrollment token lifetime in seconds (default 1800)")
    parser.add_argument("--tls-dir", default=None,
                        help="serve HTTPS/WSS with ca.pem, server.pem, server-key.pem from this "
                        "directory (created with a fresh test CA when missing)")
    parser.add_argument("--admin-token", default=os.environ.get("LLMPORT_DEVBACKEND_ADMIN_TOKEN"),
                        help="require 'Bearer <token>' on the token and /dev endpoints "
                        "[LLMPORT_DEVBACKEND_ADMIN_TOKEN]")
    parser.add_argument("--image", type=_image, action="append", default=[],
                        metavar="NAME:TAG=TAR", help="serve a docker-save tar for image transfer")
    parser.add_argument("--model", type=_model, action="append", default=[],
                        metavar="MODEL_ID,HF_REPO_ID,DIR", help="serve a model directory")
    parser.add_argument("--keep-frames", action=argparse.BooleanOptionalAction, default=True,
                        help="keep a copy of every inbound frame for GET /dev/nodes/<id>/frames "
                        "(--no-keep-frames for a large fleet; the cost counters count either way)")
    parser.add_argument("--generation", choices=list(GENERATIONS), default=GENERATION_CURRENT,
                        help="which llm-port backend to behave as: 'current' (default: pushes "
                        "commands, re-dispatches overdue ones, fails in-flight commands when "
                        "the stream is lost, reaps silent ones) or '2026-04' (commands only in "
                        "reply to a frame, no reapers)")
    parser.add_argument("--reaper-scale", type=_positive, default=1.0,
                        help="multiply the current generation's reaper times (300 s silence "
                        "floor, 600 s offline grace, 300 s stale session, 60 s sweep) by this "
                        "factor, e.g. 0.01 for tests (default 1)")
    parser.add_argument("--log-sink-url", default=None,
                        help="the Loki URL GET /api/node-files/log-sink names to agents without "
                        "LOKI_URL (default: none, the route answers 404)")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warn", "error", "critical"])
    return parser


def _tls(directory: str | None) -> TLSFiles | None:
    if directory is None:
        return None
    files = tls_files_in(directory)
    if not files.exists():
        files = make_test_tls(directory)
    return files


#: The administrator's verbs on join requests, and what each does.
ADMIN_VERBS = {
    "join-requests": "list the join requests waiting for a decision",
    "approve": "approve a join request: the node collects its credential",
    "reject": "reject a join request: the node is told why and stops asking",
}


def admin_parser(verb: str) -> argparse.ArgumentParser:
    """The parser of one of L{ADMIN_VERBS}."""
    parser = argparse.ArgumentParser(prog=f"llmport-agent devbackend {verb}", description=ADMIN_VERBS[verb])
    if verb != "join-requests":
        parser.add_argument("code", help="the code the node shows (or the request id)")
    if verb == "reject":
        parser.add_argument("--message", default=None, help="why (shown on the node)")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the stand-in backend")
    parser.add_argument("--admin-token", default=os.environ.get("LLMPORT_DEVBACKEND_ADMIN_TOKEN"),
                        help="the admin token the backend printed (default: $LLMPORT_DEVBACKEND_ADMIN_TOKEN)")
    return parser


def admin_main(argv: list[str]) -> int:
    """
    C{devbackend join-requests | approve CODE | reject CODE [--message M]}: decide join requests
    of a running stand-in backend through its admin HTTP API (what an administrator does in the
    llm-port UI).
    """
    import json
    import urllib.error
    import urllib.parse
    import urllib.request

    parser = admin_parser(argv[0])
    try:
        args = parser.parse_args(argv[1:])
    except SystemExit as e:
        return int(e.code or 0) if isinstance(e.code, int) else EX_USAGE
    base = args.url.rstrip("/") + "/api/admin/system/nodes/join-requests"
    if argv[0] == "join-requests":
        request = urllib.request.Request(base)
    else:
        body = {"message": args.message} if getattr(args, "message", None) else {}
        request = urllib.request.Request(f"{base}/{urllib.parse.quote(args.code, safe='')}/{argv[0]}",
                                         data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
    if args.admin_token:
        request.add_header("Authorization", f"Bearer {args.admin_token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - operator's URL
            answer = json.loads(response.read(1 << 20))
    except urllib.error.HTTPError as e:
        detail = e.read(1 << 16).decode("utf-8", "replace")
        print(f"devbackend: {argv[0]} failed (HTTP {e.code}: {detail[:300]})", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"devbackend: cannot reach {args.url} ({e})", file=sys.stderr)
        return 1
    if argv[0] == "join-requests":
        for row in answer:
            print(f"{row['code']}  agent id {row['agent_id']}  from {row['source_ip']}  expires {row['expires_at']}")
        if not answer:
            print("no join request is waiting")
    else:
        print(f"{answer['code']} ({answer['agent_id']}): {answer['status']}")
    return 0


def main(argv: list[str]) -> int:
    """Run the stand-in backend in the foreground; returns the exit status."""
    if argv and argv[0] in ADMIN_VERBS:
        return admin_main(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0) if isinstance(e.code, int) else EX_USAGE
    for _name, _tag, path in args.image:
        if not os.path.isfile(path):
            print(f"devbackend: --image {path!r} is not a file", file=sys.stderr)
            return EX_USAGE
    for _mid, _repo, directory in args.model:
        if not os.path.isdir(directory):
            print(f"devbackend: --model {directory!r} is not a directory", file=sys.stderr)
            return EX_USAGE

    from twisted.internet import reactor as global_reactor

    reactor: Any = global_reactor
    predicate: Any = LogLevelFilterPredicate(
        defaultLogLevel=LogLevel.levelWithName(args.log_level)
    )
    observer: Any = FilteringLogObserver(cast(Any, textFileLogObserver(sys.stderr)), [predicate])
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)
    try:
        tls = _tls(args.tls_dir)
    except OSError as e:
        print(f"devbackend: cannot prepare TLS files in {args.tls_dir!r}: {e}", file=sys.stderr)
        return 1
    backend = DevBackend(
        reactor,
        idle_timeout=args.idle_timeout,
        token_ttl=args.token_ttl,
        base_path=args.base_path,
        admin_token=args.admin_token,
        keep_frames=args.keep_frames,
        generation=args.generation,
        reaper_scale=args.reaper_scale,
        log_sink_url=args.log_sink_url,
    )
    from .imagetar import image_identity

    for name, tag, path in args.image:
        # With its id the current generation serves the tar as an export (Range, X-Image-Id).
        image_id, rootfs = image_identity(path)
        backend.add_image(name, tag, path, image_size=None, image_id=image_id, rootfs_digest=rootfs)

    def join_requested(row: Any) -> None:
        print(f"join request {row.code} from agent id {row.agent_id} ({row.source_ip}); approve: "
              f"llmport-agent devbackend approve {row.code} --url {backend.url}", flush=True)

    backend.onboarding.on_request = join_requested
    if args.model:
        if backend.models is None:
            print("devbackend: model files are not available in this build", file=sys.stderr)
            return 1
        for model_id, repo_id, directory in args.model:
            backend.models.add_model_from_dir(model_id, repo_id, directory)
    status = {"code": 0}

    async def start() -> None:
        await backend.listen(args.port, args.interface, tls=tls)
        token = backend.mint_token("llmport-agent devbackend")
        print(f"llm-port stand-in backend ({backend.generation} generation) listening on "
              f"{backend.url}")
        print(f"  stream: {backend.stream_url}")
        if tls is not None:
            print(f"  CA certificate: {tls.ca_pem}")
        print(f"enrollment token (single use, expires {token['expires_at']}):")
        print(f"  {token['token']}")
        print("mint more: POST "
              f"{backend.url}/api/admin/system/nodes/enrollment-tokens  body {{\"note\": null}}")
        print(f"dev API:   GET {backend.url}/dev/nodes")
        sys.stdout.flush()

    def failed(f: Any) -> None:
        print(f"devbackend: cannot start: {f.getErrorMessage()}", file=sys.stderr)
        status["code"] = 1
        reactor.stop()

    def _start() -> None:
        d = Deferred.fromCoroutine(start())
        d.addErrback(failed)

    reactor.callWhenRunning(_start)
    reactor.addSystemEventTrigger("before", "shutdown", backend.stop)
    reactor.run()
    return status["code"]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
