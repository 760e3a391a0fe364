import sys


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"fused-step": "fused_step"}
    if not argv or argv[0] not in commands:
        print(f"usage: python -m raincheck_hf.bench {{{','.join(commands)}}} [options]", file=sys.stderr)
        return 2
    import importlib

    importlib.import_module(f"raincheck_hf.bench.{commands[argv[0]]}").main(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
