"""
The agent's configuration: C{LLM_PORT_NODE_AGENT_*} variables, overridden by command-line options.

One table (L{SETTINGS}) drives parsing, validation, the CLI options, C{config show} and the
configuration reference in docs/ (generated from it at build time).
Bad values raise L{ConfigError} with one line naming the variable, what is wrong and the expected form.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from attrs import field, fields

from llmport_agent.core.values import frozen

PREFIX = "LLM_PORT_NODE_AGENT_"


class ConfigError(ValueError):
    """A configuration value is invalid. C{str()} is the one line to show the operator."""


@frozen
class Setting:
    """One configuration variable."""

    name: str  # without PREFIX
    attr: str
    default: Callable[[dict[str, Any]], Any] | Any
    parse: Callable[[str, str], Any]
    help: str
    secret: bool = False

    @property
    def env(self) -> str:
        return PREFIX + self.name

    @property
    def option(self) -> str:
        return self.attr.replace("_", "-")


def _str(var: str, raw: str) -> str:
    return raw.strip()


def _optional_str(var: str, raw: str) -> str | None:
    raw = raw.strip()
    return raw or None


def _number(minimum: float, integer: bool = False) -> Callable[[str, str], float]:
    def parse(var: str, raw: str) -> float:
        kind = "an integer" if integer else "a number"
        try:
            value = int(raw.strip()) if integer else float(raw.strip())
        except ValueError:
            raise ConfigError(
                f"{var}={raw!r} is not {kind}; expected {kind} >= {minimum:g}"
            ) from None
        if value != value or value < minimum:  # NaN or too small
            raise ConfigError(f"{var}={raw!r} is below its minimum; expected {kind} >= {minimum:g}")
        return value

    return parse


def _int_range(minimum: int, maximum: int) -> Callable[[str, str], int]:
    def parse(var: str, raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise ConfigError(
                f"{var}={raw!r} is not an integer; expected {minimum}-{maximum}"
            ) from None
        if not minimum <= value <= maximum:
            raise ConfigError(f"{var}={raw!r} is out of range; expected {minimum}-{maximum}")
        return value

    return parse


def _connections(var: str, raw: str) -> int:
    """C{auto} (0: adaptive) or a fixed count 1-16."""
    if raw.strip().lower() in ("auto", "0"):
        return 0
    return _int_range(1, 16)(var, raw)


def _bool(var: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in {"1", "true", "yes", "y", "on"}:
        return True
    if value in {"0", "false", "no", "n", "off"}:
        return False
    raise ConfigError(f"{var}={raw!r} is not a boolean; expected true or false")


def mask_url(url: str) -> str:
    """
    C{url} for messages and display: the password in its user info becomes C{***} (the user
    name and the address stay: they are not secrets); user info without a password (which may
    be a token) is masked whole.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if "@" not in parts.netloc:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    user, colon, _password = userinfo.partition(":")
    shown = f"{user}:***" if colon else "***"
    return urlunsplit((parts.scheme, f"{shown}@{host}", parts.path, parts.query, parts.fragment))


