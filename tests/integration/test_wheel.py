"""The wheel built from this checkout: what it ships and what it leaves out, its dependencies, extras and
entry points, and that what it ships stands without the checkout's dev scaffolding (``dualpath_dev``); that it
carries ``libmma_preload.so`` and that the ``mma-run`` it installs preloads it (a fresh virtual environment with the
wheel installed, no dependencies: ``dualpath_mma`` needs none).

The wheel is built once per module, the way pip builds from a source distribution: ``python -m build
--no-isolation`` makes the sdist, then the wheel from the unpacked sdist (so the sdist must carry what the build
needs: mma_preload/'s Makefile and sources, MANIFEST.in). The build compiles the small
``nixl_backends._cuobj_compat`` extension and, with mma_preload/Makefile, libmma_preload.so: 20-30 s here). setuptools' scratch directories
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
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO_ROOT

PACKAGES = {"nixl_backends", "dualpath_connector", "dualpath_router", "s3agg_gateway_ext", "dualpath_bench", "dualpath_mma"}
REQUIRED_FILES = [
    "dualpath_connector/connector.py",
    "dualpath_connector/plugin.py",
    "dualpath_router/app.py",
    "nixl_backends/store.py",
    "nixl_backends/tiered.py",
    "nixl_backends/dualblade/store.py",  # a subpackage: setuptools needs it listed
    "s3agg_gateway_ext/app.py",
    "dualpath_bench/cli.py",
    "dualpath_mma/__init__.py",
    "dualpath_mma/launcher.py",
]
MMA_LIBRARY = "dualpath_mma/libmma_preload.so"
EXCLUDED_DIRS = ["dualpath_dev/", "tests/", "examples/", "benchmarks/", "configs/"]
EXCLUDED_NAMES = {"devstack.py", "demo.py", "disagg_demo.py", "devserver.py"}
NOT_CORE = {"fastapi", "uvicorn", "starlette", "httpx", "tqdm", "matplotlib", "pyyaml"}
EXTRAS = {"router": {"fastapi", "uvicorn"}, "gateway": {"starlette"}, "bench": {"tqdm"}}
CONSOLE_SCRIPTS = {
    "dualpath-router": "dualpath_router.app:main",
    "s3agg-gateway": "s3agg_gateway_ext.app:main",
    "dualpath-bench": "dualpath_bench.cli:main",
    "dualpath-kv": "dualpath_connector.cli:main",
    "mma-run": "dualpath_mma.launcher:main",
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
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO_ROOT)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
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


def test_ships_the_multipath_copy_library(wheel, names, tmp_path):
    assert MMA_LIBRARY in names, "libmma_preload.so is not in the wheel"
    library = tmp_path / "libmma_preload.so"
    library.write_bytes(read(wheel, MMA_LIBRARY))
    assert library.read_bytes()[:4] == b"\x7fELF"
    # Built with the Makefile's flags: only the CUDA copy entry points are exported (-fvisibility=hidden).
    nm = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True, timeout=30)
    exported = {line.split()[-1] for line in nm.stdout.splitlines() if " T " in line}
    assert {"cudaMemcpy", "cudaMemcpyAsync"} <= exported, nm.stdout
    assert not any(name.startswith("_Z") for name in exported), exported


def test_the_sdist_carries_the_library_sources(wheel):
    (sdist,) = wheel.parent.glob("*.tar.gz")
    with tarfile.open(sdist) as tf:
        names = {name.split("/", 1)[1] for name in tf.getnames() if "/" in name}
    assert {"setup.py", "mma_preload/Makefile", "mma_preload/src/mma_preload.cpp", "mma_preload/src/cuda_min.h",
            "nixl_backends/csrc/cuobj_compat.cpp", "dualpath_mma/launcher.py"} <= names  # fmt: skip
    assert not any(name.startswith("mma_preload/build/") for name in names)  # built, never shipped as source


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


# -- mma-run from an installed copy --------------------------------------------------------------------

_REPORT_PRELOAD = """
import json, os
maps = open("/proc/self/maps").read()
print(json.dumps({"LD_PRELOAD": os.environ.get("LD_PRELOAD", ""),
                  "mapped": sorted({line.split()[-1] for line in maps.splitlines() if "libmma_preload" in line})}))
