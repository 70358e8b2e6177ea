"""
The doctor's checks. Each is a plain blocking function of a L{Context} returning its findings
(one line each); the runner (L{llmport_agent.doctor.run}) runs them on threads, concurrently,
each under its own time limit.

Every check only reads: it never writes a file, never takes the agent's instance lock, never
spends the enrollment token (a token is judged from the state file's record of tokens already
tried), and opens a stream to the backend only when no agent on this node is connected (a
second stream would displace the agent's own).
"""

from __future__ import annotations

import errno
import http.client
import json
import os
import socket
import ssl
import stat
import subprocess
import time
from collections.abc import Callable, Mapping
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import urlsplit

from attrs import field

from llmport_agent.core.config import AgentConfig
from llmport_agent.core.values import define
from llmport_agent.doctor.result import Finding, fail, ok, warn

#: The ports a Ray runtime on this node needs (GCS, Serve HTTP, dashboard, the agent's proxy).
RAY_PORTS = (6379, 8000, 8265, 8089)
#: Clock skew from the backend's Date header: warn above, fail above.
SKEW_WARN_SEC = 30.0
SKEW_FAIL_SEC = 300.0
#: Free space in the model store: fail below, warn below.
STORE_FAIL_BYTES = 1 << 30
STORE_WARN_BYTES = 20 << 30
#: Entries of the model store looked at for links out (bounded walk).
STORE_WALK_MAX = 20_000
STREAM_PATH = "/api/admin/system/nodes/stream"
WHOAMI_PATH = "/api/node-files/whoami"
TOKEN_HELP = "mint an enrollment token in llm-port (or run `sudo llmport-agent join <backend URL>`)"


@define
class Context:
    """What the checks look at. Paths and commands are fields so tests can point them elsewhere."""

    config: AgentConfig | None
    config_error: str = ""
    env_file: str = "/etc/llmport-agent.env"
    environ: Mapping[str, str] = field(factory=dict)
    #: Each network or subprocess operation's own limit (a check may do a few).
    timeout: float = 3.0
    #: The running agent's /readyz body, when one answers on this node.
    readiness: dict[str, Any] | None = None
    #: What answered is the agent (its lock's holder owns the port): only then is it believed.
    ops_trusted: bool = False
    #: Something that is not the agent answered on the ops port: why it is not believed.
    ops_note: str = ""
    unit: str = "llmport-agent.service"
    ray_ports: tuple[int, ...] = RAY_PORTS
    sys_root: str = ""
    now: Callable[[], float] = time.time

    def path(self, absolute: str) -> str:
        return os.path.join(self.sys_root, absolute.lstrip("/")) if self.sys_root else absolute


def _err(e: BaseException) -> str:
    text = getattr(e, "strerror", None) or str(e) or type(e).__name__
    return str(text)[:200]


# -- configuration -------------------------------------------------------------------------


def check_config(ctx: Context) -> list[Finding]:
    if ctx.config is None:
        return [fail("configuration", ctx.config_error or "no configuration",
                     f"fix the variable in {ctx.env_file} (`llmport-agent config --set NAME=VALUE`)")]
    return [ok("configuration", f"backend {ctx.config.backend_url}, agent id {ctx.config.agent_id}")]


# -- backend: DNS, TCP, TLS, clock -------------------------------------------------------


def _backend(ctx: Context) -> tuple[str, str, int, bool]:
    assert ctx.config is not None
    parts = urlsplit(ctx.config.backend_url)
    tls = parts.scheme == "https"
    return ctx.config.backend_url, parts.hostname or "", parts.port or (443 if tls else 80), tls


def _unverified_context() -> ssl.SSLContext:
    """A client TLS context that verifies neither the certificate nor the host name (to read them)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def _tls_context(ctx: Context, verify: bool, client: bool = True) -> ssl.SSLContext:
    """The backend's TLS context; C{client=False} (Loki, another server): the CA only, no client certificate."""
    assert ctx.config is not None
    context = ssl.create_default_context(cafile=ctx.config.ca_bundle) if verify else _unverified_context()
    if client and ctx.config.tls_client_cert:
        context.load_cert_chain(ctx.config.tls_client_cert, ctx.config.tls_client_key)
    return context


def _issuer(host: str, port: int, timeout: float) -> str:
    """The issuer of the certificate the server presents (read without verifying it)."""
    try:
        from OpenSSL import crypto

        with socket.create_connection((host, port), timeout=timeout) as raw:
            with _unverified_context().wrap_socket(raw, server_hostname=host) as s:
                der = s.getpeercert(binary_form=True)
        if not der:
            return "unknown"
        cert = crypto.load_certificate(crypto.FILETYPE_ASN1, der)
        issuer = cert.get_issuer()
        return str(issuer.CN or issuer.O or "unknown")[:120]
    except Exception:
        return "unknown"


#: The backend chain's own budget (DNS, TCP, TLS, clock), under the runner's per-check limit, so
#: what it found before a slow step is still reported.
BACKEND_BUDGET_SEC = 8.0


class _Budget:
    def __init__(self, ctx: Context, total: float) -> None:
        self._ctx = ctx
        self._deadline = time.monotonic() + total

    def left(self) -> float:
        return self._deadline - time.monotonic()

    def op(self) -> float:
        """One operation's timeout: the usual one, or what is left (at least 0.1 s)."""
        return max(0.1, min(self._ctx.timeout, self.left()))


