"""A plain `make serve` by a fresh non-root user on a machine without libzmq's headers, checked end to end.

Run as root (`make test-nonroot`): a throwaway login account gets a fresh clone of this checkout's HEAD in its home
and runs `make serve` from a login shell — no variables set by hand, so the Makefile skips apt (not root) and
setup.py links the libzmq pyzmq's wheel bundles (no header). The headers are hidden, not uninstalled: the user's
commands run in a private mount namespace where each libzmq development file is whited out by an overlay. Once the
server says it is listening, one completion must come back 200 with text; the server is stopped with SIGINT. The
last line of output is one JSON object: timings, the libzmq the built extension links, and the result.

Everything is undone on every exit path: the user's processes live in their own PID namespace (killed with it),
the mounts die with the namespace, and the account is removed with its home. Without root the check is skipped
(exit 0). The index configuration root's pip uses from its own home or environment (find-links, extra indexes)
is written into the throwaway user's pip.conf, as that user would have it on such a machine.
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import ctypes
import json
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVE_COMMAND = "make serve SERVE_ARGS='--port 0'"  # port 0: the server reports the port it was given
LISTENING = re.compile(r"amoe serve: listening on (http://\S+)$")
MAKEFILE_NO_APT = "[install] going on without the optional system packages"  # a non-root user's install
SERVE_STARTED = re.compile(r"^\S*bin/amoe serve\b")  # make echoes the serve recipe once `install` is done
# What setup.py looks for (the header) and what a build could otherwise find libzmq's development files by.
ZMQ_DEV_FILES = (
    "/usr/include/zmq.h",
    "/usr/include/zmq_utils.h",
    "/usr/local/include/zmq.h",
    "/usr/local/include/zmq_utils.h",
)
_DEV_PACKAGE = "libzmq3-dev"
DPKG_STATUS = "/var/lib/dpkg/status"
_PR_SET_PDEATHSIG = 1
_STOP_TIMEOUT_S = 120.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="for build + start-up (default 3600)")
    parser.add_argument(
        "--request-timeout-s", type=float, default=300.0, help="for the completion (default 300)"
    )
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("skipped: needs root (it creates and removes a throwaway user)")
        print(json.dumps({"check": "nonroot_serve", "result": "skipped", "reason": "needs root"}))
        return 0
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)  # raised where the check is, so every cleanup below still runs
    report = {"check": "nonroot_serve", "result": "fail", "command": SERVE_COMMAND}
    try:
        with contextlib.ExitStack() as stack:
            _check(stack, args, report)
    except (Exception, KeyboardInterrupt, Interrupted) as exc:  # reported in the JSON line, after the cleanup
        report["reason"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(report), flush=True)
    return 0 if report["result"] == "pass" else 1


class Interrupted(BaseException):
    """SIGTERM or SIGHUP arrived: like KeyboardInterrupt, not caught by the check's own error handling."""


def _interrupt(sig: int, frame) -> None:
    raise Interrupted(signal.Signals(sig).name)


def _check(stack: contextlib.ExitStack, args: argparse.Namespace, report: dict) -> None:
    user = stack.enter_context(ThrowawayUser())
    report["user"] = user.name
    report["commit"] = clone_head(REPO, user.home / "amoe", user.name)
    report["pip_config"] = carry_pip_config(user)
    hiding = plan_hiding()
    report["hidden"] = hiding.files
    report["dpkg_entry_hidden"] = hiding.dpkg_status is not None
    serve = stack.enter_context(ServeRun(user, hiding, args.timeout_s))
    serve.wait_for(serve.started)
    report["install_s"] = round(serve.started_at - serve.t0, 1)
    serve.wait_for(serve.listening)
    report["to_listening_s"] = round(serve.listening_at - serve.started_at, 1)
    report["total_to_listening_s"] = round(serve.listening_at - serve.t0, 1)
    report.update(linked_libzmq(user.home / "amoe"))
    status, text = complete(serve.url, args.request_timeout_s)
    report["completion"] = {"status": status, "text_chars": len(text)}
    report["stop"] = serve.stop()
    report["makefile_said"] = serve.makefile_said
    problems = _problems(report, status, text)
    report["result"] = "fail" if problems else "pass"
    if problems:
        report["reason"] = "; ".join(problems)