"""


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> dict:
    """The wheel installed (without dependencies) into a fresh virtual environment: its bin/ and the library."""
    venv = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    proc = subprocess.run(
        [venv / "bin" / "python", "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    (library,) = venv.glob("lib/python*/site-packages/dualpath_mma/libmma_preload.so")
    return {"bin": venv / "bin", "library": library}


def _clean_env(bin_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MMA_", "LD_")) and k != "PYTHONPATH"}
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", **extra}


def _report(argv: list[str], env: dict[str, str]) -> dict:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd="/")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_mma_run_preloads_the_installed_library(installed):
    python, library = str(installed["bin"] / "python"), str(installed["library"])
    env = _clean_env(installed["bin"])
    preloaded = _report([str(installed["bin"] / "mma-run"), python, "-c", _REPORT_PRELOAD], env)
    assert preloaded == {"LD_PRELOAD": library, "mapped": [library]}
    # Negative control: the same child without mma-run has nothing of it mapped.
    assert _report([python, "-c", _REPORT_PRELOAD], env) == {"LD_PRELOAD": "", "mapped": []}
    # An existing LD_PRELOAD stays, after the library (mma-run found on PATH); the library is listed once.
    for existing in ("libm.so.6", f"libm.so.6:{library}"):
        assert _report(["mma-run", python, "-c", _REPORT_PRELOAD], {**env, "LD_PRELOAD": existing}) == {
            "LD_PRELOAD": f"{library}:libm.so.6", "mapped": [library]}  # fmt: skip


def test_mma_run_without_a_command_prints_usage(installed):
    proc = subprocess.run([str(installed["bin"] / "mma-run")], capture_output=True, text=True, timeout=30,
                          env=_clean_env(installed["bin"]))  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: mma-run COMMAND [ARGS...]")


def test_mma_run_with_the_library_missing_exits_127(installed, tmp_path):
    env = _clean_env(installed["bin"])
    mma_run, library = str(installed["bin"] / "mma-run"), installed["library"]
    missing = tmp_path / "nowhere" / "libmma_preload.so"
    proc = subprocess.run([mma_run, "true"], capture_output=True, text=True, timeout=30,
                          env={**env, "MMA_PRELOAD_LIB": str(missing)})  # fmt: skip
    assert (proc.returncode, proc.stderr.strip()) == (127, f"mma-run: MMA_PRELOAD_LIB={missing}: no such file")
    moved = tmp_path / "moved.so"
    library.rename(moved)
    try:
        proc = subprocess.run([mma_run, "true"], capture_output=True, text=True, timeout=30, env=env)
    finally:
        moved.rename(library)
    assert proc.returncode == 127
    assert "libmma_preload.so not found" in proc.stderr and str(library) in proc.stderr, proc.stderr
    # The command's own status comes back; an unknown command is 127 with its name.
    assert subprocess.run([mma_run, "sh", "-c", "exit 7"], env=env, timeout=30).returncode == 7
    proc = subprocess.run([mma_run, "no-such-command-here"], capture_output=True, text=True, timeout=30, env=env)
    assert (proc.returncode, proc.stderr.strip()) == (127, "mma-run: no-such-command-here: command not found")


def test_the_editable_install_finds_the_checkouts_build():
    """`make mma` builds mma_preload/build/libmma_preload.so; the checkout's dualpath_mma falls back to it."""
    proc = subprocess.run(["make", "-C", str(REPO_ROOT / "mma_preload"), "build/libmma_preload.so"],
                          capture_output=True, text=True, timeout=280)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = subprocess.run([sys.executable, "-c", "import dualpath_mma; print(dualpath_mma.library_path())"],
                          capture_output=True, text=True, timeout=60, cwd="/")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(REPO_ROOT / "mma_preload" / "build" / "libmma_preload.so")
