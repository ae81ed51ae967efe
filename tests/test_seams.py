"""The typed seams are kept by every implementation, checked from the classes themselves (no process started): the
control plane's `Runtime` by the AEP and the synchronous runtime, the cluster manager's `Launcher` by the local,
node-agent and Ray launchers."""

from __future__ import annotations

import ast
import inspect
import textwrap
import typing

import pytest

from amoe.runtime.aep_runtime import AepRuntime
from amoe.runtime.interface import Runtime
from amoe.runtime.sync_runtime import SyncRuntime
from coordinator.cluster.agent_launcher import AgentLauncher
from coordinator.cluster.launcher import Launcher
from coordinator.cluster.local_launcher import LocalLauncher
from coordinator.cluster.ray_launcher import RayLauncher


def attributes(cls: type) -> set[str]:
    """Every attribute an instance of `cls` has: its classes' own names and annotations, and what their methods
    assign to `self`."""
    names: set[str] = set()
    for klass in cls.__mro__[:-1]:
        names |= set(vars(klass)) | set(vars(klass).get("__annotations__", {}))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # defined without a source file
            continue
        for node in ast.walk(tree):
            is_store = isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            if is_store and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return names


def _shape(function: typing.Callable) -> list[tuple[str, typing.Any, bool]]:
    """Parameter names, kinds and whether each has a default: what a caller relies on."""
    return [
        (p.name, p.kind, p.default is not p.empty) for p in inspect.signature(function).parameters.values()
    ]


def protocol_gaps(cls: type, protocol: type) -> list[str]:
    """What `cls` lacks of `protocol`: attributes, properties, and methods with the protocol's parameters (and
    async where the protocol's is)."""
    have = attributes(cls)
    gaps = [f"attribute {name!r}" for name in vars(protocol).get("__annotations__", {}) if name not in have]
    for name, member in vars(protocol).items():
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            gaps += [] if name in have else [f"property {name!r}"]
            continue
        found = inspect.getattr_static(cls, name, None)
        if not callable(member):
            continue
        if not callable(found):
            gaps.append(f"method {name}()")
        elif inspect.iscoroutinefunction(member) != inspect.iscoroutinefunction(found):
            gaps.append(f"method {name}() {'is not' if inspect.iscoroutinefunction(member) else 'is'} async")
        elif _shape(found) != _shape(member):
            gaps.append(f"method {name}{inspect.signature(found)}, not {name}{inspect.signature(member)}")
    return gaps


def resolves(cls: type) -> None:
    """Every annotation of `cls`'s methods names something its module imports (get_type_hints raises if not)."""
    for member in vars(cls).values():
        function = member.fget if isinstance(member, property) else member
        if inspect.isfunction(function):
            typing.get_type_hints(function)


@pytest.mark.parametrize("runtime", [AepRuntime, SyncRuntime])
def test_every_runtime_offers_what_the_control_plane_asks(runtime):
    assert protocol_gaps(runtime, Runtime) == []
    resolves(runtime)


def test_a_runtime_without_one_of_the_control_planes_methods_is_found_out():
    class Unlinked(AepRuntime):
        linked = None  # what serve_commands polls before it says Ready

    class Mute(SyncRuntime):
        def stats(self, verbose):  # a heartbeat asks for stats() with no argument
            return {}

    assert protocol_gaps(Unlinked, Runtime) == ["method linked()"]
    assert [gap.split(",")[0] for gap in protocol_gaps(Mute, Runtime)] == ["method stats(self"]


@pytest.mark.parametrize("launcher", [LocalLauncher, AgentLauncher, RayLauncher])
def test_every_launcher_is_a_complete_launcher(launcher):
    assert protocol_gaps(launcher, Launcher) == []
    resolves(launcher)


def test_the_protocol_check_finds_what_a_class_lacks():
    class Partial:
        secure = False

        async def open(self, roles):
            pass

        def spawn(self, runtime, role):  # no generation
            pass

        async def tick(self, now):
            pass

    gaps = protocol_gaps(Partial, Launcher)
    assert any(gap.startswith("method spawn(self, runtime, role),") for gap in gaps)
    assert "method tick() is async" in gaps
    assert {"method missing_nodes()", "method handle()", "method close()"} <= set(gaps)
    assert not any("open" in gap or "secure" in gap for gap in gaps)