def _problems(report: dict, status: int, text: str) -> list[str]:
    problems = []
    if status != 200 or not text:
        problems.append(f"completion answered {status} with {len(text)} characters of text")
    if report.get("libzmq") != "pyzmq":
        problems.append(f"the extension links {report.get('libzmq_path')}, not pyzmq's libzmq")
    if report["makefile_said"] is None:
        problems.append("the Makefile did not say it goes on without libzmq3-dev")
    if report["stop"]["exit_code"] != 0:
        problems.append(f"`make serve` exited {report['stop']['exit_code']} on SIGINT")
    return problems


class ThrowawayUser:
    """A fresh login account for one run; leaving the block ends its processes and removes it with its home."""

    def __init__(self) -> None:
        self.name = f"amoe-nonroot-{secrets.token_hex(4)}"
        self.uid: int | None = None
        self.home = Path("/nonexistent")

    def __enter__(self) -> ThrowawayUser:
        if _user_exists(self.name):
            raise RuntimeError(f"user {self.name} exists already")
        try:
            _run(["useradd", "--create-home", "--shell", "/bin/bash", self.name])
            entry = pwd.getpwnam(self.name)
        except BaseException:
            self.__exit__()
            raise
        self.uid, self.home = entry.pw_uid, Path(entry.pw_dir)
        return self

    def __exit__(self, *exc: object) -> None:
        if not _user_exists(self.name):  # useradd failed: nothing of ours to remove
            return
        kill_processes_of(pwd.getpwnam(self.name).pw_uid)
        subprocess.run(["userdel", "--remove", self.name], capture_output=True)
        if _user_exists(self.name):
            raise RuntimeError(f"could not remove user {self.name}")


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def kill_processes_of(uid: int, timeout_s: float = 30.0) -> None:
    """SIGKILL, by pid, every process whose real uid is `uid` (only the throwaway user's) until none is left."""
    deadline = time.monotonic() + timeout_s
    while pids := _pids_of(uid):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of uid {uid} survive SIGKILL: {pids}")
        time.sleep(0.2)


