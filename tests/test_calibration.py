"""The calibrations (amoe/perf/model/calibrations): each dated file frozen by its hash, the active one named in one
place and complete (every constant the model reads with its value, unit, source, where and derivation), and a bad
file refused with a line naming what is wrong."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from amoe.errors import ConfigError
from amoe.perf.model import calibrations
from amoe.perf.model.calibrations import ENTRY_KEYS, ExchangeConstants, KernelConstants

# Every dated calibration and the sha256 of its bytes. A calibration is never edited once written: a change is a
# new dated file (and a new line here), so a prediction made with an old one can be made again.
PINNED = {
    "2026-11-29": "f5f5a3c0530a03108e6349fd8b2cf0cde178548d3d2726e293f0706e5e7bf1c9",
}


def test_every_dated_file_is_pinned_and_unchanged():
    assert set(calibrations.names()) == set(PINNED), "a calibration file without its pinned hash (or gone)"
    for name, digest in PINNED.items():
        got = hashlib.sha256(calibrations.path_of(name).read_bytes()).hexdigest()
        assert got == digest, f"calibration {name} was edited: write a new dated file instead"


def test_the_active_calibration_is_pinned_and_loads_complete():
    assert calibrations.ACTIVE in PINNED
    cal = calibrations.load()
    assert cal.name == calibrations.ACTIVE
    raw = calibrations.load_raw(cal.name)
    for arch, body in raw["architectures"].items():
        k = cal.for_arch(arch)
        assert isinstance(k, KernelConstants)
        if "same_as" in body:
            assert body["why"].startswith("assumed"), f"{arch} borrows another's constants without saying so"
            continue
        for name in KernelConstants.__dataclass_fields__:
            assert all(raw["architectures"][arch]["constants"][name][key] != "" for key in ENTRY_KEYS[1:])
    for name in ExchangeConstants.__dataclass_fields__:
        assert set(ENTRY_KEYS) <= set(raw["exchange"][name])
    # the measurements the constants came from are in the file, and what was kept out of it says why
    assert {"deepgemm", "flashmla", "deepep", "decode_profile", "prefill_profile"} <= set(raw["sources"])
    assert raw["sources"]["excluded"]


@pytest.fixture()
def copy(tmp_path, monkeypatch):
    """The active file copied into an empty calibrations directory (the loader pointed at it)."""
    shutil.copy(calibrations.path_of("2026-11-29"), tmp_path)
    monkeypatch.setattr(calibrations, "DIRECTORY", tmp_path)
    calibrations.load.cache_clear()
    yield tmp_path / "2026-11-29.json"
    calibrations.load.cache_clear()


def test_a_constant_without_its_source_is_refused(copy):
    raw = json.loads(copy.read_text())
    del raw["architectures"]["hopper"]["constants"]["half_rows"]["source"]
    copy.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"architectures\.hopper\.half_rows needs value, unit, source"):
        calibrations.load("2026-11-29")


def test_an_unknown_calibration_names_the_ones_there_are(copy):
    with pytest.raises(ConfigError, match="unknown calibration '2025-01-01'; choose from 2026-11-29"):
        calibrations.load("2025-01-01")


def test_a_borrowed_architecture_must_say_why(copy):
    raw = json.loads(copy.read_text())
    del raw["architectures"]["ada"]["why"]
    copy.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="ada borrows 'hopper' without a why"):
        calibrations.load("2026-11-29")


def test_every_gpu_has_its_architectures_constants():
    from amoe.perf.model.gpus import SHEETS

    cal = calibrations.load()
    for sheet in SHEETS.values():
        assert isinstance(cal.for_arch(sheet.arch), KernelConstants)


def test_the_active_calibrations_derived_constants_follow_from_its_sources():
    """Every derived Hopper constant is what calibration_derive computes from the file's own sources with the
    code as it stands: a change of the model that moves one needs a new dated calibration."""
    from amoe.perf.studies import calibration_derive

    raw = calibrations.load_raw(calibrations.ACTIVE)
    derived = calibration_derive.derive(raw)
    stored = {**raw["architectures"]["hopper"]["constants"], **raw["exchange"]}
    for key, value in derived.items():
        if key in stored:
            assert value == pytest.approx(float(stored[key]["value"]), rel=1e-9, abs=1e-15), key


def test_naming_a_calibration_prices_every_gpu_with_it(copy, monkeypatch):
    """`--calibration NAME`: the GPU profiles (and through them every kernel time) take that file's constants."""
    from amoe.perf.model import gpus

    raw = json.loads(copy.read_text())
    raw["name"] = "2027-01-01"
    raw["architectures"]["hopper"]["constants"]["launch_s"]["value"] = 9e-6
    (copy.parent / "2027-01-01.json").write_text(json.dumps(raw))
    kept = dict(gpus.GPUS)
    try:
        gpus.apply_calibration("2027-01-01")
        assert gpus.gpu_profile("h100").launch_s == 9e-6
        assert gpus.gpu_profile("a100-80g") == kept["a100-80g"]  # Ampere's constants are the same in both
    finally:
        gpus.GPUS.update(kept)
