"""The pieces of tools/nonroot_serve.py (`make test-nonroot`) that run without building anything: the whiteout
namespace, the pip settings handed to the throwaway user, the ldd reading, the skip without root."""

from __future__ import annotations

import configparser
import importlib.util
import json
import os
import pwd
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent


def _load_tool():
    spec = importlib.util.spec_from_file_location("nonroot_serve", REPO / "tools" / "nonroot_serve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


def test_without_root_it_says_skipped_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert tool.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("skipped: needs root")
    assert json.loads(out[-1])["result"] == "skipped"


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="mounts need root and unshare"
)
@pytest.mark.timeout(60)
def test_the_namespace_hides_each_file_and_the_dpkg_entry_only_inside(tmp_path):
    include = tmp_path / "include"
    include.mkdir()
    for name in ("zmq.h", "zmq_utils.h", "zmq.hpp"):
        (include / name).write_text("/* header */\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    status = scratch / "dpkg-status"
    status.write_text("Package: not-libzmq\nStatus: install ok installed\n")
    hidden = [str(include / "zmq.h"), str(include / "zmq_utils.h")]
    script = tool.namespace_script("nobody", hidden, str(scratch), str(status))
    # The same set-up, then a look around instead of the user's login shell.
    script = script.rsplit("\n", 1)[0] + f"\nls {include}\ncat {tool.DPKG_STATUS}"
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
    inside = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert inside.returncode == 0, inside.stdout + inside.stderr
    assert inside.stdout.splitlines() == ["zmq.hpp", "Package: not-libzmq", "Status: install ok installed"]
    assert sorted(os.listdir(include)) == ["zmq.h", "zmq.hpp", "zmq_utils.h"]  # outside: untouched
    assert Path(tool.DPKG_STATUS).read_text() != status.read_text()
    assert os.listdir(scratch / "layers") == []  # the tmpfs with the whiteouts was the namespace's own


def test_the_dpkg_status_loses_every_paragraph_of_the_package_and_nothing_else():
    status = (
        "Package: libzmq3-dev\nStatus: install ok installed\nArchitecture: amd64\n\n"
        "Package: libzmq5\nStatus: install ok installed\n\n"
        "Package: libzmq3-dev\nArchitecture: i386\n\n"
        "Package: libzmq3-dev-extra\nDepends: libzmq3-dev\n"
    )
    assert tool.status_without(status, "libzmq3-dev") == (
        "Package: libzmq5\nStatus: install ok installed\n\nPackage: libzmq3-dev-extra\nDepends: libzmq3-dev\n"
    )
    assert tool.status_without(status, "prometheus") is None


def test_the_user_runs_a_plain_make_serve_from_a_login_shell():
    last = shlex.split(tool.namespace_script("someone", [], "/scratch").splitlines()[-1])
    assert last[:5] == [
        "exec",
        "runuser",
        "-l",
        "someone",
        "-c",
    ]  # -l: a fresh login environment, nothing carried
    # Only a make variable for a free port: no environment variable is set for the build.
    assert shlex.split(last[5]) == ["cd", "~/amoe", "&&", "exec", "make", "serve", "SERVE_ARGS=--port 0"]


def test_root_pip_settings_become_the_users_pip_conf_with_the_environment_winning(tmp_path, monkeypatch):
    root_home = tmp_path / "root"
    (root_home / ".config" / "pip").mkdir(parents=True)
    (root_home / ".config" / "pip" / "pip.conf").write_text(
        "[global]\nfind-links = /from/file\nextra-index-url = file:///index\n[install]\nno-compile = yes\n"
    )
    for name in [n for n in os.environ if n.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(root_home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("PIP_FIND_LINKS", "/from/env")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "180")
    user = SimpleNamespace(name=pwd.getpwuid(os.getuid()).pw_name, home=tmp_path / "user")
    user.home.mkdir()
    carried = tool.carry_pip_config(user)
    written = configparser.ConfigParser(interpolation=None)
    written.read(user.home / ".config" / "pip" / "pip.conf")
    assert written["global"]["find-links"] == "/from/env"
    assert written["global"]["extra-index-url"] == "file:///index"
    assert written["global"]["default-timeout"] == "180"
    assert written["install"]["no-compile"] == "yes"
    assert sorted(carried) == sorted(f"{s}.{k}" for s in written.sections() for k in written[s])


@pytest.mark.timeout(120)
def test_ldd_names_the_libzmq_a_process_loads_with_the_extension():
    probe = (
        "import torch, amoe, amoe._core, pathlib\n"  # the extension needs torch's libraries loaded first
        "print(pathlib.Path(amoe.__file__).resolve().parent.parent)\n"
        "print(*sorted({line.split()[-1] for line in open('/proc/self/maps') if 'libzmq' in line}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=100, check=True
    )
    checkout, loaded = out.stdout.splitlines()
    found = tool.linked_libzmq(Path(checkout))
    assert found["libzmq"] in ("pyzmq", "system")
    assert loaded.split() == [os.path.realpath(found["libzmq_path"])]