def check_backend(ctx: Context) -> list[Finding]:
    """DNS, then TCP, then TLS (https), then the clock against the backend's Date header."""
    if ctx.config is None:
        return []
    budget = _Budget(ctx, BACKEND_BUDGET_SEC)
    url, host, port, tls = _backend(ctx)
    out: list[Finding] = []
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return [fail("backend dns", f"{host} does not resolve ({e.strerror})",
                     "check LLM_PORT_NODE_AGENT_BACKEND_URL and the node's DNS (/etc/resolv.conf)")]
    addresses = sorted({str(i[4][0]) for i in infos})
    out.append(ok("backend dns", f"{host} resolves to {', '.join(addresses[:4])}"))
    try:
        with socket.create_connection((host, port), timeout=budget.op()):
            pass
    except OSError as e:
        out.append(fail("backend tcp", f"cannot connect to {host}:{port} ({_err(e)})",
                        "check that the backend runs and that a firewall or proxy lets this node reach it"))
        return out
    out.append(ok("backend tcp", f"{host}:{port} accepts connections"))
    assert ctx.config is not None
    if tls:
        if not ctx.config.verify_tls:
            out.append(warn("backend tls", "certificate verification is off (VERIFY_TLS=false)",
                            "set LLM_PORT_NODE_AGENT_CA_BUNDLE to the backend's CA and VERIFY_TLS=true"))
        else:
            try:
                with socket.create_connection((host, port), timeout=budget.op()) as raw:
                    raw.settimeout(budget.op())
                    with _tls_context(ctx, True).wrap_socket(raw, server_hostname=host) as s:
                        version = s.version()
            except ssl.SSLCertVerificationError as e:
                issuer = _issuer(host, port, budget.op())
                where = ctx.config.ca_bundle or "the system's CA store"
                out.append(fail("backend tls", f"certificate of {host} not trusted ({e.verify_message}; "
                                f"issuer: {issuer}; trusted: {where})",
                                f"set LLM_PORT_NODE_AGENT_CA_BUNDLE to the PEM file of the CA \"{issuer}\""))
                return out
            except (ssl.SSLError, OSError) as e:
                out.append(fail("backend tls", f"TLS with {host}:{port} failed ({_err(e)})",
                                "check that the backend URL is https:// only for a TLS port, and the client "
                                "certificate (TLS_CLIENT_CERT/KEY) if the backend asks for one"))
                return out
            out.append(ok("backend tls", f"{version}, certificate verified against "
                                         f"{ctx.config.ca_bundle or 'the system CA store'}"))
    elif host not in ("localhost",) and not host.startswith("127.") and host != "::1":
        out.append(warn("backend tls", "plain http: the credential travels unencrypted",
                        "use an https:// BACKEND_URL"))
    if budget.left() < 0.5:
        out.append(warn("clock", "not checked: the backend was too slow to answer in time",
                        "check the network path to the backend (latency, a proxy)"))
        return out
    out.append(_clock(ctx, url, budget.op()))
    return out


def _http(ctx: Context, url: str, method: str = "GET", headers: Mapping[str, str] | None = None,
          verify: bool | None = None, timeout: float | None = None) -> tuple[int, dict[str, str], bytes]:
    """One bounded HTTP request (body at most 64 KiB): (status, headers lower-cased, body)."""
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    host = parts.hostname or ""
    port = parts.port or (443 if tls else 80)
    conn: http.client.HTTPConnection
    limit = ctx.timeout if timeout is None else timeout
    if tls:
        assert ctx.config is not None
        context = _tls_context(ctx, ctx.config.verify_tls if verify is None else verify)
        conn = http.client.HTTPSConnection(host, port, timeout=limit, context=context)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=limit)
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request(method, path, headers=dict(headers or {}))
        response = conn.getresponse()
        body = response.read(65536)
        return response.status, {k.lower(): v for k, v in response.getheaders()}, body
    finally:
        conn.close()


def _clock(ctx: Context, url: str, timeout: float) -> Finding:
    try:
        _status, headers, _body = _http(ctx, url.rstrip("/") + "/", timeout=timeout)
    except Exception as e:
        return warn("clock", f"could not ask the backend for its time ({_err(e)})", "check the backend first")
    date = headers.get("date")
    if not date:
        return warn("clock", "the backend sends no Date header: skew unknown",
                    "check the node's time with `timedatectl` (NTP synchronised: yes)")
    try:
        theirs = parsedate_to_datetime(date).timestamp()
    except (TypeError, ValueError):
        return warn("clock", f"unreadable Date header {date[:60]!r}", "check the node's time with `timedatectl`")
    skew = ctx.now() - theirs
    text = f"this node's clock is {abs(skew):.0f} s {'ahead of' if skew > 0 else 'behind'} the backend's"
    if abs(skew) > SKEW_FAIL_SEC:
        return fail("clock", text, "synchronise the clock (`timedatectl set-ntp true`, chrony): commands "
                    "expire and certificates fail with a wrong clock")
    if abs(skew) > SKEW_WARN_SEC:
        return warn("clock", text, "enable NTP (`timedatectl set-ntp true`)")
    return ok("clock", f"within {max(1, round(abs(skew)))} s of the backend")


