"""
C{llmport-agent start | stop | status} and C{config --set/--unset}: the agent under systemd.

C{start} (root) writes C{/etc/llmport-agent.env} (0600) from the current
C{LLM_PORT_NODE_AGENT_*} variables over what the file already holds, validated exactly as at
start-up; installs the unit with the real path of the installed executable, the configured
model store and (C{--user}) a dedicated user; creates the directories; then C{daemon-reload},
C{enable} and C{restart}. Any failure undoes what it did: nothing is left behind.

C{$LLMPORT_AGENT_SYSTEM_ROOT} (tests only) puts every system path under another directory.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import unicodedata
from collections.abc import Callable, Mapping
from typing import IO, Any

from attrs import field

from llmport_agent.core.config import (
    PREFIX,
    SETTINGS,
    AgentConfig,
    ConfigError,
    load_config,
    mask,
    mask_url,
)
from llmport_agent.core.values import define
from llmport_agent.host.previousbuild import NotKept, PreviousBuild

#: Settings written into the unit itself (ReadWritePaths=, ExecStartPre=): a change needs
#: `llmport-agent start` again, not only a restart. The configuration reference says so.
UNIT_PATH_SETTINGS = ("MODEL_STORE", "STATE_PATH")
UNIT_NAME = "llmport-agent.service"
EX_FAIL = 1
EX_CONFIG = 2
EX_NOT_RUNNING = 3
DEFAULT_MODEL_STORE = "/srv/llm-port/models"
DEFAULT_STATE_DIR = "/var/lib/llmport-agent"
#: Where an executable does not survive a reboot, or is hidden from the unit (PrivateTmp=yes).
UNSTABLE_PREFIXES = ("/tmp/", "/var/tmp/", "/dev/shm/", "/run/user/")
SYSTEMCTL_TIMEOUT = 180.0


# -- the env file (systemd EnvironmentFile= syntax) -------------------------------------------


def _unquote(raw: str) -> str:
    value = raw.strip()
    if len(value) >= 2 and value[0] == value[-1] == "'":
        return value[1:-1]
    if len(value) >= 2 and value[0] == value[-1] == '"':
        # systemd: inside double quotes a backslash escapes only " \ ` $; before anything else
        # it is kept as it is.
        out, escape = [], False
        for ch in value[1:-1]:
            if escape:
                if ch not in '"\\`$':
                    out.append("\\")
                out.append(ch)
                escape = False
            elif ch == "\\":
                escape = True
            else:
                out.append(ch)
        return "".join(out)
    return value


#: Characters no value written to the env file or the unit may hold: both are line-based
#: (systemd splits at newline and carriage return; Python's splitlines at more), so any of them
#: would end the line and let the rest become a directive or another variable.
_LINE_BREAKERS = frozenset("\u0085\u2028\u2029")


def check_value(what: str, value: str) -> None:
    """
    Refuse a value holding a control character (C0, DEL, C1) or a Unicode line separator: the
    one check every value written to the env file or the unit goes through.
    """
    for ch in value:
        if ch in _LINE_BREAKERS or unicodedata.category(ch) == "Cc":
            raise ConfigError(
                f"{what} holds a control character ({ch!r}): env files and units are line-based, "
                "so it is refused; give the value without newlines or other control characters"
            )


def _quote(value: str, what: str = "a value") -> str:
    """C{value} in systemd's quoting, checked (see L{check_value})."""
    check_value(what, value)
    if value and all(c.isalnum() or c in "-_.:/@%+,=~" for c in value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _unit_word(value: str, what: str, exec_line: bool = False) -> str:
    """
    C{value} as one word of a unit directive: quoted, with systemd's specifiers (C{%}) and, on
    an C{Exec*=} line, its variable references (C{$}) doubled so they stay literal.
    """
    quoted = _quote(value, what).replace("%", "%%")
    return quoted.replace("$", "$$") if exec_line else quoted


@define
class EnvFile:
    """The lines of an env file; edits keep comments, order and other variables."""

    lines: list[str] = field(factory=list)

    @classmethod
    def parse(cls, text: str) -> EnvFile:
        # Split where systemd splits (newline; a carriage return ends a line too), not at every
        # Unicode line boundary as str.splitlines() would.
        lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        if lines and not lines[-1]:
            lines.pop()
        return cls(lines)

    def _key(self, line: str) -> str | None:
        stripped = line.strip()
        if not stripped or stripped[0] in "#;" or "=" not in stripped:
            return None
        key = stripped.split("=", 1)[0].strip()
        if key.startswith("export "):
            key = key[len("export "):].strip()
        return key

    def values(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for line in self.lines:
            key = self._key(line)
            if key:
                out[key] = _unquote(line.split("=", 1)[1])
        return out

    def set(self, key: str, value: str) -> None:
        new = f"{key}={_quote(value, key)}"
        for i, line in enumerate(self.lines):
            if self._key(line) == key:
                self.lines[i] = new
                # Later duplicates would win in systemd: drop them.
                self.lines[i + 1:] = [x for x in self.lines[i + 1:] if self._key(x) != key]
                return
        self.lines.append(new)

    def unset(self, key: str) -> None:
        self.lines = [x for x in self.lines if self._key(x) != key]

    def text(self) -> str:
        return "\n".join(self.lines) + ("\n" if self.lines else "")


def write_private(path: str, text: str, mode: int = 0o600) -> None:
    """Write C{text} atomically and durably (temporary file, fsync, rename, directory fsync)."""
    from llmport_agent.core.storage import atomic_write

    atomic_write(path, text.encode("utf-8"), mode, private_dir=False)


def setting_name(name: str) -> str:
    """C{BACKEND_URL} or C{LLM_PORT_NODE_AGENT_BACKEND_URL} (any case) -> the variable name."""
    key = name.strip().upper()
    if not key.startswith(PREFIX):
        key = PREFIX + key
    known = {s.env for s in SETTINGS}
    if key not in known:
        raise ConfigError(f"unknown variable {name.strip()!r}; `llmport-agent config` lists them")
    return key


def _is_secret(env_name: str) -> bool:
    return any(s.env == env_name and s.secret for s in SETTINGS)


# -- the system --------------------------------------------------------------------------------


@define
class System:
    """What the installer touches; everything injectable for tests."""

    root: str = ""
    environ: Mapping[str, str] = field(factory=lambda: os.environ)
    geteuid: Callable[[], int] = os.geteuid
    which: Callable[[str], str | None] = shutil.which
    executable: str | None = None
    one_process: bool = True
    #: C{--user}: a C{systemd --user} service of the invoking user, no root (the original's layout).
    user_mode: bool = False
    access: Callable[[str, int], bool] = os.access
    #: Where the running agent's executable is read (C{<proc>/<MainPID>/exe}); tests move it.
    proc: str = "/proc"
    out: IO[str] = field(factory=lambda: sys.stdout)
    err: IO[str] = field(factory=lambda: sys.stderr)

    @classmethod
    def from_environment(cls) -> System:
        return cls(root=os.environ.get("LLMPORT_AGENT_SYSTEM_ROOT", ""))

    def path(self, absolute: str) -> str:
        return os.path.join(self.root, absolute.lstrip("/")) if self.root else absolute

    def place(self, absolute: str) -> str:
        """L{path}, except a user-mode path in the user's home, which is never under C{root}."""
        home = self.environ.get("HOME", "")
        if self.user_mode and home and absolute.startswith(home.rstrip("/") + "/"):
            return absolute
        return self.path(absolute)

    def _xdg(self, var: str, default: str) -> str:
        value = self.environ.get(var, "")
        if value and os.path.isabs(value):
            return value
        return os.path.join(self.environ.get("HOME") or os.path.expanduser("~"), default)

    @property
    def config_home(self) -> str:
        return self._xdg("XDG_CONFIG_HOME", ".config")

    @property
    def data_home(self) -> str:
        """C{~/.local/share/llmport-agent}: the user mode's state and (fallback) model store (L{user_state_dir})."""
        from llmport_agent.core.state import user_state_dir

        return user_state_dir({k: v for k, v in self.environ.items() if k in ("HOME", "XDG_DATA_HOME")})

    @property
    def unit_path(self) -> str:
        if self.user_mode:
            return os.path.join(self.config_home, "systemd", "user", UNIT_NAME)
        return self.path("/etc/systemd/system/" + UNIT_NAME)

    @property
    def env_path(self) -> str:
        if self.user_mode:
            return os.path.join(self.config_home, "llmport-agent", "agent.env")
        return self.path("/etc/llmport-agent.env")

    @property
    def journal_hint(self) -> str:
        return "journalctl --user -u llmport-agent" if self.user_mode else "journalctl -u llmport-agent"

    def user_defaults(self, values: Mapping[str, str]) -> dict[str, str]:
        """
        User mode: the settings whose defaults are root's, where this user can work (only those
        not set already). C{STATE_PATH} under C{~/.local/share/llmport-agent}; C{MODEL_STORE} at
        its default only when this user can write there, else C{~/.local/share/llmport-agent/models};
        C{DOCKER_HOST} at the rootless socket C{$XDG_RUNTIME_DIR/docker.sock} when Docker's own
        socket is not open to this user (the docker group) and the rootless one exists.
        """
        out: dict[str, str] = {}
        if PREFIX + "STATE_PATH" not in values:
            out[PREFIX + "STATE_PATH"] = os.path.join(self.data_home, "state.json")
        if PREFIX + "MODEL_STORE" not in values:
            store = self.path(DEFAULT_MODEL_STORE)
            if not _writable_or_creatable(store, self.access):
                out[PREFIX + "MODEL_STORE"] = os.path.join(self.data_home, "models")
        if "DOCKER_HOST" not in values and "DOCKER_HOST" not in self.environ:
            system_socket = self.path("/var/run/docker.sock")
            runtime = self.environ.get("XDG_RUNTIME_DIR", "")
            rootless = os.path.join(runtime, "docker.sock") if runtime else ""
            if not self.access(system_socket, os.R_OK | os.W_OK) and rootless and os.path.exists(rootless):
                out["DOCKER_HOST"] = "unix://" + rootless
        return out

    def systemd_running(self) -> bool:
        """sd_booted(): PID 1 is systemd when /run/systemd/system is a directory."""
        return os.path.isdir(self.path("/run/systemd/system"))

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def fail(self, text: str, code: int = EX_FAIL) -> int:
        print(f"llmport-agent: {text}", file=self.err, flush=True)
        return code

    def installed_executable(self) -> tuple[str, bool]:
        """(path for ExecStart, whether it is one process): the binary or the console script."""
        if self.executable:
            return self.executable, self.one_process
        if getattr(sys, "frozen", False):
            # PyInstaller one-file: this is the bootloader's path; two processes at run time.
            return os.path.abspath(sys.executable), False
        script = os.path.join(os.path.dirname(sys.executable), "llmport-agent")
        if os.access(script, os.X_OK):
            return script, True
        found = self.which("llmport-agent")
        if found:
            return os.path.abspath(found), True
        raise FileNotFoundError("no llmport-agent executable found next to the Python interpreter or on PATH")


def _writable_or_creatable(path: str, access: Callable[[str, int], bool] = os.access) -> bool:
    """Whether this process can write C{path}, or create it (its nearest existing parent)."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            return False
        p = parent
    return os.path.isdir(p) and access(p, os.W_OK | os.X_OK)


#: Directives a user manager cannot apply (they need privileges or mount namespaces it does not
#: have, so the unit would fail at start with 218/CAPABILITIES or 226/NAMESPACE), or that name
#: root's paths; user mode leaves them out.
ROOT_ONLY_DIRECTIVES = (
    "ExecStartPre=+", "StateDirectory=", "StateDirectoryMode=", "ProtectSystem=", "ReadWritePaths=",
    "ProtectHome=", "PrivateTmp=", "PrivateMounts=", "ProtectKernelTunables=", "ProtectKernelModules=",
    "ProtectKernelLogs=", "ProtectControlGroups=", "ProtectHostname=", "RestrictNamespaces=",
    "CapabilityBoundingSet=", "AmbientCapabilities=", "RemoveIPC=", "KeyringMode=", "User=", "Group=",
    "SupplementaryGroups=", "EnvironmentFile=", "Wants=network-online.target",
)


def render_user_unit(template: str, *, executable: str, one_process: bool, env_path: str) -> str:
    """The unit as C{start --user} installs it: a C{systemd --user} service, root-only lines out."""
    out: list[str] = []
    for line in template.splitlines():
        if line.startswith(ROOT_ONLY_DIRECTIVES):
            continue
        if line.startswith("ExecStart="):
            line = f"ExecStart={_unit_word(executable, 'the executable path', True)} run"
        elif line.startswith("NotifyAccess="):
            line = "NotifyAccess=main" if one_process else "NotifyAccess=all"
        elif line.startswith("After="):
            line = "After=network-online.target"
        elif line.startswith("WantedBy="):
            line = "WantedBy=default.target"
        out.append(line)
        if line.startswith("ExecStart="):
            out.append(f"EnvironmentFile={_unit_word(env_path, 'the env file path')}")
    return "\n".join(out) + "\n"


def unstable_place(path: str) -> str | None:
    real = os.path.realpath(path)
    for prefix in UNSTABLE_PREFIXES:
        if real.startswith(prefix) or path.startswith(prefix):
            return prefix.rstrip("/")
    tmp = os.environ.get("TMPDIR", "")
    if tmp and len(tmp) > 1 and real.startswith(os.path.realpath(tmp).rstrip("/") + "/"):
        return tmp
    return None


def open_to_others(path: str, owners: tuple[int, ...] = (0,)) -> str | None:
    """
    Why C{path} (an executable a unit runs) could be replaced by someone other than C{owners}
    (root; in user mode the user too): the file, or a directory above it, owned by another user,
    or writable by group or others (a directory with the sticky bit excepted: its entries are
    their owners' to replace). Links are followed as the unit's C{ExecStart=} would, and the
    directories of the link itself are looked at too. A component that does not exist yet is
    not judged. C{None}: only C{owners} can change what runs.
    """
    import stat as stat_

    seen: set[str] = set()
    candidates = [os.path.abspath(path), os.path.realpath(path)]
    for start in candidates:
        p = start
        while True:
            if p not in seen:
                seen.add(p)
                try:
                    st = os.lstat(p)
                except OSError:
                    st = None
                if st is not None and not stat_.S_ISLNK(st.st_mode):
                    kind = "directory" if stat_.S_ISDIR(st.st_mode) else "file"
                    if st.st_uid not in owners:
                        return f"the {kind} {p} is owned by uid {st.st_uid}, who can replace what the unit runs"
                    sticky = stat_.S_ISDIR(st.st_mode) and st.st_mode & stat_.S_ISVTX
                    if st.st_mode & (stat_.S_IWGRP | stat_.S_IWOTH) and not sticky:
                        return (f"the {kind} {p} is writable by its group or all users (mode "
                                f"{stat_.S_IMODE(st.st_mode):04o})")
            parent = os.path.dirname(p)
            if parent == p:
                break
            p = parent
    return None


def _code_paths() -> tuple[str, ...]:
    """What a console script runs besides itself: the interpreter and this package (not in a frozen build)."""
    if getattr(sys, "frozen", False):
        return ()
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return (os.path.realpath(sys.executable), package)


def unit_template() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (
        os.path.join(here, "data", UNIT_NAME),
        os.path.join(os.path.dirname(os.path.dirname(here)), "deploy", "systemd", UNIT_NAME),
    ):
        if os.path.exists(candidate):
            with open(candidate, encoding="utf-8") as f:
                return f.read()
    raise FileNotFoundError(UNIT_NAME)


def render_unit(
    template: str,
    *,
    executable: str,
    one_process: bool,
    model_store: str,
    state_dir: str,
    user: str | None = None,
    group: str | None = None,
    supplementary: tuple[str, ...] = (),
) -> str:
    """The unit as C{start} installs it (paths of this host, user, notify access)."""
    out: list[str] = []
    for line in template.splitlines():
        if line.startswith("ExecStart="):
            line = f"ExecStart={_unit_word(executable, 'the executable path', True)} run"
        elif line.startswith("ExecStartPre=+/bin/mkdir -p "):
            line = f"ExecStartPre=+/bin/mkdir -p {_unit_word(model_store, 'MODEL_STORE', True)}"
        elif line.startswith("ReadWritePaths="):
            paths = [model_store]
            if os.path.abspath(state_dir) != DEFAULT_STATE_DIR:
                paths.append(state_dir)
            line = "ReadWritePaths=" + " ".join("-" + _unit_word(p, "STATE_PATH/MODEL_STORE") for p in paths)
        elif line.startswith("NotifyAccess="):
            line = "NotifyAccess=main" if one_process else "NotifyAccess=all"
        out.append(line)
        if line == "[Service]" and user:
            out.append(f"User={user}")
            out.append(f"Group={group or user}")
            if supplementary:
                out.append("SupplementaryGroups=" + " ".join(supplementary))
    return "\n".join(out) + "\n"


class _Undo:
    """What C{start} changed, to put back if a later step fails."""

    def __init__(self) -> None:
        self._steps: list[Callable[[], None]] = []

    def file(self, path: str) -> None:
        try:
            with open(path, "rb") as f:
                old: bytes | None = f.read()
            mode = os.stat(path).st_mode & 0o7777
        except FileNotFoundError:
            old, mode = None, 0

        def restore() -> None:
            if old is None:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            else:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
                with os.fdopen(fd, "wb") as f:
                    f.write(old)
                os.chmod(path, mode)

        self._steps.append(restore)

    def directory(self, path: str) -> None:
        def remove() -> None:
            try:
                os.rmdir(path)
            except OSError:
                pass

        self._steps.append(remove)

    def call(self, fn: Callable[[], Any]) -> None:
        self._steps.append(lambda: fn())

    def run(self) -> None:
        for step in reversed(self._steps):
            try:
                step()
            except Exception:
                pass
        self._steps.clear()


def _makedirs(path: str, undo: _Undo, mode: int, uid: int = -1, gid: int = -1) -> None:
    missing: list[str] = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        os.mkdir(d, mode)
        undo.directory(d)
        if uid >= 0 or gid >= 0:
            # The directory just made, never what a link put in its place since names (a
            # user who can write the parent would get any file of the host chowned to them).
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fchown(fd, uid, gid)
            finally:
                os.close(fd)


# -- the commands --------------------------------------------------------------------------


class Installer:
    def __init__(self, system: System | None = None) -> None:
        self.sys = system or System.from_environment()

    # helpers ------------------------------------------------------------------------------

    def _systemctl(self, *args: str) -> tuple[int, str]:
        exe = self.sys.which("systemctl")
        if exe is None:
            return 127, "systemctl not found"
        # Bounded reads of its output (inventory.tools.run_tool), like every subprocess's.
        from llmport_agent.inventory.tools import run_tool

        scope = ["--user"] if self.sys.user_mode else []
        done = run_tool([exe, *scope, *args], SYSTEMCTL_TIMEOUT, max_output=1 << 20, env=self.sys.environ)
        if done.error:
            return 1, done.error
        text = (done.stderr or done.stdout or "").strip().splitlines()
        # systemd's "Job for ... failed because ..." says what happened; the line after only where to look.
        said = next((line for line in text if line.startswith("Job for ")), text[-1] if text else "")
        return done.returncode, (said or f"exit status {done.returncode}")

    def _needs_systemd(self, what: str) -> str | None:
        if self.sys.which("systemctl") is None or not self.sys.systemd_running():
            return (f"systemd is not running on this host (PID 1 is not systemd), so `{what}` cannot "
                    "manage the agent: run it in the foreground with `llmport-agent run`, or under your "
                    "own supervisor")
        return None

    def preflight(self, what: str) -> str | None:
        """
        What C{start} needs of this host, checked before it (or C{join}, before it files a
        request) changes anything: root (or user mode as a user), systemd as PID 1, an executable
        in a stable place that only root (user mode: root or this user) can change, and the
        configuration and state directories writable. The first problem as one line, or C{None}.
        """
        s = self.sys
        if s.user_mode and s.geteuid() == 0:
            return (f"`{what} --user` installs a service of the user who runs it: run it as that user "
                    f"(not root), or `sudo llmport-agent {what}` for a system service")
        if s.geteuid() != 0 and not s.user_mode:
            return (f"`{what}` installs a systemd unit and needs root: sudo llmport-agent {what} "
                    f"(or `llmport-agent {what} --user` for a service of your own user)")
        problem = self._needs_systemd(what)
        if problem:
            return problem
        try:
            executable, _ = s.installed_executable()
        except FileNotFoundError as e:
            return str(e)
        unstable = unstable_place(executable)
        if unstable:
            return (f"the agent runs from {executable}, under {unstable}, which the unit cannot see "
                    "(PrivateTmp=yes) and which does not survive a reboot: install it to a stable place "
                    "(the binary to /usr/local/bin, a virtualenv or pipx under /opt or /usr/local) and run "
                    f"{what} from there")
        owners = (0, s.geteuid()) if s.user_mode else (0,)
        if s.root:
            # Under $LLMPORT_AGENT_SYSTEM_ROOT (tests): the tree's owner is whoever runs them.
            owners = (*owners, os.geteuid())
        # Judged as it is on this host (under $LLMPORT_AGENT_SYSTEM_ROOT too: a test's stand-in
        # executable that does not exist has only its existing directories judged). What the
        # executable runs is judged too: the interpreter and this package's own directory (a
        # root-owned script importing code from a home directory is that code).
        open_ = None
        for path in (executable, *_code_paths()):
            open_ = open_to_others(path, owners)
            if open_:
                break
        if open_:
            who = "root or you" if s.user_mode else "root"
            return (f"the agent runs from {executable}, but {open_}: a unit would run whatever is put "
                    f"there{'' if s.user_mode else ' as root'}. Install it where only {who} can write "
                    "(the binary to /usr/local/bin, a virtualenv under /opt) or fix the owner and mode "
                    f"(chown root, chmod go-w), then run {what} again")
        for path in (s.env_path, self._state_file_hint()):
            if path and not _writable_or_creatable(os.path.dirname(path), s.access):
                return (f"{os.path.dirname(path)} cannot be written by this user, and `{what}` writes "
                        f"{path} there: fix its owner or mode, or run as root")
        return None

    def _state_file_hint(self) -> str:
        """Where the unit's state will be (its env file's or this shell's STATE_PATH, else the default)."""
        s = self.sys
        try:
            values = self.read_env().values()
        except OSError:
            values = {}
        values = {**values, **{k: v for k, v in s.environ.items() if k.startswith(PREFIX)}}
        configured = values.get(PREFIX + "STATE_PATH")
        if not configured and s.user_mode:
            return os.path.join(s.data_home, "state.json")
        configured = configured or os.path.join(DEFAULT_STATE_DIR, "state.json")
        return s.place(configured) if s.root else configured

    def read_env(self) -> EnvFile:
        try:
            with open(self.sys.env_path, encoding="utf-8") as f:
                return EnvFile.parse(f.read())
        except FileNotFoundError:
            return EnvFile()

    def service_config(self) -> AgentConfig:
        """The configuration the unit runs with: the env file only (no inherited environment)."""
        return load_config(environ=self.read_env().values())

    # start --------------------------------------------------------------------------------

    def start(self, user: str | None = None, drop: tuple[str, ...] = ()) -> int:  # noqa: C901 - one linear procedure
        """
        @param drop: variables to remove from the env file (C{join}: a stale enrollment token).
        """
        s = self.sys
        problem = self.preflight("start")
        if problem:
            return s.fail(problem)
        executable, one_process = s.installed_executable()
        try:
            env = self.read_env()
        except OSError as e:
            return s.fail(f"cannot read {s.env_path} ({e.strerror})")
        configured_url = env.values().get(PREFIX + "BACKEND_URL")
        given = {k: v for k, v in s.environ.items() if k.startswith(PREFIX)}
        for key in given:
            try:
                setting_name(key)
            except ConfigError as e:
                return s.fail(f"{e}", EX_CONFIG)
        for key in drop:
            env.unset(key)
        try:
            for key, value in sorted(given.items()):
                env.set(key, value)
        except ConfigError as e:
            return s.fail(f"configuration error: {e}; nothing was changed", EX_CONFIG)
        values = env.values()
        if s.user_mode and any(k.startswith(PREFIX) for k in values):
            try:
                for key, value in sorted(s.user_defaults(values).items()):
                    env.set(key, value)
                    s.say(f"user mode: {key}={value} (written to {s.env_path})")
            except ConfigError as e:
                return s.fail(f"configuration error: {e}; nothing was changed", EX_CONFIG)
            values = env.values()
        if not any(k.startswith(PREFIX) for k in values):
            return s.fail(
                f"no configuration: neither {s.env_path} nor LLM_PORT_NODE_AGENT_* variables; pass "
                "them, e.g. sudo LLM_PORT_NODE_AGENT_BACKEND_URL=https://llm-port.example "
                "LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN=<token> llmport-agent start",
                EX_CONFIG,
            )
        try:
            config = load_config(environ=values)
        except ConfigError as e:
            return s.fail(f"configuration error: {e}", EX_CONFIG)
        state_path = s.place(config.state_path) if s.root else config.state_path
        if s.user_mode:
            from llmport_agent.core.state import TwoStates, adopt_old_state

            try:
                moved = adopt_old_state(state_path, dict(s.environ), s.geteuid())
            except TwoStates as e:
                return s.fail(str(e))
            if moved:
                s.say(moved)
        if not config.enrollment_token and not _has_credential(state_path):
            return s.fail(
                f"no credential in {config.state_path} and no LLM_PORT_NODE_AGENT_ENROLLMENT_TOKEN: "
                "mint a token (POST /api/admin/system/nodes/enrollment-tokens) and pass it",
                EX_CONFIG,
            )
        stranger = _not_the_issuer(state_path, config.backend_url, configured_url)
        if stranger:
            return s.fail(stranger, EX_CONFIG)
        uid = gid = -1
        supplementary: tuple[str, ...] = ()
        group = None
        if user:
            import grp
            import pwd

            try:
                pw = pwd.getpwnam(user)
            except KeyError:
                return s.fail(f"no user {user!r}: create it first (useradd --system --no-create-home "
                              f"--shell /usr/sbin/nologin {user})")
            uid, gid = pw.pw_uid, pw.pw_gid
            group = grp.getgrgid(gid).gr_name
            wanted = []
            for name in ("docker", "systemd-journal"):
                try:
                    grp.getgrnam(name)
                    wanted.append(name)
                except KeyError:
                    pass
            if "docker" not in wanted:
                return s.fail("there is no docker group on this host: a dedicated user reaches the Docker "
                              "engine through it (install Docker first, or run the agent as root)")
            supplementary = tuple(wanted)
        try:
            text = render_user_unit(
                unit_template(), executable=executable, one_process=one_process, env_path=s.env_path,
            ) if s.user_mode else render_unit(
                unit_template(),
                executable=executable,
                one_process=one_process,
                model_store=config.model_store,
                state_dir=config.state_dir,
                user=user,
                group=group,
                supplementary=supplementary,
            )
        except ConfigError as e:
            return s.fail(f"configuration error: {e}; nothing was changed", EX_CONFIG)
        old_exec = _exec_path(s.unit_path)
        # Under $LLMPORT_AGENT_SYSTEM_ROOT (tests) only an executable inside it is copied or put back.
        ours = not s.root or os.path.realpath(executable).startswith(os.path.realpath(s.root) + os.sep)
        same_path = ours and old_exec is not None and os.path.realpath(old_exec) == os.path.realpath(executable)
        undo = _Undo()
        try:
            for path, content, mode in ((s.env_path, env.text(), 0o600), (s.unit_path, text, 0o644)):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                undo.file(path)
                write_private(path, content, mode)
            _makedirs(s.place(config.model_store), undo, 0o755, uid, gid)
            if config.state_dir != DEFAULT_STATE_DIR or s.user_mode:
                _makedirs(s.place(config.state_dir), undo, 0o700, uid, gid)
        except OSError as e:
            undo.run()
            return s.fail(f"could not write {e.filename or 'a file'} ({e.strerror}); nothing was changed")
        was_enabled = self._systemctl("is-enabled", "--quiet", UNIT_NAME)[0] == 0
        was_active = self._systemctl("is-active", "--quiet", UNIT_NAME)[0] == 0
        # The previous build, when the unit ran the executable at this same path: the upgrade
        # replaced it there, so going back needs a copy (previousbuild).
        previous = PreviousBuild(executable, s.geteuid(), s.proc) if same_path else None
        note = ""
        if previous is not None and was_active:
            try:
                previous.keep_running(self._main_pid())
            except (NotKept, OSError) as e:
                note = f" (the running build could not be kept: {e})"
        # restart, never `enable --now`: that leaves a running old build running (an upgrade
        # replaced the executable and must run the new one).
        for step in (("daemon-reload",), ("enable", "--quiet", UNIT_NAME), ("restart", UNIT_NAME)):
            rc, message = self._systemctl(*step)
            if rc != 0:
                if step[0] == "restart" and not was_enabled:
                    self._systemctl("disable", "--quiet", UNIT_NAME)
                undo.run()
                what = "the unit and configuration were"
                if step[0] == "restart" and previous is not None:
                    what, why = self._put_back(previous, what)
                    note = note or why
                self._systemctl("daemon-reload")
                back = ""
                if step[0] == "restart" and was_active:
                    # The agent ran before: bring it back with its own unit and env file.
                    again = self._systemctl("restart", UNIT_NAME)[0] == 0
                    back = (" and the agent was started again with them" if again else
                            " but the agent could not be started again with them")
                return s.fail(f"systemctl {step[0]} failed ({message}); {what} put back as they were{back}"
                              f"{note}. Why: {s.journal_hint} -n 50; then install a build that starts and "
                              "run start again")
        kept = ""
        if ours and os.path.isfile(executable) and not os.path.islink(executable):
            try:
                PreviousBuild(executable, s.geteuid(), s.proc).keep_current()
            except (NotKept, OSError) as e:
                kept = (f"note: no copy of this build was kept beside it ({e}), so a failed later upgrade "
                        "cannot go back to it")
        linger = ""
        if s.user_mode:
            linger = self._linger()
        who = f"as user {user}" if user else ("as a user service of " + _me()) if s.user_mode else "as root"
        s.say(f"llmport-agent is running under systemd ({who}, executable {executable}).")
        s.say(f"  configuration: {s.env_path} (mode 0600; edit with `llmport-agent config --set NAME=VALUE`)")
        s.say(f"  unit:          {s.unit_path}")
        s.say(f"  state:         {config.state_path}")
        s.say(f"  follow its log: {s.journal_hint} -f")
        s.say("  check it:       llmport-agent status" + (" --user" if s.user_mode else ""))
        if linger:
            s.say(linger)
        if kept:
            s.say(kept)
        return 0

    def _main_pid(self) -> int:
        rc, _ = self._systemctl("is-active", "--quiet", UNIT_NAME)
        if rc != 0:
            return 0
        exe = self.sys.which("systemctl")
        if exe is None:
            return 0
        from llmport_agent.inventory.tools import run_tool

        scope = ["--user"] if self.sys.user_mode else []
        done = run_tool([exe, *scope, "show", UNIT_NAME, "--property=MainPID"], 30, max_output=1 << 16,
                        env=self.sys.environ)
        for line in ("" if done.error else done.stdout).splitlines():
            key, _, value = line.partition("=")
            if key == "MainPID" and value.strip().isdigit():
                return int(value.strip())
        return 0

    def _put_back(self, previous: PreviousBuild, what: str) -> tuple[str, str]:
        """After a failed restart: the kept previous executable back in place (previousbuild)."""
        try:
            if previous.restore():
                return (f"the previous executable (kept as {previous.kept}), the unit and the "
                        "configuration were"), ""
        except (NotKept, OSError) as e:
            return what, f" (the previous executable could not be put back: {e}; the unit runs the new one)"
        return what, ""

    def _linger(self) -> str:
        """C{loginctl enable-linger}: the user manager (and the agent) outlive the last login."""
        me = _me()
        exe = self.sys.which("loginctl")
        if exe is not None:
            from llmport_agent.inventory.tools import run_tool

            done = run_tool([exe, "enable-linger", me], 60, max_output=1 << 16, env=self.sys.environ)
            if not done.error and done.returncode == 0:
                return ""
        return (f"note: linger could not be enabled for {me}, so the agent stops when your last session "
                f"ends: an administrator can enable it once with `sudo loginctl enable-linger {me}`")

    # stop ---------------------------------------------------------------------------------

    def stop(self) -> int:
        s = self.sys
        if s.geteuid() != 0 and not s.user_mode:
            return s.fail("`stop` changes a systemd unit and needs root: sudo llmport-agent stop "
                          "(`llmport-agent stop --user` for a service of your own user)")
        problem = self._needs_systemd("stop")
        if problem:
            return s.fail(problem)
        if not os.path.exists(s.unit_path):
            s.say(f"llmport-agent is not installed as a systemd unit ({s.unit_path} is absent); nothing to stop")
            return 0
        rc, message = self._systemctl("disable", "--now", "--quiet", UNIT_NAME)
        if rc != 0:
            return s.fail(f"systemctl disable --now failed ({message})")
        again = "llmport-agent start --user" if s.user_mode else "sudo llmport-agent start"
        s.say("llmport-agent stopped and disabled (running commands were given their grace period); "
              f"{s.unit_path}, {s.env_path} and the state are kept: `{again}` starts it again")
        return 0

    # status -------------------------------------------------------------------------------

    def status(self, environ_config: AgentConfig | None = None) -> int:
        s = self.sys
        active: bool | None = None
        if self.sys.which("systemctl") is not None and s.systemd_running():
            props = self._show()
            if not props or props.get("LoadState") == "not-found":
                how = "llmport-agent start --user" if s.user_mode else "sudo llmport-agent start"
                s.say(f"service:    not installed ({how} installs it)")
                active = False
            else:
                active = props.get("ActiveState") == "active"
                since = props.get("ActiveEnterTimestamp") or "-"
                s.say(f"service:    {props.get('ActiveState', '?')} ({props.get('SubState', '?')}) since {since}, "
                      f"{props.get('UnitFileState', '?')}, main pid {props.get('MainPID', '0')}, "
                      f"restarts {props.get('NRestarts', '0')}, last exit status {props.get('ExecMainStatus', '0')}")
                if props.get("StatusText"):
                    from llmport_agent.core.cleantext import shown as shown_text

                    s.say(f"its status: {shown_text(props['StatusText'], 400)}")
        else:
            s.say("service:    systemd is not running on this host (no unit to inspect)")
        try:
            config = self.service_config() if os.path.exists(s.env_path) else environ_config or load_config()
        except PermissionError:
            s.say(f"config:     {s.env_path} is readable by root only; using this shell's settings (sudo shows the unit's)")
            config = environ_config or load_config(environ=s.environ)
        except (ConfigError, OSError) as e:
            s.say(f"config:     cannot be read ({e})")
            return EX_FAIL
        from llmport_agent.core.cleantext import shown

        def w(value: object) -> str:
            return shown(str(value), 200)

        # Whatever answers on that loopback port is believed only when it is the agent: the
        # holder of the state's instance lock owns the listening socket (opsprobe); a redirect
        # is never followed. Every value shown bounded and without control characters.
        body = None
        squatted = False
        if config.ops_port:
            from llmport_agent.ops.probe import probe

            state_path = s.path(config.state_path) if s.root else config.state_path
            answer = probe(config.ops_port, state_path)
            if answer.trusted or answer.unverifiable:
                body = answer.body
                if answer.unverifiable and answer.body is not None:
                    s.say(f"note:       unverified answer on 127.0.0.1:{config.ops_port}: {w(answer.note)}")
            elif answer.answered:
                squatted = True
                s.say(f"agent:      something that is not the agent answers on 127.0.0.1:{config.ops_port} "
                      f"({w(answer.note)}); its answer is ignored: find it with `ss -ltnp 'sport = :"
                      f"{config.ops_port}'`")
        if body is not None:

            agent = body.get("agent")
            agent = agent if isinstance(agent, dict) else {}
            s.say(f"agent:      {w(body.get('status'))} (version {w(agent.get('version', '?'))}), node id "
                  f"{w(agent.get('node_id') or '-')}, heartbeat status {w(agent.get('heartbeat_status', '?'))}")
            last = agent.get("last_heartbeat_at")
            if isinstance(last, int | float):
                import time

                s.say(f"heartbeat:  last sent {max(0.0, time.time() - last):.0f} s ago")
            s.say(f"workloads:  {w(agent.get('workloads', 0))}, commands running: {w(agent.get('commands_running', 0))}")
            checks = body.get("checks")
            for name, check in sorted((checks if isinstance(checks, dict) else {}).items())[:32]:
                check = check if isinstance(check, dict) else {}
                mark = "ok " if check.get("ok") else "BAD"
                s.say(f"  {mark} {w(name):<8} {w(check.get('detail', ''))}")
            if active is None:
                active = True
            ready = bool(body.get("ready"))
        else:
            ready = False
            if config.ops_port and not squatted:
                s.say(f"agent:      not answering on http://127.0.0.1:{config.ops_port}/readyz")
            self._state_view(config)
        if not active:
            return EX_NOT_RUNNING
        return 0 if ready else EX_FAIL

    def _show(self) -> dict[str, str]:
        props = "LoadState,ActiveState,SubState,UnitFileState,MainPID,NRestarts,ExecMainStatus,ActiveEnterTimestamp,StatusText"
        exe = self.sys.which("systemctl")
        if exe is None:
            return {}
        from llmport_agent.inventory.tools import run_tool

        scope = ["--user"] if self.sys.user_mode else []
        done = run_tool([exe, *scope, "show", UNIT_NAME, "--property=" + props], 30, max_output=1 << 20,
                        env=self.sys.environ)
        if done.error:
            return {}
        out: dict[str, str] = {}
        for line in done.stdout.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                out[key] = value
        return out

    def _state_view(self, config: AgentConfig) -> None:
        from llmport_agent.core.state import load_state

        path = self.sys.path(config.state_path) if self.sys.root else config.state_path
        try:
            result = load_state(path) if os.path.exists(path) else None
        except Exception as e:
            self.sys.say(f"state file: {path} cannot be read ({e})")
            return
        from llmport_agent.core.cleantext import shown

        data = result.data if result else {}
        # The node id came from the backend: shown bounded and cleaned (an old state may hold anything).
        self.sys.say(f"state file: {path} ({'present' if result else 'absent'}), enrolled: "
                     f"{'yes' if data.get('credential') else 'no'}, node id {shown(data.get('node_id', '-'), 200)}, "
                     f"{'in' if data.get('maintenance') else 'not in'} maintenance mode, "
                     f"{'draining' if data.get('draining') else 'not draining'}")

    # config --set / --unset ---------------------------------------------------------------

    def edit_config(self, sets: list[str], unsets: list[str]) -> int:
        s = self.sys
        try:
            env = self.read_env()
        except OSError as e:
            return s.fail(f"cannot read {s.env_path} ({e.strerror}): run as root (sudo)")
        before = env.values()
        changes: list[tuple[str, str | None]] = []
        try:
            for item in sets:
                name, sep, value = item.partition("=")
                if not sep:
                    return s.fail(f"--set {item!r}: expected NAME=VALUE", EX_CONFIG)
                key = setting_name(name)
                env.set(key, value)
                changes.append((key, value))
            for name in unsets:
                key = setting_name(name)
                env.unset(key)
                changes.append((key, None))
            # Validated exactly as at start-up, with what the unit will see: the file alone.
            new_config = load_config(environ=env.values())
        except ConfigError as e:
            return s.fail(f"configuration error: {e}; {s.env_path} was not changed", EX_CONFIG)
        after = env.values()
        if after == before:
            s.say(f"{s.env_path}: unchanged; no restart needed")
            return 0
        url_key = PREFIX + "BACKEND_URL"
        if after.get(url_key) != before.get(url_key):
            # Never a silent switch: the agent would refuse to start with it (the credential goes
            # only to the backend that issued it).
            state_path = s.place(new_config.state_path) if s.root else new_config.state_path
            stranger = _not_the_issuer(state_path, new_config.backend_url, before.get(url_key))
            if stranger:
                return s.fail(stranger.replace("nothing was changed", f"{s.env_path} was not changed"), EX_CONFIG)
        try:
            os.makedirs(os.path.dirname(s.env_path), exist_ok=True)
            write_private(s.env_path, env.text(), 0o600)
        except OSError as e:
            return s.fail(f"cannot write {s.env_path} ({e.strerror}): run as root (sudo)")
        for key, new in changes:
            if new is None:
                s.say(f"{key} removed from {s.env_path}")
            else:
                # A URL's user info (Loki's basic auth) is a secret too.
                shown = mask(new) if _is_secret(key) else mask_url(new) if "://" in new else new
                s.say(f"{key}={shown} written to {s.env_path}")
        changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
        paths = {PREFIX + name for name in UNIT_PATH_SETTINGS} & changed
        installed = os.path.exists(s.unit_path)
        if paths and installed:
            s.say("restart needed, and the unit's writable paths change: sudo llmport-agent start")
        elif installed and self._systemctl("is-active", "--quiet", UNIT_NAME)[0] == 0:
            s.say("restart needed: sudo systemctl restart llmport-agent")
        else:
            s.say("takes effect at the next start of the agent")
        return 0


def _me() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def _exec_path(unit_path: str) -> str | None:
    """The program of an installed unit's C{ExecStart=} (C{None}: no unit, or none readable)."""
    import shlex

    try:
        with open(unit_path, encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 20)
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("ExecStart="):
            try:
                words = shlex.split(line[len("ExecStart="):].lstrip("@-:+!"))
            except ValueError:
                return None
            return words[0].replace("$$", "$").replace("%%", "%") if words else None
    return None


def _not_the_issuer(state_path: str, url: str, configured_url: str | None) -> str | None:
    """
    Why the unit must not run with C{url}: the state's credential was issued by another backend
    (the one recorded in the state file; for a state from before that record, the env file's
    C{BACKEND_URL}), and the agent would present it there. C{None}: no credential, or C{url} is
    its issuer.
    """
    from llmport_agent.host.join import credential_issuer, same_backend

    try:
        with open(state_path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not data.get("credential"):
        return None
    issuer = credential_issuer(data, configured_url)
    if issuer is None or same_backend(issuer, url):
        return None
    return (f"BACKEND_URL {mask_url(url)} is not the backend that issued this node's credential "
            f"({mask_url(issuer)}), and the agent would present it there: nothing was changed. To move this "
            f"node to {mask_url(url)}, join it (`llmport-agent join {mask_url(url)}`: a new join an administrator "
            "there approves); else set BACKEND_URL back")


def _has_credential(state_path: str) -> bool:
    try:
        with open(state_path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and bool(data.get("credential"))