def _pids_of(uid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("Uid:") and int(line.split()[1]) == uid:
                    pids.append(int(entry.name))
    return pids


def clone_head(repo: Path, dest: Path, owner: str) -> str:
    """A fresh clone of `repo`'s checked-out commit (even a detached one) at `dest`, owned by `owner`."""
    sha = _run(["git", "-C", str(repo), "rev-parse", "HEAD"]).strip()
    # Over file://, git's upload-pack serves this worktree's own HEAD and copies objects instead of hard-linking.
    _run(["git", "clone", "-q", f"file://{repo}", str(dest)])
    cloned = _run(["git", "-C", str(dest), "rev-parse", "HEAD"]).strip()
    if cloned != sha:
        _run(["git", "-C", str(dest), "checkout", "-q", "--detach", sha])
    _run(["chown", "-R", f"{owner}:", str(dest)])
    return sha


def carry_pip_config(user: ThrowawayUser) -> list[str]:
    """Write root's user-level pip settings (its pip.conf files, then PIP_* variables) as the user's pip.conf."""
    config = configparser.ConfigParser(interpolation=None)
    home = Path.home()
    files = [
        home / ".pip" / "pip.conf",
        Path(os.environ.get("XDG_CONFIG_HOME", home / ".config")) / "pip/pip.conf",
    ]
    if os.environ.get("PIP_CONFIG_FILE"):
        files.append(Path(os.environ["PIP_CONFIG_FILE"]))
    config.read([f for f in files if f.is_file()])
    for name, value in sorted(os.environ.items()):
        if name.startswith("PIP_") and name != "PIP_CONFIG_FILE":
            if not config.has_section("global"):
                config.add_section("global")
            config.set("global", name[4:].lower().replace("_", "-"), value)
    carried = [f"{section}.{key}" for section in config.sections() for key in config[section]]
    if carried:
        target = user.home / ".config" / "pip" / "pip.conf"
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("w") as f:
            config.write(f)
        _run(["chown", "-R", f"{user.name}:", str(user.home / ".config")])
    return carried


@dataclass
class Hiding:
    """What the user's namespace hides of libzmq's development package, so that neither the build nor the
    Makefile's dpkg check can tell it is installed."""

    files: list[str]  # whited out
    dpkg_status: str | None  # dpkg's database without the package (None: it is not installed)


def plan_hiding() -> Hiding:
    """libzmq's development files present here — the headers setup.py looks for and, when the Debian package is
    installed, its files under /usr/include and /usr/lib (the .so link, the static library, the pkg-config file) —
    and dpkg's entry for it."""
    candidates = set(ZMQ_DEV_FILES)
    listed = subprocess.run(["dpkg", "-L", _DEV_PACKAGE], capture_output=True, text=True)
    if listed.returncode == 0:
        candidates.update(p for p in listed.stdout.split() if p.startswith(("/usr/include/", "/usr/lib/")))
    files = sorted(p for p in candidates if os.path.lexists(p) and not os.path.isdir(p))
    status = Path(DPKG_STATUS).read_text() if Path(DPKG_STATUS).is_file() else ""
    return Hiding(files, status_without(status, _DEV_PACKAGE))


def status_without(status: str, package: str) -> str | None:
    """dpkg's status file without `package`'s paragraphs; None when it has none."""
    paragraphs = status.split("\n\n")
    kept = [p for p in paragraphs if p.lstrip("\n").split("\n", 1)[0] != f"Package: {package}"]
    return None if len(kept) == len(paragraphs) else "\n\n".join(kept).rstrip("\n") + "\n"


def namespace_script(user: str, files: list[str], scratch: str, dpkg_status: str | None = None) -> str:
    """The shell that runs as root inside the new mount namespace: one overlay per directory holding hidden files,
    each file whited out (a 0/0 character device in the upper layer), dpkg's status file replaced by `dpkg_status`
    (a path), a check that none of it shows any more, then the user's login shell running the plain `make serve`
    in the fresh clone."""
    q = shlex.quote
    layers = f"{scratch}/layers"
    lines = ["set -e", f"mkdir {q(layers)}", f"mount -t tmpfs amoe-hide {q(layers)}"]
    for i, directory in enumerate(sorted({os.path.dirname(p) for p in files})):
        upper, work = f"{layers}/upper{i}", f"{layers}/work{i}"
        names = [os.path.basename(p) for p in files if os.path.dirname(p) == directory]
        lines.append(f"mkdir {q(upper)} {q(work)}")
        lines += [f"mknod {q(os.path.join(upper, name))} c 0 0" for name in names]
        options = f"lowerdir={directory},upperdir={upper},workdir={work}"
        lines.append(f"mount -t overlay overlay -o {q(options)} {q(directory)}")
    lines += [f"[ ! -e {q(p)} ] || {{ echo still visible: {q(p)}; exit 97; }}" for p in files]
    if dpkg_status is not None:
        lines.append(f"mount --bind {q(dpkg_status)} {DPKG_STATUS}")
        lines.append(
            f"! dpkg -s {_DEV_PACKAGE} >/dev/null 2>&1 || {{ echo dpkg still lists {_DEV_PACKAGE}; exit 97; }}"
        )
    lines.append(f"exec runuser -l {q(user)} -c {q('cd ~/amoe && exec ' + SERVE_COMMAND)}")
    return "\n".join(lines)


class ServeRun:
    """The user's `make serve` in its own mount and PID namespaces, its output echoed and watched for markers."""

    def __init__(self, user: ThrowawayUser, hiding: Hiding, timeout_s: float) -> None:
        self.user, self.hiding, self.timeout_s = user, hiding, timeout_s
        self.started, self.listening = threading.Event(), threading.Event()
        self.started_at = self.listening_at = 0.0
        self.url = ""
        self.makefile_said: str | None = None
        self.lines: list[str] = []

    def __enter__(self) -> ServeRun:
        self.scratch = Path(f"/tmp/{self.user.name}-hide")  # root's only: mode 0700
        self.scratch.mkdir(mode=0o700)
        try:
            return self._start()
        except BaseException:
            shutil.rmtree(self.scratch)
            raise

    def _start(self) -> ServeRun:
        status = None
        if self.hiding.dpkg_status is not None:
            status = self.scratch / "dpkg-status"
            status.write_text(self.hiding.dpkg_status)
            status.chmod(0o644)
        script = namespace_script(
            self.user.name, self.hiding.files, str(self.scratch), status and str(status)
        )
        # --kill-child: unshare's death kills the namespace's first process, and with it every process inside.
        cmd = ["unshare", "--mount", "--propagation", "private", "--pid", "--kill-child", "--mount-proc"]
        cmd += ["sh", "-c", script]
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            print(f"[{self.user.name}] {line}", file=sys.stderr, flush=True)
            if self.makefile_said is None and MAKEFILE_NO_APT in line:
                self.makefile_said = line
            if not self.started.is_set() and SERVE_STARTED.search(line):
                self.started_at = time.monotonic()
                self.started.set()
            elif not self.listening.is_set() and (match := LISTENING.search(line)):
                self.url, self.listening_at = match.group(1), time.monotonic()
                self.listening.set()

    def wait_for(self, event: threading.Event) -> None:
        """Until `event` is seen; raises if the run ends or the timeout passes first."""
        deadline = self.t0 + self.timeout_s
        while not event.wait(0.5):
            if self.proc.poll() is not None:
                self.reader.join(5)
                raise RuntimeError(f"`{SERVE_COMMAND}` ended ({self.proc.returncode}): {self._tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"not listening within {self.timeout_s:.0f} s: {self._tail()}")

    def _tail(self) -> str:
        return " | ".join(self.lines[-15:])

    def stop(self) -> dict:
        """SIGINT to the `amoe serve` process, as Ctrl-C would: it drains, stops its runtimes and exits 0."""
        server = _serve_pid(self.user.uid)
        if server is None:
            raise RuntimeError("no `amoe serve` process found to stop")
        t = time.monotonic()
        os.kill(server, signal.SIGINT)
        try:
            code = self.proc.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        return {"exit_code": code, "stop_s": round(time.monotonic() - t, 1)}

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # unshare: its --kill-child takes the whole namespace down
        self.proc.wait()
        self.reader.join(10)
        shutil.rmtree(self.scratch)  # the tmpfs on its layers/ was the namespace's own and went with it


def _die_with_parent() -> None:
    """In unshare before exec: SIGKILL when this script dies, even by SIGKILL, so the namespace never outlives it."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _serve_pid(uid: int | None) -> int | None:
    for pid in _pids_of(uid) if uid is not None else []:
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"serve" in argv and any(a.endswith(b"/bin/amoe") for a in argv):
                return pid
    return None


def linked_libzmq(clone: Path) -> dict:
    """Which libzmq the built extension loads, from `ldd`: pyzmq's bundled copy or the system's."""
    built = sorted(clone.glob("amoe/_core*.so"))
    if not built:
        raise RuntimeError(f"no built extension under {clone}/amoe")
    ldd = _run(["ldd", str(built[0])])
    found = [line.split("=>")[1].split("(")[0].strip() for line in ldd.splitlines() if "libzmq" in line]
    if not found:
        return {"libzmq": None, "libzmq_path": None}
    return {"libzmq": "pyzmq" if "pyzmq.libs" in found[0] else "system", "libzmq_path": found[0]}


def complete(url: str, timeout_s: float) -> tuple[int, str]:
    """One completion from the server's own model: the status and the generated text."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=timeout_s) as resp:
        model = json.load(resp)["data"][0]["id"]
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 16, "ignore_eos": True}
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status, json.load(resp)["choices"][0]["text"]
    except urllib.error.HTTPError as err:
        return err.code, ""


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd[:3])} ... failed ({done.returncode}): {done.stderr.strip()[-500:]}"
        )
    return done.stdout


if __name__ == "__main__":
    sys.exit(main())