# -- credential / token --------------------------------------------------------------------


def _state(ctx: Context) -> dict[str, Any]:
    assert ctx.config is not None
    try:
        with open(ctx.config.state_path, encoding="utf-8") as f:
            data = json.loads(f.read(4 << 20))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _agent_connected(ctx: Context) -> bool:
    """The running agent (verified: never a squatter on its port) says it is connected."""
    if not ctx.ops_trusted:
        return False
    checks = (ctx.readiness or {}).get("checks") or {}
    return bool((checks.get("session") or {}).get("ok"))


def _env_file_url(ctx: Context) -> str | None:
    """The env file's BACKEND_URL (the unit's), not this shell's."""
    from llmport_agent.host.installer import EnvFile

    try:
        with open(ctx.env_file, encoding="utf-8", errors="replace") as f:
            values = EnvFile.parse(f.read(1 << 20)).values()
    except OSError:
        return None
    return values.get("LLM_PORT_NODE_AGENT_BACKEND_URL") or None


def check_ops_port(ctx: Context) -> list[Finding]:
    """Something that is not the agent answering on its loopback ops port (opsprobe)."""
    if ctx.config is None or not ctx.ops_note:
        return []
    port = ctx.config.ops_port
    return [fail("ops port", f"something that is not the agent answers on 127.0.0.1:{port} ({ctx.ops_note}); its "
                 "answers are ignored", f"find it with `ss -ltnp 'sport = :{port}'`, stop it, then start the agent")]


def check_credential(ctx: Context) -> list[Finding]:
    if ctx.config is None:
        return []
    state = _state(ctx)
    credential = state.get("credential") if isinstance(state.get("credential"), str) else ""
    token = ctx.config.enrollment_token
    if not credential:
        if not token:
            return [fail("credential", "no credential in the state file and no enrollment token",
                         f"{TOKEN_HELP} and set LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN")]
        from llmport_agent.core.state import token_fingerprint

        if token_fingerprint(token) in (state.get("used_tokens") or []):
            return [fail("credential", "no credential, and the configured enrollment token was already "
                         "tried: the backend used it or rejected it (invalid, expired or used)",
                         f"{TOKEN_HELP}, set LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN and restart the agent")]
        return [warn("credential", "no credential yet; an enrollment token is set (single use, valid 30 "
                     "minutes after it was minted; not tried here: that would spend it)",
                     "start the agent now (`sudo llmport-agent start`), or mint a fresh token if it is older")]
    if _agent_connected(ctx):
        return [ok("credential", "the running agent is connected with it")]
    from llmport_agent.host.join import credential_issuer, same_backend

    # The credential goes only to the backend that issued it (recorded in the state; for an
    # older state, the env file's BACKEND_URL): never to a URL given in this shell.
    issuer = credential_issuer(state, _env_file_url(ctx))
    if issuer is not None and not same_backend(issuer, ctx.config.backend_url):
        from llmport_agent.core.config import mask_url

        return [fail("credential", f"issued by {mask_url(issuer)}, but BACKEND_URL is "
                     f"{mask_url(ctx.config.backend_url)}: not sent there (the agent refuses to start so)",
                     f"set BACKEND_URL back, or `sudo llmport-agent join {mask_url(ctx.config.backend_url)}` "
                     "(a new join)")]
    url = ctx.config.backend_url.rstrip("/")
    headers = {"Authorization": f"Bearer {credential}"}
    try:
        code, _h, body = _http(ctx, url + WHOAMI_PATH, headers=headers)
    except Exception as e:
        return [warn("credential", f"not checked: the backend did not answer ({_err(e)})", "check the backend first")]
    from llmport_agent.core.cleantext import shown
    from llmport_agent.session.backend_http import is_route_missing

    route_missing = is_route_missing(code, body)
    if code == 200:
        try:
            node = json.loads(body).get("node_id", "")
        except (ValueError, AttributeError, RecursionError):
            node = ""
        # The backend's words on the operator's terminal: bounded, no control characters.
        return [ok("credential", f"the backend knows this node (node {shown(str(node), 200)})")]
    if code in (401, 403) or (code == 404 and not route_missing):
        return [fail("credential", f"the backend refuses this node's credential (whoami: HTTP {code}): the node "
                     "was deleted in llm-port or its credential revoked",
                     f"sudo llmport-agent join {ctx.config.backend_url}, or {TOKEN_HELP}, set "
                     "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN and restart")]
    if not route_missing:
        return [warn("credential", f"whoami answered HTTP {code}", "check the backend's logs")]
    return [_upgrade_attempt(ctx, credential)]


