"""The arguments the CPU analyses of a search share (a profile, a dense batch, a workload) and
the search's config they name. Pure Python over nanosched's search; no torch."""

from __future__ import annotations

import argparse

from nanosched.autosearch.search import SearchConfig
from nanosched.profiler.catalog import load_named_profile
from nanosched.workloads import resolve_workload


def add_search_args(ap: argparse.ArgumentParser) -> None:
    """--profile, --dense-batch, --input-len / --output-len or --workload."""
    ap.add_argument("--profile", required=True, help="profile FILE or shipped NAME")
    ap.add_argument("--dense-batch", default="auto", help="tokens, or auto: the profile's")
    ap.add_argument("--input-len", type=float, default=1024)
    ap.add_argument("--output-len", type=float, default=512)
    ap.add_argument("--workload", default=None, help="a dataset name instead of the lengths")


def search_config(args: argparse.Namespace) -> SearchConfig:
    """The search's config for `add_search_args`' arguments (its profile: `cfg.profile`)."""
    prof = load_named_profile(args.profile)
    b = prof.dense_batch if args.dense_batch == "auto" else int(args.dense_batch)
    workload = resolve_workload(args.workload, None if args.workload else args.input_len,
                                None if args.workload else args.output_len)
    return SearchConfig(prof.model, prof.tp, prof, workload, b)
