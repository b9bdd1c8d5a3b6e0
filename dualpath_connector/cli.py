"""dualpath-kv: store maintenance and pre-launch checks from the command line.

    dualpath-kv gc --store '{"backend": "posix", "root": "/mnt/kv"}' --all-namespaces --max-bytes 500GiB
    dualpath-kv gc --store-file store.json --namespace 3f2a... --max-age 7d --dry-run
    dualpath-kv doctor --config-file configs/pe.json      # or --kv-transfer-config JSON, --store JSON; --json
    DUALPATH_CONFIG_PATCH='{"host": "0.0.0.0"}' dualpath-kv patch-config configs/router.yaml

The store is named by the connector's ``store`` section (JSON). S3 credentials
come from the AWS credential chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
the AWS config files, an instance role), never from the command line, which
every user of the machine can read. Exit status: 0 done, 1 the store failed
(unreachable, a deletion refused) or a doctor check failed, 2 bad arguments (the message names the option).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from datetime import datetime, timezone
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from nixl_backends.config_patch import PATCH_ENV, patched_config_text
from nixl_backends.configuration import ConfigError
from nixl_backends.gc import GcError, GcPolicy, GcReport, StoredObject, Tally, open_chunks, run_gc
from nixl_backends.registry import parse_store_config
from nixl_backends.removals import RemovalLog

logger = logging.getLogger(__name__)

_NUMBER_UNIT = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)")
_SIZE_UNITS = {"": 1, "b": 1}
for _power, _letter in enumerate("kmgtp", start=1):
    _SIZE_UNITS.update({_letter: 1000**_power, f"{_letter}b": 1000**_power, f"{_letter}ib": 1024**_power})
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_CREDENTIAL_KEYS = ("access_key", "secret_key")


def _scaled(text: str, units: dict[str, int], what: str, hint: str) -> float:
    match = _NUMBER_UNIT.fullmatch(text.strip().lower())
    if match is None or match[2] not in units:
        raise argparse.ArgumentTypeError(f"bad {what} {text!r}: {hint}")
    return float(match[1]) * units[match[2]]


def parse_size(text: str) -> int:
    """``10GiB``, ``500G`` (decimal), ``1.5TiB``, ``4096``: bytes."""
    return int(_scaled(text, _SIZE_UNITS, "size", "a number with an optional unit, e.g. 500GiB, 2TB, 1048576"))


def parse_duration(text: str) -> float:
    """``7d``, ``12h``, ``30m``, ``45s``, ``2w``, ``90`` (seconds): seconds."""
    return _scaled(text, _DURATION_UNITS, "duration", "a number with a unit s, m, h, d or w, e.g. 7d")


def _namespace(text: str) -> str:
    if not re.fullmatch(r"[0-9a-f]+", text):
        raise argparse.ArgumentTypeError(f"bad namespace {text!r}: the hex digest that names a namespace's directory")
    return text


def _key_prefix(text: str) -> str:
    parts = text.strip("/").split("/")
    if text.strip("/") and any(part in ("", ".", "..") for part in parts):
        raise argparse.ArgumentTypeError(f"bad key prefix {text!r}: no empty, '.' or '..' components")
    return text.strip("/")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dualpath-kv", description="dualpath-kv store maintenance and checks")
    commands = parser.add_subparsers(dest="command", required=True)
    gc = commands.add_parser(
        "gc",
        help="delete chunks, oldest-last-used first, until a namespace fits a byte budget and/or an age",
        description="Keep stored chunks under --max-bytes and/or --max-age, deleting the least recently "
        "used first (POSIX: file mtime, refreshed by every read; S3: LastModified, the last write). "
        "Safe while engines read and write the store.",
    )
    where = gc.add_mutually_exclusive_group(required=True)
    where.add_argument("--store", metavar="JSON", help="the connector's store section, e.g. "
                       '\'{"backend": "posix", "root": "/mnt/kv"}\'')  # fmt: skip
    where.add_argument("--store-file", metavar="PATH", help="a file holding that JSON")
    gc.add_argument("--key-prefix", type=_key_prefix, default="dualpath",
                    help="the connector's key_prefix (default: dualpath)")  # fmt: skip
    which = gc.add_mutually_exclusive_group(required=True)
    which.add_argument("--namespace", type=_namespace, action="append", metavar="DIGEST",
                       help="a namespace to collect (repeatable); engines export theirs on /metrics as "
                       "dualpath_kv:store_namespace_info{namespace=...}")  # fmt: skip
    which.add_argument("--all-namespaces", action="store_true",
                       help="every namespace under the key prefix, under one budget")  # fmt: skip
    gc.add_argument("--max-bytes", type=parse_size, metavar="SIZE", help="byte budget, e.g. 500GiB or 2TB")
    gc.add_argument("--max-age", type=parse_duration, metavar="AGE", help="delete chunks unused for longer, e.g. 7d")
    gc.add_argument("--tmp-max-age", type=parse_duration, default=1800.0, metavar="AGE",
                    help="POSIX: remove interrupted writes' *.tmp files older than this (default 30m)")  # fmt: skip
    gc.add_argument("--record-max-age", type=parse_duration, default=86400.0, metavar="AGE",
                    help="prune gc's removal records (which engines announce as KV events) older than this "
                    "(default 1d)")  # fmt: skip
    gc.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")
    # Errors found after parsing are reported by the subcommand's parser, with its usage.
    gc.set_defaults(run=cmd_gc, parser=gc)

    doctor = commands.add_parser(
        "doctor",
        help="check a configuration before a launch: it parses, NIXL's plugins load, the store is reachable and writable",
        description="Checks what would stop an engine, one line each: the configuration parses (the connector's "
        "own parser), the side-channel key is set (PD roles), NIXL's UCX/POSIX/OBJ plugins load, each store is "
        "reachable with the credentials the engine would use (the AWS credential chain) and writable (a probe "
        "object written, read back, compared and deleted). Exit status 0 when every check passes, else 1. "
        "Secrets never appear in the output.",
    )
    source = doctor.add_mutually_exclusive_group(required=True)
    source.add_argument("--kv-transfer-config", metavar="JSON",
                        help="vLLM's --kv-transfer-config value, or the connector's kv_connector_extra_config")  # fmt: skip
    source.add_argument("--config-file", metavar="PATH", help="a file holding that JSON, e.g. configs/pe.json")
    source.add_argument("--store", metavar="JSON", help="a bare store section, as gc takes it")
    doctor.add_argument("--kv-role", choices=("kv_both", "kv_producer", "kv_consumer"),
                        help="the engine's role (default: the config's kv_role, or kv_both for an extra config)")  # fmt: skip
    doctor.add_argument("--key-prefix", type=_key_prefix, default="dualpath",
                        help="with --store: the connector's key_prefix (default: dualpath)")  # fmt: skip
    doctor.add_argument("--json", action="store_true", help="print the results as JSON")
    doctor.set_defaults(run=cmd_doctor, parser=doctor)

    patch = commands.add_parser(
        "patch-config",
        help=f"print a config file with the JSON merge patch in ${PATCH_ENV} applied",
        description=f"Prints the config file (JSON for .json, else YAML) with the JSON merge patch (RFC 7396) "
        f"held in ${PATCH_ENV} applied: what the image's entrypoint does before a service reads its config.",
    )
    patch.add_argument("path", metavar="PATH", help="the config file, e.g. configs/router.yaml")
    patch.set_defaults(run=cmd_patch_config, parser=patch)
    return parser


def cmd_patch_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        print(patched_config_text(args.path, os.environ.get(PATCH_ENV, "{}")), end="")
    except ConfigError as exc:
        parser.error(str(exc))
    return 0


def _load_json(parser: argparse.ArgumentParser, option: str, text: str | None, path: str | None) -> Any:
    """The JSON given inline (``text``) or in the file at ``path``; a usage error naming ``option`` if not."""
    try:
        if text is not None:
            return json.loads(text)
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except OSError as exc:
        parser.error(f"{option}: cannot read {path!r}: {exc.strerror}")
    except json.JSONDecodeError as exc:
        # The position only: the text may hold a secret.
        parser.error(f"{option}: not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}")


def _refuse_inline_credentials(parser: argparse.ArgumentParser, option: str, section: Any) -> None:
    for where, part in (("store.", section), ("store.s3.", section.get("s3") if isinstance(section, dict) else None)):
        for key in _CREDENTIAL_KEYS:
            if isinstance(part, dict) and key in part:
                parser.error(
                    f"{option}: {where}{key} is not accepted here; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                    "or another AWS credential source"
                )


def _store_section(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    option = "--store" if args.store is not None else "--store-file"
    section = _load_json(parser, option, args.store, args.store_file)
    _refuse_inline_credentials(parser, option, section)
    try:
        return parse_store_config(section)
    except ConfigError as exc:
        parser.error(f"{option}: {exc}")


def _bytes(n: int) -> str:
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n} bytes ({n / scale:.1f} {unit})"
    return f"{n} bytes"


def _line(label: str, tally: Tally) -> str:
    return f"{label:<14}{tally.objects} objects, {_bytes(tally.bytes)}"


def _print_selected(obj: StoredObject) -> None:
    used = datetime.fromtimestamp(obj.used_ns / 1e9, timezone.utc).isoformat(timespec="seconds")
    print(f"would delete {obj.key}  {obj.size} bytes  last used {used}")


def _print_report(report: GcReport, where: str) -> None:
    print(f"{'store:':<14}{where}")
    print(_line("before:", report.before))
    for namespace, tally in sorted(report.before_by_namespace.items()):
        print(_line("", tally) + f"  namespace {namespace}")
    print(_line("would delete:" if report.dry_run else "deleted:", report.deleted))
    print(_line("after:", report.after))
    if report.partial_deleted.objects:
        verb = "would remove" if report.dry_run else "removed"
        removed = report.partial_deleted
        print(f"{verb} {removed.objects} interrupted writes (*.tmp), {_bytes(removed.bytes)}")
    if report.failed:
        print(f"{'failed:':<14}{report.failed} objects could not be deleted (see the warnings)")


def cmd_gc(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.max_bytes is None and args.max_age is None:
        parser.error("give --max-bytes and/or --max-age")
    config = _store_section(parser, args)
    policy = GcPolicy(args.max_bytes, args.max_age, args.tmp_max_age)
    try:
        chunks = open_chunks(config, args.key_prefix, args.namespace)
    except GcError as exc:
        parser.error(f"{'--store' if args.store is not None else '--store-file'}: {exc}")
    # Engines announce the deletions (vLLM KV events) from these records.
    removals = RemovalLog(chunks, args.key_prefix)
    report = run_gc(chunks, policy, dry_run=args.dry_run, on_selected=_print_selected if args.dry_run else None,
                    on_deleted=removals.record)  # fmt: skip
    if not args.dry_run:
        removals.prune(args.namespace or sorted(report.before_by_namespace), args.record_max_age)
    _print_report(report, f"{chunks.describe()}, key prefix {args.key_prefix!r}, namespaces: "
                  f"{'all' if args.namespace is None else ', '.join(args.namespace)}")  # fmt: skip
    return 1 if report.failed else 0


def cmd_doctor(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from dualpath_connector.doctor import diagnose
    from nixl_backends.doctor import diagnose_store, exit_code, format_report, nixl_logs_to_stderr

    nixl_logs_to_stderr()

    if args.store is not None:
        section = _load_json(parser, "--store", args.store, None)
        _refuse_inline_credentials(parser, "--store", section)
        results = diagnose_store(section, key_prefix=args.key_prefix)
    else:
        option = "--kv-transfer-config" if args.kv_transfer_config is not None else "--config-file"
        document = _load_json(parser, option, args.kv_transfer_config, args.config_file)
        results = diagnose(document, kv_role=args.kv_role)
    print(format_report(results, as_json=args.json))
    return exit_code(results)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    try:
        return args.run(args.parser, args)
    except (OSError, BotoCoreError, ClientError) as exc:
        # The store failed (unreachable, refused, no credentials); botocore's messages carry no secret.
        print(f"dualpath-kv {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