def _upgrade_attempt(ctx: Context, credential: str) -> Finding:
    """
    An older backend (no whoami): the stream upgrade, read up to its status line only, then
    closed at once (no frame is read or sent: the backend sees a connection that went away).
    """
    assert ctx.config is not None
    import base64

    parts = urlsplit(ctx.config.backend_url)
    tls = parts.scheme == "https"
    host = parts.hostname or ""
    port = parts.port or (443 if tls else 80)
    key = base64.b64encode(os.urandom(16)).decode()
    request = (f"GET {parts.path.rstrip('/')}{STREAM_PATH} HTTP/1.1\r\nHost: {parts.netloc.rsplit('@', 1)[-1]}\r\n"
               f"Authorization: Bearer {credential}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode()
    try:
        with socket.create_connection((host, port), timeout=ctx.timeout) as raw:
            raw.settimeout(ctx.timeout)
            conn: Any = _tls_context(ctx, ctx.config.verify_tls).wrap_socket(raw, server_hostname=host) if tls else raw
            conn.sendall(request)
            line = b""
            while b"\r\n" not in line and len(line) < 1024:
                chunk = conn.recv(1024)
                if not chunk:
                    break
                line += chunk
    except OSError as e:
        return warn("credential", f"not checked: the stream did not answer ({_err(e)})", "check the backend first")
    try:
        code = int(line.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return warn("credential", "not checked: the stream answered something that is not HTTP",
                    "check BACKEND_URL")
    if code == 101:
        return ok("credential", "the backend accepts it (stream upgrade)")
    if code in (401, 403):
        return fail("credential", f"the backend refuses this node's credential (stream: HTTP {code})",
                    f"{TOKEN_HELP}, set LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN and restart the agent")
    return warn("credential", f"stream upgrade answered HTTP {code}", "check BACKEND_URL (its base path)")


# -- Docker engine, NVIDIA ----------------------------------------------------------------


def check_engine(ctx: Context) -> list[Finding]:
    from llmport_agent.workloads.engine import default_address

    address = ctx.environ.get("DOCKER_HOST") or default_address()
    try:
        import docker

        client = docker.DockerClient(base_url=address, version="auto", timeout=max(1, int(ctx.timeout)))
    except Exception as e:
        return [_engine_failure(address, e, ctx.timeout)]
    try:
        version = client.version()
        info = client.info()
    except Exception as e:
        return [_engine_failure(address, e, ctx.timeout)]
    finally:
        client.close()
    runtimes = sorted((info.get("Runtimes") or {}).keys())
    detail = (f"{version.get('Version', '?')} (API {version.get('ApiVersion', '?')}) at {address}, "
              f"runtimes: {', '.join(runtimes) or 'none'}")
    return [ok("docker engine", detail)]


def _engine_failure(address: str, e: BaseException, timeout: float | None = None) -> Finding:
    """The failure in the agent's own words (its L{translate_error}), and the fix for its cause."""
    from llmport_agent.workloads.engine import translate_error

    error = translate_error("checking the engine", address, e, timeout)
    text = str(error).split(" failed: ", 1)[-1]
    cause: BaseException | None = e
    seen: set[int] = set()
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, PermissionError) or getattr(cause, "errno", None) == errno.EACCES:
            return fail("docker engine", f"no access to {address} (permission denied)",
                        "run the agent as root or add its user to the docker group (`usermod -aG docker USER`)")
        cause = cause.__cause__ or cause.__context__
    if getattr(error, "unreachable", False):
        return fail("docker engine", text[:300],
                    "start it (`systemctl start docker`) or set DOCKER_HOST to its socket")
    return fail("docker engine", text[:300], "check `systemctl status docker` and `docker info`")


def _nvidia_present(ctx: Context) -> bool:
    return os.path.exists(ctx.path("/dev/nvidiactl")) or os.path.isdir(ctx.path("/proc/driver/nvidia/gpus"))


def check_nvidia_runtime(ctx: Context) -> list[Finding]:
    if not _nvidia_present(ctx):
        return [ok("nvidia toolkit", "no NVIDIA GPU on this node: not needed")]
    cdi = []
    for d in ("/etc/cdi", "/var/run/cdi"):
        try:
            for name in sorted(os.listdir(ctx.path(d)))[:64]:
                if name.endswith((".yaml", ".yml", ".json")) and "nvidia" in name:
                    cdi.append(os.path.join(d, name))
        except OSError:
            continue
    runtimes: list[str] = []
    try:
        import docker

        from llmport_agent.workloads.engine import default_address

        client = docker.DockerClient(base_url=ctx.environ.get("DOCKER_HOST") or default_address(),
                                     version="auto", timeout=max(1, int(ctx.timeout)))
        try:
            runtimes = sorted((client.info().get("Runtimes") or {}).keys())
        finally:
            client.close()
    except Exception:
        pass
    if "nvidia" in runtimes or cdi:
        via = ["the engine's nvidia runtime"] if "nvidia" in runtimes else []
        via += [f"CDI spec {p}" for p in cdi[:2]]
        return [ok("nvidia toolkit", ", ".join(via))]
    return [fail("nvidia toolkit", "NVIDIA GPUs present, but no nvidia runtime in the engine and no CDI spec",
                 "install nvidia-container-toolkit, then `nvidia-ctk runtime configure --runtime=docker` and "
                 "restart docker (or `nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml`)")]


def check_nvml(ctx: Context) -> list[Finding]:
    present = _nvidia_present(ctx)
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:
        if not present:
            return [ok("nvml", "no NVIDIA driver: no NVIDIA GPUs to report")]
        return [fail("nvml", f"NVML does not load ({_err(e)})",
                     "install the NVIDIA driver matching the kernel (`nvidia-smi` must work)")]
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        count = pynvml.nvmlDeviceGetCount()
        findings = [ok("nvml", f"driver {driver}, {count} GPU(s)")]
        bad = []
        for i in range(min(count, 64)):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                ecc = pynvml.nvmlDeviceGetTotalEccErrors(handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                         pynvml.NVML_VOLATILE_ECC)
            except Exception:
                ecc = 0
            if ecc:
                bad.append(f"GPU {i}: {ecc} uncorrected ECC errors since boot")
        if bad:
            findings.append(warn("gpu health", "; ".join(bad)[:300],
                                 "drain the GPU's workloads and reset it (`nvidia-smi -r -i N`) or reboot"))
        return findings
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def check_gpu_health(ctx: Context) -> list[Finding]:
    """The running agent's verdicts (its health monitor watches Xid events), when it answers."""
    checks = (ctx.readiness or {}).get("checks") or {}
    nvml = checks.get("nvml")
    if not isinstance(nvml, dict):
        return []
    health = nvml.get("health") or {}
    unhealthy = int(health.get("unhealthy", 0) or 0)
    degraded = int(health.get("degraded", 0) or 0)
    detail = str(nvml.get("detail", ""))[:300]
    if unhealthy:
        return [fail("gpu health", detail, "drain the node's workloads from that GPU, then reset it "
                     "(`nvidia-smi -r -i N`) or reboot; replace it if it comes back")]
    if degraded:
        return [warn("gpu health", detail, "watch the GPU (`nvidia-smi -q -d ECC,PAGE_RETIREMENT`)")]
    return [ok("gpu health", detail or "no GPU reported bad by the running agent")]


# -- files: model store, state, env file ------------------------------------------------


def check_model_store(ctx: Context) -> list[Finding]:
    if ctx.config is None:
        return []
    store = ctx.config.model_store
    try:
        st = os.lstat(store)
    except FileNotFoundError:
        return [warn("model store", f"{store} does not exist yet",
                     f"`sudo mkdir -p {store}` (`llmport-agent start` creates it)")]
    except OSError as e:
        return [fail("model store", f"cannot read {store} ({_err(e)})", "run the doctor as the agent's user or root")]
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return [fail("model store", f"{store} is not a plain directory (a link or a file)",
                     "make it a real directory; the agent refuses links in the store")]
    out: list[Finding] = []
    vfs = os.statvfs(store)
    free = vfs.f_bavail * vfs.f_frsize
    size = vfs.f_blocks * vfs.f_frsize
    if vfs.f_flag & os.ST_RDONLY:
        out.append(fail("model store", f"{store} is on a read-only file system",
                        "mount it read-write, or set LLM_PORT_NODE_AGENT_MODEL_STORE_READ_ONLY=true if it is "
                        "meant to be read-only"))
    elif free < STORE_FAIL_BYTES:
        out.append(fail("model store", f"{store}: {free / 2**30:.2f} GiB free of {size / 2**30:.1f} GiB",
                        "free space (remove unused models) or move the store (MODEL_STORE) to a larger disk"))
    elif free < STORE_WARN_BYTES:
        out.append(warn("model store", f"{store}: {free / 2**30:.1f} GiB free of {size / 2**30:.1f} GiB",
                        "a large model needs tens of GiB: free space or use a larger disk"))
    euid = os.geteuid()
    if st.st_uid != euid and euid == 0:
        out.append(warn("model store", f"{store} is owned by uid {st.st_uid}, not root",
                        f"`sudo chown -R root {store}`, or run the agent as that user (`start --user`)"))
    elif st.st_uid != euid:
        out.append(warn("model store", f"{store} is owned by uid {st.st_uid}, not this user (uid {euid})",
                        "run the doctor as the agent's user"))
    if st.st_mode & stat.S_IWOTH:
        out.append(fail("model store", f"{store} is writable by every user (mode {stat.S_IMODE(st.st_mode):04o})",
                        f"`chmod o-w {store}`"))
    links = _links_out(store, deadline=time.monotonic() + max(0.5, ctx.timeout / 2))
    if links:
        out.append(warn("model store", f"links leading out of the store: {', '.join(links[:3])}",
                        "remove them: the agent never follows links out of the store"))
    if not any(f.status != "ok" for f in out):
        out.insert(0, ok("model store", f"{store}: {free / 2**30:.1f} GiB free of {size / 2**30:.1f} GiB, "
                                        "writable, no links out"))
    return out


def _links_out(root: str, deadline: float) -> list[str]:
    """Symbolic links under C{root} whose target resolves outside it (bounded walk)."""
    found: list[str] = []
    seen = 0
    real_root = os.path.realpath(root)
    stack = [root]
    while stack and seen < STORE_WALK_MAX and time.monotonic() < deadline:
        here = stack.pop()
        try:
            entries = list(os.scandir(here))
        except OSError:
            continue
        for entry in entries:
            seen += 1
            if entry.is_symlink():
                target = os.path.realpath(entry.path)
                if os.path.commonpath([real_root, target]) != real_root:
                    found.append(os.path.relpath(entry.path, root))
            elif entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
    return found


def check_files(ctx: Context) -> list[Finding]:
    out: list[Finding] = []
    if ctx.config is not None:
        state_dir = os.path.dirname(os.path.abspath(ctx.config.state_path))
        try:
            mode = stat.S_IMODE(os.stat(state_dir).st_mode)
        except FileNotFoundError:
            out.append(ok("state directory", f"{state_dir} does not exist yet (made at the first start)"))
        except OSError as e:
            out.append(fail("state directory", f"cannot read {state_dir} ({_err(e)})", "run the doctor as root"))
        else:
            if mode & 0o022:
                out.append(fail("state directory", f"{state_dir} is writable by others (mode {mode:04o})",
                                f"`chmod 700 {state_dir}`"))
            elif mode & 0o007:
                out.append(warn("state directory", f"{state_dir} is open to other users (mode {mode:04o})",
                                f"`chmod 700 {state_dir}`"))
            else:
                try:
                    file_mode = stat.S_IMODE(os.stat(ctx.config.state_path).st_mode)
                except OSError:
                    file_mode = 0o600
                if file_mode & 0o077:
                    out.append(fail("state directory", f"{ctx.config.state_path} (the credential) has mode "
                                    f"{file_mode:04o}", f"`chmod 600 {ctx.config.state_path}`"))
                else:
                    out.append(ok("state directory", f"{state_dir} mode {mode:04o}"))
    out.append(_env_file(ctx))
    key = _client_key(ctx)
    if key is not None:
        out.append(key)
    return out


def _client_key(ctx: Context) -> Finding | None:
    """The TLS client key (C{TLS_CLIENT_KEY}, or the certificate file holding it): the agent's only."""
    if ctx.config is None or not ctx.config.tls_client_cert:
        return None
    var = "TLS_CLIENT_KEY" if ctx.config.tls_client_key else "TLS_CLIENT_CERT"
    path = ctx.config.tls_client_key or ctx.config.tls_client_cert
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError as e:
        return fail("tls client key", f"cannot read {path} ({_err(e)})", "run the doctor as root (sudo)")
    if mode & 0o077:
        return fail("tls client key", f"LLM_PORT_NODE_AGENT_{var}={path} (the node's private key) is open to "
                    f"other users (mode {mode:04o})", f"`sudo chmod 600 {path}`")
    return ok("tls client key", f"{path} mode {mode:04o}")


_SECRET_VARS = ("ENROLLMENT_TOKEN", "LOKI_PASSWORD", "LOKI_BEARER_TOKEN")


def _env_file(ctx: Context) -> Finding:
    path = ctx.env_file
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return ok("env file", f"{path} absent (settings come from the environment)")
    except OSError as e:
        return fail("env file", f"cannot read {path} ({_err(e)})", "run the doctor as root (sudo)")
    mode = stat.S_IMODE(st.st_mode)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 20)
    except OSError:
        text = ""
    secrets = [v for v in _SECRET_VARS if f"LLM_PORT_NODE_AGENT_{v}=" in text]
    if mode & 0o077 and secrets:
        return fail("env file", f"{path} holds {', '.join(secrets)} and is readable by others (mode {mode:04o})",
                    f"`sudo chmod 600 {path}`")
    if mode & 0o022:
        return fail("env file", f"{path} is writable by others (mode {mode:04o})", f"`sudo chmod 600 {path}`")
    if mode & 0o077:
        return warn("env file", f"{path} is readable by others (mode {mode:04o})", f"`sudo chmod 600 {path}`")
    return ok("env file", f"{path} mode {mode:04o}")


