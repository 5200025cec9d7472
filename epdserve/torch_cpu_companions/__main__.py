"""``python -m epdserve.torch_cpu_companions install | uninstall | status``."""

import argparse
import sys

import epdserve.torch_cpu_companions as companions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torch_cpu_companions", description=companions.__doc__.split("\n")[0]
    )
    parser.add_argument("command", choices=("install", "uninstall", "status"))
    parser.add_argument(
        "--site-dir",
        default=None,
        help="where the .pth file goes (default: this interpreter's purelib)",
    )
    args = parser.parse_args(argv)
    if args.command == "install":
        print(
            f"wrote {companions.install(args.site_dir)}; acts on: "
            f"{', '.join(companions.plan()) or 'nothing here'}"
        )
    elif args.command == "uninstall":
        path = companions.uninstall(args.site_dir)
        print(f"removed {path}" if path else "no .pth file was installed")
    else:
        print(
            "acts on: "
            + (
                ", ".join(companions.plan())
                or "nothing (torch is a GPU build, or no CUDA-built companion)"
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