def strip_userinfo(url: str) -> str:
    """C{url} without its user info."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


def _http_url(var: str, raw: str) -> str:
    try:
        return _check_http_url(var, raw)
    except ConfigError as e:
        # Messages must not show a password embedded in the URL.
        raise ConfigError(str(e).replace(repr(raw), repr(mask_url(raw.strip())))) from None


def _backend_url(var: str, raw: str) -> str:
    """
    C{BACKEND_URL}, validated, without user info: the node authenticates with its credential
    (the Authorization header), so a C{user:password@} there is never sent, and never shown
    (L{load_config} adds a note saying so).
    """
    return strip_userinfo(_http_url(var, raw))


def _check_http_url(var: str, raw: str) -> str:
    value = raw.strip().rstrip("/")
    parts = urlsplit(value)
    if parts.scheme not in {"http", "https"} or not parts.hostname:
        raise ConfigError(
            f"{var}={raw!r} is not an http(s) URL; expected http://host[:port][/base] or https://..."
        )
    if parts.query or parts.fragment:
        raise ConfigError(f"{var}={raw!r} has a query or fragment; expected http(s)://host[:port][/base]")
    try:
        parts.port  # noqa: B018 - validates the port
    except ValueError:
        raise ConfigError(f"{var}={raw!r} has an invalid port; expected 1-65535") from None
    return value


def _optional_http_url(var: str, raw: str) -> str | None:
    return _http_url(var, raw) if raw.strip() else None


def _scheme(var: str, raw: str) -> str:
    value = raw.strip().lower()
    if value not in {"http", "https"}:
        raise ConfigError(f"{var}={raw!r} is not allowed; expected http or https")
    return value


def _log_level(var: str, raw: str) -> str:
    value = raw.strip().upper()
    if value == "WARNING":
        value = "WARN"
    if value not in {"DEBUG", "INFO", "WARN", "ERROR", "CRITICAL"}:
        raise ConfigError(f"{var}={raw!r} is not a log level; expected DEBUG, INFO, WARNING or ERROR")
    return value


def _ca_file(var: str, raw: str) -> str | None:
    value = raw.strip()
    if not value:
        return None
    if not os.path.isfile(value):
        raise ConfigError(f"{var}={raw!r}: no such file; expected the path of a PEM file of CA certificates")
    try:
        with open(value, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"{var}={raw!r} cannot be read ({e.strerror}); expected a readable PEM file") from None
    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise ConfigError(f"{var}={raw!r} holds no PEM certificate; expected a PEM file of CA certificates")
    return value


def _pem_file(var: str, raw: str, what: str) -> str | None:
    value = raw.strip()
    if not value:
        return None
    value = os.path.abspath(os.path.expanduser(value))
    if not os.path.isfile(value):
        raise ConfigError(f"{var}={raw!r}: no such file; expected the path of a PEM {what}")
    return value


def _check_client_tls(values: dict[str, Any]) -> None:
    """
    CA_BUNDLE is an alias of TLS_CA_BUNDLE; the client certificate and key load and match.
    Leaves the effective CA file in C{values["ca_bundle"]}.
    """
    new, old = values["tls_ca_bundle"], values["ca_bundle"]
    if new and old and os.path.realpath(new) != os.path.realpath(old):
        raise ConfigError(
            f"{PREFIX}TLS_CA_BUNDLE={new!r} and {PREFIX}CA_BUNDLE={old!r} are both set, to different "
            "files; expected one of them (CA_BUNDLE is the older name of TLS_CA_BUNDLE)"
        )
    values["ca_bundle"] = new or old
    cert, key = values["tls_client_cert"], values["tls_client_key"]
    if key and not cert:
        raise ConfigError(f"{PREFIX}TLS_CLIENT_KEY is set but {PREFIX}TLS_CLIENT_CERT is not; expected both "
                          "(or a certificate file that also holds its key)")
    if cert:
        from llmport_agent.session.tls import ClientCertError, load_client_certificate

        try:
            load_client_certificate(cert, key)
        except ClientCertError as e:
            raise ConfigError(str(e)) from None


def _secret_file(var: str, raw: str) -> str | None:
    value = raw.strip()
    if not value:
        return None
    value = os.path.abspath(os.path.expanduser(value))
    if not os.path.isfile(value):
        raise ConfigError(f"{var}={raw!r}: no such file; expected the path of a file holding the secret")
    return value


def _path(var: str, raw: str) -> str:
    value = raw.strip()
    if not value:
        raise ConfigError(f"{var} is empty; expected a file system path")
    return os.path.abspath(os.path.expanduser(value))


def _csv(var: str, raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(",") if part.strip())


#: A systemd unit name or a journalctl --unit pattern (globs allowed), no option-like start.
_UNIT = re.compile(r"[A-Za-z0-9:_.@\\*?\[\]][A-Za-z0-9:_.@\\*?\[\]-]{0,255}")


def _journal_units(var: str, raw: str) -> tuple[str, ...]:
    """C{()}: unset; C{("*",)}: the whole journal; C{("none",)}: no journal; else unit names."""
    units = _csv(var, raw)
    if not units:
        return ()
    if len(units) > 64:
        raise ConfigError(f"{var} names {len(units)} units; expected at most 64")
    if len(units) > 1 and ("*" in units or "none" in units):
        raise ConfigError(f"{var}={raw!r}: '*' and 'none' stand alone; expected '*', 'none' or unit names")
    for unit in units:
        if not _UNIT.fullmatch(unit):
            raise ConfigError(f"{var}: {unit[:80]!r} is not a systemd unit name; expected names like "
                              "sshd.service, comma-separated, or '*' or 'none'")
    return units


def _agent_id(var: str, raw: str) -> str:
    value = raw.strip()
    if not value or len(value) > 128:
        raise ConfigError(f"{var}={raw!r} is empty or too long; expected 1-128 characters")
    return value


def _hostname(_: dict[str, Any]) -> str:
    """this host's name"""
    return socket.gethostname()


