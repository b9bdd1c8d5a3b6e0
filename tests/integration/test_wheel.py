"""The wheel built from this checkout: what it ships and what it leaves out, its dependencies, extras and
entry points, and that what it ships stands without the checkout's dev scaffolding (``dualpath_dev``).

The wheel is built once per module (``python -m build --wheel --no-isolation``; it compiles the small
``nixl_backends._cuobj_compat`` extension, a couple of seconds). setuptools' scratch directories
(``build/``, the ``.egg-info``, the bdist tree) and TMPDIR are pointed under the test's temporary
directory, so the checkout is left as it was; a ``build/`` that appears in the repo root anyway is
removed afterwards, unless it was there before.
"""

from __future__ import annotations

import configparser
import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO_ROOT

PACKAGES = {"nixl_backends", "dualpath_connector", "dualpath_router", "s3agg_gateway_ext", "dualpath_bench"}
REQUIRED_FILES = [
    "dualpath_connector/connector.py",
    "dualpath_connector/plugin.py",
    "dualpath_router/app.py",
    "nixl_backends/store.py",
    "nixl_backends/tiered.py",
    "nixl_backends/dualblade/store.py",  # a subpackage: setuptools needs it listed
    "s3agg_gateway_ext/app.py",
    "dualpath_bench/cli.py",
]
EXCLUDED_DIRS = ["dualpath_dev/", "tests/", "examples/", "benchmarks/", "configs/"]
EXCLUDED_NAMES = {"devstack.py", "demo.py", "disagg_demo.py", "devserver.py"}
NOT_CORE = {"fastapi", "uvicorn", "starlette", "httpx", "tqdm", "matplotlib", "pyyaml"}
EXTRAS = {"router": {"fastapi", "uvicorn"}, "gateway": {"starlette"}, "bench": {"tqdm"}}
CONSOLE_SCRIPTS = {
    "dualpath-router": "dualpath_router.app:main",
    "s3agg-gateway": "s3agg_gateway_ext.app:main",
    "dualpath-bench": "dualpath_bench.cli:main",
    "dualpath-kv": "nixl_backends.cli:main",
}
PLUGIN_ENTRY = ("dualpath_kv", "dualpath_connector.plugin:register")

@pytest.fixture(scope="module")
def wheel(tmp_path_factory, request) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    repo_build = REPO_ROOT / "build"
    build_existed = repo_build.exists()

    def remove_repo_build() -> None:
        if not build_existed and repo_build.is_dir():
            shutil.rmtree(repo_build, ignore_errors=True)

    request.addfinalizer(remove_repo_build)

    # distutils reads DIST_EXTRA_CONFIG after setup.cfg: setuptools' own scratch space goes under tmp.
    for name in ("build", "egg", "bdist", "tmp"):
        (tmp / name).mkdir()
    extra_config = tmp / "setuptools.cfg"
    extra_config.write_text(
        f"[build]\nbuild_base = {tmp / 'build'}\n"
        f"[egg_info]\negg_base = {tmp / 'egg'}\n"
        f"[bdist_wheel]\nbdist_dir = {tmp / 'bdist'}\n"
    )
    env = {**os.environ, "DIST_EXTRA_CONFIG": str(extra_config), "TMPDIR": str(tmp / "tmp")}
    out = tmp / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(REPO_ROOT)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"wheel build failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def names(wheel) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


