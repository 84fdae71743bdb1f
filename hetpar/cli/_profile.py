"""`hetpar profile`: measure the devices present and write a profile file."""

from __future__ import annotations

import sys


def register(subparsers) -> None:
    """Adds the `profile` sub-command."""
    p = subparsers.add_parser(
        "profile",
        help="measure the devices present (FLOP/s, bandwidth, dispatch, transfers)",
        description=(
            "Measure every device present (jax.devices() plus the CPU): matmul FLOP/s, "
            "memory bandwidth, dispatch overhead, and transfer time for every ordered "
            "device pair and path. The file written overrides the built-in spec sheets."
        ),
    )
    p.add_argument("--out", default="profiles.json", help="file to write (default %(default)s)")
    p.add_argument(
        "--quick", action="store_true", help="small sizes, few repetitions (transfers <= 16 MB)"
    )
    p.add_argument(
        "--devices",
        default=None,
        help="comma-separated devices to measure (e.g. cpu:0,gpu:0); default: all present",
    )
    p.add_argument("--no-transfers", action="store_true", help="skip the device-pair transfers")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from hetpar.cost_models import profile_devices, save_profiles, summary_table

    devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices else None

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    profiles = profile_devices(
        devices, quick=args.quick, transfers=not args.no_transfers, progress=progress
    )
    save_profiles(args.out, profiles)
    print(summary_table(profiles))
    print(f"wrote {args.out}")
    return 0