def _same_as_host(values: dict[str, Any]) -> str:
    """= HOST"""
    return str(values["host"])


SETTINGS: tuple[Setting, ...] = (
    Setting("BACKEND_URL", "backend_url", "http://127.0.0.1:8000", _backend_url,
            "Base URL of the llm-port backend (may carry a base path)."),
    Setting("AGENT_ID", "agent_id", _hostname, _agent_id,
            "Stable node identity (<= 128 characters)."),
    Setting("HOST", "host", _hostname, _str,
            "This node's host name or address, sent at enrollment."),
    Setting("ADVERTISE_HOST", "advertise_host", _same_as_host, _str,
            "Host put in heartbeats and workload endpoint URLs."),
    Setting("ADVERTISE_SCHEME", "advertise_scheme", "http", _scheme,
            "Scheme of workload endpoint URLs (http or https)."),
    Setting("ENROLLMENT_TOKEN", "enrollment_token", None, _optional_str,
            "One-time enrollment token (used only while no credential is stored).", secret=True),
    Setting("STATE_PATH", "state_path", "/var/lib/llmport-agent/state.json", _path,
            "Where the credential and node state are kept (mode 0600)."),
    Setting("HEARTBEAT_INTERVAL_SEC", "heartbeat_interval_sec", 15.0, _number(1),
            "Seconds between heartbeats (must stay well under the backend's 120 s idle timeout)."),
    Setting("INVENTORY_INTERVAL_SEC", "inventory_interval_sec", 60.0, _number(5),
            "Seconds between inventory reports (each is one database row in the backend)."),
    Setting("RECONNECT_MIN_SEC", "reconnect_min_sec", 2.0, _number(0.1),
            "Smallest delay before reconnecting."),
    Setting("RECONNECT_MAX_SEC", "reconnect_max_sec", 30.0, _number(0.1),
            "Largest delay before reconnecting."),
    Setting("REQUEST_TIMEOUT_SEC", "request_timeout_sec", 20.0, _number(1),
            "Timeout of HTTP requests to the backend (enroll, rotate)."),
    Setting("VERIFY_TLS", "verify_tls", True, _bool,
            "Verify the backend's TLS certificate and host name."),
    Setting("TLS_CA_BUNDLE", "tls_ca_bundle", None, _ca_file,
            "PEM file of CA certificates trusted for the backend (HTTPS and the stream) and Loki, "
            "instead of the system store (the original agent's name; CA_BUNDLE is an alias)."),
    Setting("CA_BUNDLE", "ca_bundle", None, _ca_file,
            "Alias of TLS_CA_BUNDLE (both set to different files is an error)."),
    Setting("TLS_CLIENT_CERT", "tls_client_cert", None, lambda var, raw: _pem_file(var, raw, "certificate"),
            "PEM client certificate presented to the backend (mTLS: enrollment, rotation, the stream, "
            "model and image downloads); may also hold the key."),
    Setting("TLS_CLIENT_KEY", "tls_client_key", None, lambda var, raw: _pem_file(var, raw, "private key"),
            "PEM private key of TLS_CLIENT_CERT (unencrypted; keep it 0600)."),
    Setting("LOG_LEVEL", "log_level", "INFO", _log_level,
            "DEBUG, INFO, WARNING or ERROR."),
    Setting("COMMAND_POLL_INTERVAL_SEC", "command_poll_interval_sec", 2.0, _number(0.5),
            "Seconds between small poll frames (the backend sends commands only in reply to a frame)."),
    Setting("COMMAND_POLL_IDLE_INTERVAL_SEC", "command_poll_idle_interval_sec", 8.0, _number(0.5),
            "Seconds between poll frames of an idle node (no command and no connect within "
            "COMMAND_POLL_ACTIVE_WINDOW_SEC; never shorter than COMMAND_POLL_INTERVAL_SEC; at most 100)."),
    Setting("COMMAND_POLL_ACTIVE_WINDOW_SEC", "command_poll_active_window_sec", 600.0, _number(0),
            "Seconds after a connect or a command (received, running or answered) during which "
            "polls go every COMMAND_POLL_INTERVAL_SEC (0 = only while a command runs)."),
    Setting("COMMAND_KEEPALIVE_SEC", "command_keepalive_sec", 30.0, _number(1),
            "Seconds a command may go without a command_progress frame while it is queued or runs: "
            "then its last phase is sent again (the current backend times out a command silent "
            "for 300 s; 1-60)."),
    Setting("MAX_CONCURRENT_COMMANDS", "max_concurrent_commands", 8, _number(1, integer=True),
            "Commands executed at the same time."),
    Setting("COMMAND_MAX_AGE_SEC", "command_max_age_sec", 0.0, _number(0),
            "Refuse commands issued longer ago than this (0 = never; the default)."),
    Setting("COMMAND_DEADLINES", "command_deadlines", (), lambda var, raw: _deadlines(var, raw),
            "Per-type deadlines overriding the built-in ones, e.g. deploy_workload=7200,fetch_container_logs=20."),
    Setting("LOKI_URL", "loki_url", None, _optional_http_url,
            "Loki base URL for log shipping (unset = ask the backend for its log sink at connect)."),
    Setting("LOG_BATCH_SIZE", "log_batch_size", 100, _number(1, integer=True),
            "A Loki push starts once this many lines wait (when no push is in flight; a busy "
            "agent gathers more, up to LOKI_BATCH_BYTES)."),
    Setting("LOG_FLUSH_INTERVAL_SEC", "log_flush_interval_sec", 5.0, _number(0.1),
            "The longest a log line waits before its push starts (at most 1 s is used)."),
    Setting("LOKI_BATCH_BYTES", "loki_batch_bytes", 1 << 20, _number(1024, integer=True),
            "The most bytes of log lines in one Loki push."),
    Setting("LOKI_SPOOL_MAX_MB", "loki_spool_max_mb", 256, _number(0, integer=True),
            "Bound of the on-disk spool that keeps log lines while Loki is unreachable "
            "(<state dir>/loki-spool; 0 = no spool)."),
    Setting("LOKI_TENANT", "loki_tenant", None, _optional_str,
            "Loki tenant, sent as X-Scope-OrgID (multi-tenant Loki)."),
    Setting("LOKI_USERNAME", "loki_username", None, _optional_str,
            "User name for basic auth to Loki (instead of user:password in LOKI_URL)."),
    Setting("LOKI_PASSWORD", "loki_password", None, _optional_str,
            "Password for basic auth to Loki.", secret=True),
    Setting("LOKI_PASSWORD_FILE", "loki_password_file", None, lambda var, raw: _secret_file(var, raw),
            "File holding the Loki password (read at start and after a 401/403)."),
    Setting("LOKI_BEARER_TOKEN", "loki_bearer_token", None, _optional_str,
            "Bearer token for Loki (Authorization: Bearer ...).", secret=True),
    Setting("LOKI_BEARER_TOKEN_FILE", "loki_bearer_token_file", None, lambda var, raw: _secret_file(var, raw),
            "File holding the Loki bearer token (read at start and after a 401/403)."),
    Setting("LOKI_CONTAINER_STREAMS", "loki_container_streams", 16, _number(1, integer=True),
            "Workload containers whose logs are followed at the same time (more take turns)."),
    Setting("LOG_JOURNAL_UNITS", "log_journal_units", (), lambda var, raw: _journal_units(var, raw),
            "Host journal units shipped with the logs, comma-separated (unset: the whole journal to "
            "an operator's LOKI_URL, none to a sink the backend names; * = all; none = no journal)."),
    Setting("MODEL_STORE", "model_store", "/srv/llm-port/models", _path,
            "Directory of the HuggingFace model cache shared with workloads."),
    Setting("RAY_SESSION_DIR", "ray_session_dir", "/var/lib/llm-port/ray", _path,
            "Host side of the Ray runtime container's /tmp/ray (Serve replica logs are read from "
            "its session_latest/logs/serve)."),
    Setting("IMAGE_ALLOWLIST", "image_allowlist", (), _csv,
            "Comma-separated image prefixes allowed to run (empty = any)."),
    Setting("ALLOW_HOST_IPC", "allow_host_ipc", True, _bool,
            "Give workloads that request GPUs host IPC when the backend asks (its vLLM/TGI default); "
            "false, or a workload without GPUs, gets private IPC and a /dev/shm of shm_size (1 GiB) instead."),
    Setting("WORKLOAD_NETWORK", "workload_network", "bridge",
            lambda var, raw: _choice(var, raw, ("bridge", "host")),
            "How workloads are networked: bridge (published ports) or host."),
    Setting("STOP_GRACE_SEC", "stop_grace_sec", 30.0, _number(1),
            "Seconds between SIGTERM and SIGKILL when a workload is stopped."),
    Setting("READINESS_TIMEOUT_SEC", "readiness_timeout_sec", 1800.0, _number(5),
            "How long a deployed workload may take to answer its health path."),
    Setting("PULL_STALL_SEC", "pull_stall_sec", 300.0, _number(5),
            "An image pull or transfer with no progress for this long is abandoned (pull_stalled)."),
    Setting("MODEL_SYNC_CONCURRENCY", "model_sync_concurrency", 4, _number(1, integer=True),
            "Model blobs downloaded at the same time."),
    Setting("MODEL_SYNC_CONNECTIONS", "model_sync_connections", 0, _connections,
            "Ranged connections per large sha256 model blob: auto (add up to 4 while each makes it faster), or 1-16 (1 = one stream)."),
    Setting("MODEL_SYNC_SEGMENT_MB", "model_sync_segment_mb", 32, _int_range(1, 1024),
            "MiB per ranged request; blobs smaller than two segments use one stream."),
    Setting("MODEL_SYNC_BUFFER_MB", "model_sync_buffer_mb", 256, _int_range(8, 65536),
            "MiB all model downloads together may hold in memory (received, not yet written and hashed)."),
    Setting("RAY_TOKEN_DIR", "ray_token_dir", "/var/run/llm-port/ray", _path,
            "Directory of the Ray cluster token file (cluster.token, 0600), mounted read-only into the Ray runtime container."),
    Setting("IMAGE_DOWNLOAD_DIR", "image_download_dir", "", lambda var, raw: _path(var, raw) if raw.strip() else "",
            "Where runtime image tars land before they are loaded (empty = <state dir>/images)."),
    Setting("RAY_ALLOWED_MOUNTS", "ray_allowed_mounts", (), _csv,
            "Host directories a Ray runtime bundle may mount besides the model store and the Ray session directory (comma-separated)."),
    Setting("MODEL_STORE_READ_ONLY", "model_store_read_only", False, _bool,
            "Mount the model store read-only into every workload (by default only download_from_hf workloads get it read-write)."),
    Setting("OPS_PORT", "ops_port", 9464, _number(0, integer=True),
            "Loopback port of the ops endpoint (/healthz, /readyz, /metrics); 0 = off."),
    Setting("SHUTDOWN_GRACE_SEC", "shutdown_grace_sec", 30.0, _number(0),
            "Seconds a stop (SIGTERM) waits for running commands to finish before checkpointing "
            "the rest (keep it 30 s under the unit's TimeoutStopSec=90)."),
    Setting("LOG_FORMAT", "log_format", "auto",
            lambda var, raw: _choice(var, raw, ("auto", "text", "json", "journal")),
            "Log output: text, json (one flat object per line on stdout), journal (entries with "
            "priorities and fields) or auto (journal under systemd, else json when stdout is not a "
            "terminal)."),
    Setting("GPU_SOURCE", "gpu_source", "auto",
            lambda var, raw: _choice(var, raw, ("auto", "nvidia", "amd", "apple", "none")),
            "Where GPU facts come from: auto (NVML, else AMD SMI, else macOS), nvidia, amd, apple or none."),
    Setting("GPU_HEALTH_INTERVAL_SEC", "gpu_health_interval_sec", 10.0, _number(1),
            "Seconds between GPU health checks (ECC, retired pages, remapped rows, throttling, PCIe)."),
    Setting("GPU_CALL_TIMEOUT_SEC", "gpu_call_timeout_sec", 10.0, _number(0.5),
            "Seconds a GPU driver call may take before that GPU counts as unresponsive."),
    Setting("GPU_IGNORED_XIDS", "gpu_ignored_xids", (), lambda var, raw: _xids(var, raw),
            "Xid codes counted but never a health verdict, added to the application errors (13,31,43,45,68,69,109)."),
)