# -- systemd, journald ---------------------------------------------------------------------


def _run(ctx: Context, argv: list[str]) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=ctx.timeout, check=False,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return 127, ""
    return done.returncode, (done.stdout or "")[:65536]


def check_systemd(ctx: Context) -> list[Finding]:
    if not os.path.isdir(ctx.path("/run/systemd/system")):
        return [ok("systemd unit", "systemd is not running here (foreground or container): not checked")]
    code, out = _run(ctx, ["systemctl", "show", ctx.unit, "--no-pager",
                           "-p", "LoadState,ActiveState,SubState,Type,NotifyAccess,NRestarts"])
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    if code != 0 or props.get("LoadState") in (None, "not-found"):
        return [warn("systemd unit", f"{ctx.unit} is not installed", "`sudo llmport-agent start` installs and starts it")]
    findings = []
    state = f"{props.get('ActiveState')}/{props.get('SubState')}"
    if props.get("ActiveState") != "active":
        findings.append(fail("systemd unit", f"{ctx.unit} is {state}",
                             f"`journalctl -u {ctx.unit} -n 50` says why; `sudo systemctl restart {ctx.unit}`"))
    elif props.get("Type") != "notify":
        findings.append(warn("systemd unit", f"{ctx.unit} is {state} but Type={props.get('Type')}",
                             "re-install the unit (`sudo llmport-agent start`): Type=notify gives readiness and the watchdog"))
    else:
        findings.append(ok("systemd unit", f"{ctx.unit} {state}, Type=notify, NotifyAccess={props.get('NotifyAccess')}, "
                                           f"{props.get('NRestarts', '0')} restarts"))
    code, out = _run(ctx, ["systemd-analyze", "security", ctx.unit, "--no-pager"])
    for line in out.splitlines():
        if "Overall exposure level" in line:
            try:
                level = float(line.split(":")[1].split()[0])
            except (IndexError, ValueError):
                break
            if level > 5.0:
                findings.append(warn("unit exposure", line.strip()[:160],
                                     "re-install the shipped unit (`sudo llmport-agent start`): its hardening rates 2.8"))
            else:
                findings.append(ok("unit exposure", line.split(":", 1)[1].strip()[:80]))
            break
    return findings