@pytest.fixture(scope="module")
def dist_info(names) -> str:
    (info,) = {n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")}
    return info


def read(wheel: Path, name: str) -> bytes:
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(name)


# -- contents ------------------------------------------------------------------------------------------


def test_ships_the_packages_and_the_compiled_extension(wheel, names, dist_info):
    missing = [f for f in REQUIRED_FILES if f not in names]
    assert not missing, f"not in the wheel: {missing}"
    assert {n.split("/", 1)[0] for n in names} == PACKAGES | {dist_info}

    so = [n for n in names if re.fullmatch(r"nixl_backends/_cuobj_compat\.[^/]*\.so", n)]
    assert len(so) == 1, f"compiled extension: {so}"
    binary = read(wheel, so[0])
    assert binary[:4] == b"\x7fELF"
    assert b"libcuobjclient.so.1" in binary  # the soname setup.py links it with


def test_leaves_out_dev_scaffolding_tests_and_demos(names):
    excluded = [n for n in names if any(n.startswith(d) for d in EXCLUDED_DIRS)]
    assert not excluded, f"should not be in the wheel: {excluded}"
    demos = [n for n in names if n.rsplit("/", 1)[-1] in EXCLUDED_NAMES]
    assert not demos, f"should not be in the wheel: {demos}"


# -- metadata ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def metadata(wheel, dist_info):
    return email.parser.Parser().parsestr(read(wheel, f"{dist_info}/METADATA").decode())


def test_core_dependencies_leave_http_and_bench_libraries_to_extras(metadata):
    requirements = [Requirement(r) for r in metadata.get_all("Requires-Dist")]
    core = {canonicalize_name(r.name) for r in requirements if r.marker is None or "extra" not in str(r.marker)}
    assert core, "no core Requires-Dist"
    assert not core & NOT_CORE, f"in the core dependencies: {sorted(core & NOT_CORE)}"
    assert "nixl" in core


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_extras_carry_the_services_dependencies(metadata, extra):
    assert extra in metadata.get_all("Provides-Extra")
    requirements = [Requirement(r) for r in metadata.get_all("Requires-Dist")]
    in_extra = {
        canonicalize_name(r.name)
        for r in requirements
        if r.marker is not None and "extra" in str(r.marker) and r.marker.evaluate({"extra": extra})
    }
    assert EXTRAS[extra] <= in_extra, f"[{extra}] has {sorted(in_extra)}"


# -- entry points --------------------------------------------------------------------------------------


def test_entry_points(wheel, names, dist_info):
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # script names are case-sensitive
    parser.read_string(read(wheel, f"{dist_info}/entry_points.txt").decode())

    assert dict(parser["console_scripts"]) == CONSOLE_SCRIPTS
    name, value = PLUGIN_ENTRY
    assert dict(parser["vllm.general_plugins"]) == {name: value}

    # Every target is a function defined in a module the wheel ships.
    for target in [*CONSOLE_SCRIPTS.values(), value]:
        module, func = target.split(":")
        path = module.replace(".", "/") + ".py"
        assert path in names, f"{target}: {path} is not in the wheel"
        assert re.search(rf"^def {func}\(", read(wheel, path).decode(), re.M), f"{target}: no def {func}"


# -- no dualpath_dev at import time --------------------------------------------------------------------

MODULE_LEVEL_DEV_IMPORT = re.compile(r"^(from|import)\s+dualpath_dev\b", re.M)


def test_no_shipped_module_imports_dualpath_dev_at_module_level(wheel, names):
    """A lazy import inside a function (indented) is allowed: only that command needs the checkout."""
    # The pattern can fail: it flags a module-level import and passes an indented one.
    assert MODULE_LEVEL_DEV_IMPORT.search("import os\nfrom dualpath_dev.cluster import ClusterConfig\n")
    assert MODULE_LEVEL_DEV_IMPORT.search("import dualpath_dev\n")
    assert not MODULE_LEVEL_DEV_IMPORT.search("def main():\n    from dualpath_dev.cluster import ClusterConfig\n")
    offenders = []
    for name in names:
        if name.endswith(".py"):
            source = read(wheel, name).decode()
            for match in MODULE_LEVEL_DEV_IMPORT.finditer(source):
                offenders.append(f"{name}:{source.count(chr(10), 0, match.start()) + 1}")
    assert not offenders, f"module-level dualpath_dev imports: {offenders}"


_IMPORT_SCRIPTS = """
import importlib, importlib.util, json, sys
sys.path.insert(0, sys.argv[1])
result = {"dualpath_dev_importable": importlib.util.find_spec("dualpath_dev") is not None}
for target in sys.argv[2:]:
    module, func = target.split(":")
    try:
        mod = importlib.import_module(module)
        result[target] = {"file": mod.__file__, "callable": callable(getattr(mod, func, None))}
    except Exception as exc:
        result[target] = {"error": f"{type(exc).__name__}: {exc}"}
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def script_imports(wheel, tmp_path_factory) -> tuple[Path, dict]:
    """Import each console script's module from the unpacked wheel, in a fresh interpreter outside the checkout."""
    unpacked = tmp_path_factory.mktemp("unpacked")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(unpacked)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # -I: neither the working directory nor PYTHONPATH on sys.path; the unpacked wheel goes first, ahead of
    # the editable install's finder (which maps only the five packages, never dualpath_dev).
    proc = subprocess.run(
        [sys.executable, "-I", "-c", _IMPORT_SCRIPTS, str(unpacked), *CONSOLE_SCRIPTS.values()],
        cwd=unpacked,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return unpacked, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("script", sorted(CONSOLE_SCRIPTS))
def test_console_script_imports_without_the_checkout(script_imports, script):
    unpacked, result = script_imports
    assert result["dualpath_dev_importable"] is False  # the check below can fail
    outcome = result[CONSOLE_SCRIPTS[script]]
    assert "error" not in outcome, f"{script}: {outcome['error']}"
    assert Path(outcome["file"]).is_relative_to(unpacked), outcome["file"]
    assert outcome["callable"]