def _xids(var: str, raw: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or not 0 < int(part) < 1_000_000:
            raise ConfigError(f"{var}: {part!r} is not an Xid; expected comma-separated numbers such as 13,31")
        out.append(int(part))
    return tuple(out)


def _deadlines(var: str, raw: str) -> tuple[tuple[str, float], ...]:
    out: list[tuple[str, float]] = []
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not sep or not name.strip() or seconds < 1:
            raise ConfigError(
                f"{var}: {part!r} is not valid; expected command_type=seconds pairs (seconds >= 1), "
                "comma-separated"
            )
        out.append((name.strip(), seconds))
    return tuple(out)


def _choice(var: str, raw: str, choices: tuple[str, ...]) -> str:
    value = raw.strip().lower()
    if value not in choices:
        raise ConfigError(f"{var}={raw!r} is not allowed; expected one of {', '.join(choices)}")
    return value


@frozen(eq=False)  # one per process, compared by identity: no 62-field __eq__/__hash__ to compile
class AgentConfig:
    """The resolved configuration. Build it with L{load_config}."""

    backend_url: str
    agent_id: str
    host: str
    advertise_host: str
    advertise_scheme: str
    enrollment_token: str | None = field(repr=False)
    state_path: str
    heartbeat_interval_sec: float
    inventory_interval_sec: float
    reconnect_min_sec: float
    reconnect_max_sec: float
    request_timeout_sec: float
    verify_tls: bool
    #: The effective CA file (TLS_CA_BUNDLE, or its alias CA_BUNDLE).
    ca_bundle: str | None
    log_level: str
    command_poll_interval_sec: float
    max_concurrent_commands: int
    command_max_age_sec: float
    command_deadlines: tuple[tuple[str, float], ...]
    loki_url: str | None
    log_batch_size: int
    log_flush_interval_sec: float
    loki_batch_bytes: int
    loki_spool_max_mb: int
    loki_tenant: str | None
    loki_username: str | None
    loki_password: str | None = field(repr=False)
    loki_password_file: str | None
    loki_bearer_token: str | None = field(repr=False)
    loki_bearer_token_file: str | None
    loki_container_streams: int
    model_store: str
    image_allowlist: tuple[str, ...]
    allow_host_ipc: bool
    workload_network: str
    stop_grace_sec: float
    readiness_timeout_sec: float
    pull_stall_sec: float
    model_sync_concurrency: int
    model_sync_connections: int
    model_sync_segment_mb: int
    model_sync_buffer_mb: int
    model_store_read_only: bool
    ops_port: int
    #: Lines to log at start about the configuration (no secrets in them).
    notes: tuple[str, ...] = ()
    shutdown_grace_sec: float = 30.0
    log_format: str = "auto"
    log_journal_units: tuple[str, ...] = ()
    gpu_source: str = "auto"
    gpu_health_interval_sec: float = 10.0
    gpu_call_timeout_sec: float = 10.0
    gpu_ignored_xids: tuple[int, ...] = ()
    command_poll_idle_interval_sec: float = 8.0
    command_poll_active_window_sec: float = 600.0
    command_keepalive_sec: float = 30.0
    ray_session_dir: str = "/var/lib/llm-port/ray"
    tls_ca_bundle: str | None = None
    tls_client_cert: str | None = None
    tls_client_key: str | None = None
    ray_token_dir: str = "/var/run/llm-port/ray"
    image_download_dir: str = ""
    ray_allowed_mounts: tuple[str, ...] = ()

    @property
    def poll_idle_interval(self) -> float:
        """The idle poll interval in effect (never shorter than the active one)."""
        return max(self.command_poll_interval_sec, self.command_poll_idle_interval_sec)

    @property
    def state_dir(self) -> str:
        return os.path.dirname(os.path.abspath(self.state_path))

    def masked(self) -> dict[str, Any]:
        """The configuration as C{{ENV_NAME: value}}, secrets masked, for display and diagnostics."""
        out: dict[str, Any] = {}
        for s in SETTINGS:
            value = getattr(self, s.attr)
            if s.secret:
                # Unset is None like any other unset setting (JSON null; "(unset)" as text).
                value = mask(value) if value else None
            elif isinstance(value, str) and s.parse in (_http_url, _optional_http_url, _backend_url):
                value = mask_url(value)
            elif isinstance(value, tuple):
                value = ",".join(
                    v if isinstance(v, str) else str(v) if isinstance(v, int) else f"{v[0]}={v[1]:g}"
                    for v in value
                )
            out[s.env] = value
        return out


def display_value(value: Any) -> str:
    """A configuration value as an operator writes it in the env file (no Python C{None}/C{True})."""
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    text = str(value)
    return text if text else "(empty)"


def _check_loki(values: dict[str, Any]) -> None:
    """The Loki settings that only make sense together."""
    bearer = values["loki_bearer_token"] or values["loki_bearer_token_file"]
    password = values["loki_password"] or values["loki_password_file"]
    if values["loki_bearer_token"] and values["loki_bearer_token_file"]:
        raise ConfigError(f"{PREFIX}LOKI_BEARER_TOKEN and {PREFIX}LOKI_BEARER_TOKEN_FILE are both set; "
                          "expected one of them")
    if values["loki_password"] and values["loki_password_file"]:
        raise ConfigError(f"{PREFIX}LOKI_PASSWORD and {PREFIX}LOKI_PASSWORD_FILE are both set; "
                          "expected one of them")
    if password and not values["loki_username"]:
        raise ConfigError(f"a Loki password is set but {PREFIX}LOKI_USERNAME is not; expected both "
                          "(basic auth) or neither")
    if bearer and values["loki_username"]:
        raise ConfigError(f"{PREFIX}LOKI_USERNAME and a Loki bearer token are both set; expected "
                          "basic auth or a bearer token, not both")
    if values["loki_container_streams"] > 256:
        raise ConfigError(f"{PREFIX}LOKI_CONTAINER_STREAMS={values['loki_container_streams']} is too "
                          "many (one thread each); expected 1-256")
    spool = values["loki_spool_max_mb"] * (1 << 20)
    if spool and spool < 4 * values["loki_batch_bytes"]:
        raise ConfigError(f"{PREFIX}LOKI_SPOOL_MAX_MB={values['loki_spool_max_mb']} cannot hold 4 "
                          f"batches of {PREFIX}LOKI_BATCH_BYTES={values['loki_batch_bytes']}; expected "
                          "a larger spool, smaller batches, or 0 (no spool)")


def mask(value: str | None) -> str:
    """Show that a secret is set without showing it."""
    if not value:
        return "(unset)"
    return "***" + f" ({len(value)} chars)"


def load_config(
    environ: Mapping[str, str] | None = None, overrides: Mapping[str, str | None] | None = None
) -> AgentConfig:
    """
    Resolve the configuration: defaults, then the environment, then C{overrides} (command-line
    options keyed by attribute name; None means not given).

    @raise ConfigError: one line naming the variable, what is wrong and the expected form.
    """
    env = os.environ if environ is None else environ
    overrides = overrides or {}
    values: dict[str, Any] = {}
    for s in SETTINGS:
        given = overrides.get(s.attr)
        if given is not None:
            values[s.attr] = s.parse(f"--{s.option}", str(given))
        elif s.env in env:
            values[s.attr] = s.parse(s.env, env[s.env])
        else:
            values[s.attr] = s.default(values) if callable(s.default) else s.default
    if not values["advertise_host"]:
        values["advertise_host"] = values["host"]
    if values["reconnect_min_sec"] > values["reconnect_max_sec"]:
        raise ConfigError(
            f"{PREFIX}RECONNECT_MIN_SEC={values['reconnect_min_sec']:g} is above "
            f"{PREFIX}RECONNECT_MAX_SEC={values['reconnect_max_sec']:g}; expected min <= max"
        )
    if values["heartbeat_interval_sec"] > 60:
        raise ConfigError(
            f"{PREFIX}HEARTBEAT_INTERVAL_SEC={values['heartbeat_interval_sec']:g} is too long: the "
            "backend closes a silent connection after 120 s; expected 1-60"
        )
    if values["command_poll_idle_interval_sec"] > 100:
        raise ConfigError(
            f"{PREFIX}COMMAND_POLL_IDLE_INTERVAL_SEC={values['command_poll_idle_interval_sec']:g} is "
            "too long: the backend closes a connection silent for 120 s; expected 0.5-100"
        )
    if values["command_keepalive_sec"] > 60:
        raise ConfigError(
            f"{PREFIX}COMMAND_KEEPALIVE_SEC={values['command_keepalive_sec']:g} is too long: a "
            "running command must report progress at least every 60 s; expected 1-60"
        )
    if values["command_poll_active_window_sec"] > 7 * 86400:
        raise ConfigError(
            f"{PREFIX}COMMAND_POLL_ACTIVE_WINDOW_SEC={values['command_poll_active_window_sec']:g} is "
            "too long; expected 0-604800 seconds (set COMMAND_POLL_IDLE_INTERVAL_SEC to "
            "COMMAND_POLL_INTERVAL_SEC to poll fast always)"
        )
    if values["shutdown_grace_sec"] > 3600:
        raise ConfigError(
            f"{PREFIX}SHUTDOWN_GRACE_SEC={values['shutdown_grace_sec']:g} is too long; expected "
            "0-3600 (and 30 s under the unit's TimeoutStopSec)"
        )
    _check_loki(values)
    _check_client_tls(values)
    if values["ops_port"] > 65535:
        raise ConfigError(f"{PREFIX}OPS_PORT={values['ops_port']} is not a port; expected 0-65535")
    notes: list[str] = []
    raw_backend = overrides.get("backend_url") or env.get(f"{PREFIX}BACKEND_URL")
    if raw_backend and "@" in urlsplit(raw_backend.strip()).netloc:
        notes.append(
            f"{PREFIX}BACKEND_URL carries user info ({mask_url(raw_backend.strip())}); it is not "
            "sent anywhere: the node authenticates with its credential"
        )
    names = {f.name for f in fields(AgentConfig)}
    return AgentConfig(**{k: v for k, v in values.items() if k in names}, notes=tuple(notes))
