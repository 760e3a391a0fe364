import sys


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"attention": "attention", "batch": "batch", "cold-start": "cold_start", "fused-step": "fused_step",
                "gdn": "gdn", "gdn-state-map": "gdn_state_map", "latency": "latency", "plot": "plot",
                "profile": "profile", "selectors": "selectors", "serve": "serve", "serve-load": "serve_load"}
    if not argv or argv[0] not in commands:
        print(f"usage: python -m raincheck_hf.bench {{{','.join(commands)}}} [options]", file=sys.stderr)
        return 2
    import importlib

    status = importlib.import_module(f"raincheck_hf.bench.{commands[argv[0]]}").main(argv[1:])
    return status if isinstance(status, int) else 0  # benchmarks return their result dict


if __name__ == "__main__":
    sys.exit(main())