def check_journald(ctx: Context) -> list[Finding]:
    code, _out = _run(ctx, ["journalctl", "-n", "1", "-q", "--no-pager", "-o", "cat"])
    if code == 127:
        return [ok("journald", "journalctl not installed: the journal reader is off")]
    if code != 0:
        return [warn("journald", "this user cannot read the journal",
                     "add the agent's user to systemd-journal (`usermod -aG systemd-journal USER`)")]
    return [ok("journald", "the journal is readable")]


# -- Loki -------------------------------------------------------------------------------------


LOG_SINK_PATH = "/api/node-files/log-sink"


def check_loki(ctx: Context) -> list[Finding]:
    """
    Where the agent ships logs, as the agent does it: to C{LOKI_URL} with the operator's Loki
    credentials; with C{LOKI_URL} unset, to the sink the backend names (asked here with the
    node's credential, as the agent asks; pushed to without the operator's Loki credentials),
    or nowhere. A running agent's own count of failed pushes (its C{/readyz}) comes first.
    """
    if ctx.config is None:
        return []
    c = ctx.config
    running = ((ctx.readiness or {}).get("checks") or {}).get("loki")
    if isinstance(running, dict) and running.get("ok") is False:
        return [fail("loki", f"the running agent: {str(running.get('detail', ''))[:300]}",
                     "check LLM_PORT_NODE_AGENT_LOKI_URL and its credentials" if c.loki_url else
                     "the sink is the backend's (LOKI_URL unset): check it with the llm-port operator, or "
                     "set LLM_PORT_NODE_AGENT_LOKI_URL to ship elsewhere")]
    if c.loki_url:
        return [_push_check(ctx, str(c.loki_url), operator=True)]
    state = _state(ctx)
    credential = state.get("credential") if isinstance(state.get("credential"), str) else ""
    if isinstance(running, dict) and running.get("source") == "backend":
        return [ok("loki", f"LOKI_URL unset: the running agent ships to the backend's log sink "
                   f"{str(running.get('url', ''))[:200]} ({str(running.get('detail', ''))[:200]})")]
    if not credential:
        return [ok("loki", "LOKI_URL unset: the agent asks the backend for its log sink once it has a "
                   "credential; until then logs are not shipped")]
    from llmport_agent.host.join import credential_issuer, same_backend

    # As check_credential: the credential goes only to the backend that issued it.
    issuer = credential_issuer(state, _env_file_url(ctx))
    if issuer is not None and not same_backend(issuer, c.backend_url):
        from llmport_agent.core.config import mask_url

        return [warn("loki", f"LOKI_URL unset; the backend's log sink not asked: the credential was issued by "
                     f"{mask_url(issuer)}, not BACKEND_URL {mask_url(c.backend_url)} (not sent there)",
                     "see the credential line above")]
    url = c.backend_url.rstrip("/") + LOG_SINK_PATH
    try:
        code, _h, body = _http(ctx, url, headers={"Authorization": f"Bearer {credential}"})
    except Exception as e:
        return [warn("loki", f"LOKI_URL unset, and the backend did not answer the question for its log sink "
                     f"({_err(e)})", "check the backend first")]
    if code == 404:
        return [ok("loki", "LOKI_URL unset and the backend names no log sink (HTTP 404): log shipping off")]
    if code != 200:
        return [warn("loki", f"LOKI_URL unset; the backend answered HTTP {code} to the question for its log sink",
                     "check the credential line above and the backend's logs")]
    try:
        raw = json.loads(body).get("loki_url")
    except (ValueError, AttributeError, RecursionError):
        return [warn("loki", "LOKI_URL unset; the backend's answer for its log sink is not JSON",
                     "check the backend's logs")]
    if raw is None or raw == "":
        return [ok("loki", "LOKI_URL unset and the backend names no log sink: log shipping off")]
    from llmport_agent.logs.sink import validate_sink_url

    try:
        sink = validate_sink_url(raw)
    except ValueError as e:
        return [warn("loki", f"LOKI_URL unset; the backend's log sink is not usable ({str(e)[:200]}): logs are "
                     "not shipped", "ask the llm-port operator to fix the sink, or set LLM_PORT_NODE_AGENT_LOKI_URL")]
    return [_push_check(ctx, sink, operator=False)]


