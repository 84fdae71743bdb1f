"""`hetpar models`: the zoo's models and their parameter counts."""

from hetpar.core import human


def register(sub) -> None:
    p = sub.add_parser("models", help="list the zoo's models with parameter counts",
                       description="The zoo's models (the MODEL of every other command), "
                                   "with parameter counts at the reference and --small "
                                   "configs and their input.")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from hetpar import zoo

    print(f"{'model':<20} {'params':>10} {'params (small)':>15}  input")
    for name in zoo.names():
        ref = zoo.describe(name)
        small = zoo.describe(name, small=True)
        print(f"{name:<20} {human(ref['params']):>10} {human(small['params']):>15}  "
              f"{ref.get('input_shape')}")
    return 0
