"""
The one place that uses docker-py's private C{APIClient} helpers.

docker-py has no public call for a streaming request to an arbitrary engine endpoint with
the response left to the caller (the image load fed from the network, a pull whose stream
can be cancelled, a log follow whose body is read in blocks): its own public methods build
on these private helpers. They stay here, each behind a function with a public name, so
the rest of the agent calls this module and a docker-py upgrade that renames one breaks one
file. The same holds for the socket inside the C{SocketIO} that an exec with C{socket=True}
returns. C{tests/archcheck.py} lists this module as the allowlisted adapter for docker-py and
reports its reaches apart from the package's count.
"""

from __future__ import annotations

from typing import Any


def url(api: Any, path: str, *args: str) -> str:
    """The engine URL of C{path} (C{{0}} placeholders filled, quoted) for this client."""
    return str(api._url(path, *args))


def post(api: Any, target: str, **kwargs: Any) -> Any:
    """A POST through the client's session (its auth, timeouts and transport)."""
    return api._post(target, **kwargs)


def get(api: Any, target: str, **kwargs: Any) -> Any:
    """A GET through the client's session."""
    return api._get(target, **kwargs)


def raise_for_status(api: Any, response: Any) -> None:
    """Raise docker-py's own error (C{APIError}, C{NotFound}...) for a failed response."""
    api._raise_for_status(response)


def json_messages(api: Any, response: Any) -> Any:
    """The decoded JSON messages of a streaming response, as they arrive."""
    return api._stream_helper(response, decode=True)


def disable_socket_timeout(api: Any, response: Any) -> None:
    """Let a streaming response wait forever for its next bytes (a quiet log is normal)."""
    api._disable_socket_timeout(api._get_raw_response_socket(response))


def underlying_socket(sock: Any) -> Any:
    """
    The socket beneath what an exec or attach with C{socket=True} returns (on a unix engine a
    C{SocketIO} around it), or C{sock} itself where there is none beneath.
    """
    return getattr(sock, "_sock", sock)


def custom_adapter(api: Any) -> Any:
    """The transport adapter of a client on a non-HTTP socket (unix, ssh), or C{None}."""
    return getattr(api, "_custom_adapter", None)


__all__ = [
    "custom_adapter",
    "disable_socket_timeout",
    "get",
    "json_messages",
    "post",
    "raise_for_status",
    "underlying_socket",
    "url",
]