def _push_check(ctx: Context, url: str, operator: bool) -> Finding:
    """An empty push to the sink, with the credentials the agent would send there."""
    from llmport_agent.core.config import mask_url

    assert ctx.config is not None
    c = ctx.config
    parts = urlsplit(url)
    base = f"{parts.scheme}://{parts.hostname}{':' + str(parts.port) if parts.port else ''}"
    where = base if operator else f"LOKI_URL unset: the backend's log sink {mask_url(url)}"
    fix_url = ("check LLM_PORT_NODE_AGENT_LOKI_URL and the network" if operator else
               "the sink is the backend's: check it with the llm-port operator, or set LLM_PORT_NODE_AGENT_LOKI_URL")
    headers: dict[str, str] = {}
    try:
        from llmport_agent.logs.auth import LokiAuth

        if operator:
            auth = LokiAuth(tenant=c.loki_tenant, username=c.loki_username or parts.username,
                            password=c.loki_password or parts.password, password_file=c.loki_password_file,
                            bearer_token=c.loki_bearer_token, bearer_token_file=c.loki_bearer_token_file)
        else:
            # As the agent does: the operator's Loki credentials are not sent to the backend's sink.
            auth = LokiAuth(tenant=c.loki_tenant, username=parts.username, password=parts.password)
        auth.load()
        headers.update(auth.headers())
        pair = auth.basic()
        if pair is not None:
            import base64

            headers["Authorization"] = "Basic " + base64.b64encode(f"{pair[0]}:{pair[1]}".encode()).decode()
    except ValueError as e:
        return fail("loki", f"the Loki credentials cannot be used ({str(e)[:160]})", "fix the LOKI_* settings")
    # An empty push: Loki answers 204 when the credentials are good, 401/403 when not.
    body = json.dumps({"streams": []}).encode()
    try:
        code, _h, answer = _post(ctx, base + (parts.path or "").rstrip("/") + "/loki/api/v1/push", body, headers)
    except Exception as e:
        return fail("loki", f"{where} did not answer ({_err(e)})", fix_url)
    if code in (401, 403):
        return fail("loki", f"{where} refused the credentials (HTTP {code})",
                    "check LOKI_USERNAME/LOKI_PASSWORD(_FILE), LOKI_BEARER_TOKEN(_FILE) or LOKI_TENANT" if operator
                    else fix_url)
    if code >= 500 or code == 404:
        return fail("loki", f"{where} answered HTTP {code} to a push",
                    "check that LOKI_URL points at Loki" if operator else fix_url)
    from llmport_agent.logs.wiring import journal_selection

    units = journal_selection(c, backend_sink=not operator)
    journal = ("no host journal" if units is None else "the whole host journal" if not units
               else "host journal units " + ", ".join(units)[:200])
    return ok("loki", f"{where} accepts pushes (HTTP {code}); ships the agent's and workloads' logs and {journal}")


def _post(ctx: Context, url: str, body: bytes, headers: Mapping[str, str]) -> tuple[int, dict[str, str], bytes]:
    parts = urlsplit(url)
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(parts.hostname or "", parts.port or 443, timeout=ctx.timeout,
                                           context=_tls_context(ctx, True, client=False) if ctx.config else None)
    else:
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=ctx.timeout)
    try:
        conn.request("POST", parts.path, body=body, headers={"Content-Type": "application/json", **headers})
        r = conn.getresponse()
        return r.status, {}, r.read(65536)
    finally:
        conn.close()


# -- Ray: ports, RDMA ---------------------------------------------------------------------


def _holder(port: int) -> str:
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return f"{psutil.Process(conn.pid).name()} (pid {conn.pid})"
    except Exception:
        pass
    return "another program"


def check_ray_ports(ctx: Context) -> list[Finding]:
    taken = []
    for port in ctx.ray_ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    taken.append(f"{port} by {_holder(port)}")
    if taken:
        return [warn("ray ports", f"in use: {', '.join(taken)}",
                     "a multi-node (Ray) runtime on this node needs them free: stop what holds them, unless "
                     "it is this agent's own Ray runtime")]
    return [ok("ray ports", f"{', '.join(str(p) for p in ctx.ray_ports)} free")]


def check_rdma(ctx: Context) -> list[Finding]:
    try:
        devices = sorted(os.listdir(ctx.path("/sys/class/infiniband")))[:16]
    except OSError:
        devices = []
    if not devices:
        return [ok("rdma", "no RDMA devices: multi-node traffic uses TCP")]
    try:
        verbs = [n for n in os.listdir(ctx.path("/dev/infiniband")) if n.startswith("uverbs")]
    except OSError:
        verbs = []
    if not verbs:
        return [warn("rdma", f"{', '.join(devices)} present but no /dev/infiniband/uverbs*",
                     "load the verbs module (`modprobe ib_uverbs`) and install rdma-core")]
    return [ok("rdma", f"{', '.join(devices)} ({len(verbs)} verbs devices)")]


#: Every check, in the order the report lists them.
CHECKS: tuple[tuple[str, Callable[[Context], list[Finding]]], ...] = (
    ("configuration", check_config),
    ("ops port", check_ops_port),
    ("backend", check_backend),
    ("credential", check_credential),
    ("docker engine", check_engine),
    ("nvidia toolkit", check_nvidia_runtime),
    ("nvml", check_nvml),
    ("gpu health", check_gpu_health),
    ("model store", check_model_store),
    ("files", check_files),
    ("systemd unit", check_systemd),
    ("journald", check_journald),
    ("loki", check_loki),
    ("ray ports", check_ray_ports),
    ("rdma", check_rdma),
)

__all__ = ["CHECKS", "RAY_PORTS", "Context"]
